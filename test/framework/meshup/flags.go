package meshup

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"slices"
	"strings"
)

// Flags choose the environment of the end-to-end tests: with no
// -isthmus.kubeconfig the local real-node clusters (StartLocal), otherwise
// the clusters the kubeconfigs reach (NewExternal). A test calls Start
// and never knows which it got. Every flag but -isthmus.registry is
// repeatable and keyed by cluster name:
//
//	-isthmus.kubeconfig cluster-1=path  (in order: the first runs pilot)
//	-isthmus.context cluster-1=ctx       (default: the file's current context)
//	-isthmus.network cluster-1=network1  (required per cluster)
//	-isthmus.remote-server cluster-2=https://10.2.0.1:6443
//	-isthmus.node-ip cluster-1=10.1.0.2
//	-isthmus.values cluster-1/isthmus-cni=netnsDir=/run/netns
//	-isthmus.image server=registry.example.com:5000/isthmus/server:test
//	-isthmus.registry registry.example.com:5000
type Flags struct {
	kubeconfigs, contexts, networks, remoteServers, nodeIPs, values, images pairs
	registry                                                                string
}

// AddFlags defines the flags on fs (a test's TestMain passes
// flag.CommandLine before m.Run parses it).
func AddFlags(fs *flag.FlagSet) *Flags {
	f := &Flags{}
	fs.Var(&f.kubeconfigs, "isthmus.kubeconfig", "`cluster=path` of an existing cluster's kubeconfig, in order, the first runs pilot (repeat; none: local real-node clusters)")
	fs.Var(&f.contexts, "isthmus.context", "`cluster=context` in its kubeconfig (repeat)")
	fs.Var(&f.networks, "isthmus.network", "`cluster=network` its nodes are on (repeat; required with -isthmus.kubeconfig)")
	fs.Var(&f.remoteServers, "isthmus.remote-server", "`cluster=url` of its API server as pilot's cluster reaches it (repeat)")
	fs.Var(&f.nodeIPs, "isthmus.node-ip", "`cluster=ip` of a node other networks reach (repeat; default: first node's InternalIP)")
	fs.Var(&f.values, "isthmus.values", "`cluster/release=key=value` helm --set for that release (repeat)")
	fs.Var(&f.images, "isthmus.image", "`name=reference` of a test image pushed where the clusters pull (repeat)")
	fs.StringVar(&f.registry, "isthmus.registry", "", "image registry make push pushed to (required with -isthmus.kubeconfig)")
	return f
}

// External reports whether kubeconfigs were given.
func (f *Flags) External() bool { return len(f.kubeconfigs) > 0 }

// Options are the flags as ExternalOptions, checked: every key names a
// cluster, every cluster has a network, addresses parse.
func (f *Flags) Options() (ExternalOptions, error) {
	opts := ExternalOptions{Registry: f.registry, Images: map[string]string{}}
	var errs []error
	names := make([]string, 0, len(f.kubeconfigs))
	for _, kv := range f.kubeconfigs {
		if slices.Contains(names, kv.key) {
			errs = append(errs, fmt.Errorf("-isthmus.kubeconfig: cluster %s twice", kv.key))
		}
		names = append(names, kv.key)
		opts.Clusters = append(opts.Clusters, ExternalCluster{Name: kv.key, Kubeconfig: kv.value, Values: map[string][]string{}})
	}
	cluster := func(flagName, name string) *ExternalCluster {
		if i := slices.Index(names, name); i >= 0 {
			return &opts.Clusters[i]
		}
		errs = append(errs, fmt.Errorf("-%s: no -isthmus.kubeconfig for cluster %q", flagName, name))
		return &ExternalCluster{Values: map[string][]string{}}
	}
	for _, kv := range f.contexts {
		cluster("isthmus.context", kv.key).Context = kv.value
	}
	for _, kv := range f.networks {
		cluster("isthmus.network", kv.key).Network = kv.value
	}
	for _, kv := range f.remoteServers {
		cluster("isthmus.remote-server", kv.key).RemoteServer = kv.value
	}
	for _, kv := range f.nodeIPs {
		ip, err := netip.ParseAddr(kv.value)
		if err != nil {
			errs = append(errs, fmt.Errorf("-isthmus.node-ip %s: %w", kv.key, err))
		}
		cluster("isthmus.node-ip", kv.key).NodeIP = ip
	}
	for _, kv := range f.values {
		name, release, ok := strings.Cut(kv.key, "/")
		if !ok || release == "" || !strings.Contains(kv.value, "=") {
			errs = append(errs, fmt.Errorf("-isthmus.values %s=%s: want cluster/release=key=value", kv.key, kv.value))
			continue
		}
		c := cluster("isthmus.values", name)
		c.Values[release] = append(c.Values[release], kv.value)
	}
	for _, kv := range f.images {
		opts.Images[kv.key] = kv.value
	}
	for _, c := range opts.Clusters {
		if c.Network == "" {
			errs = append(errs, fmt.Errorf("cluster %s: no -isthmus.network", c.Name))
		}
	}
	if len(opts.Clusters) > 0 && opts.Registry == "" {
		errs = append(errs, errors.New("-isthmus.kubeconfig needs -isthmus.registry (where make push put the images)"))
	}
	return opts, errors.Join(errs...)
}

// Start returns the environment the flags name, and how to end it: the
// local clusters (built and started with local) or the external ones.
func (f *Flags) Start(ctx context.Context, local LocalOptions) (Env, func() error, error) {
	if !f.External() {
		l, err := StartLocal(ctx, local)
		if err != nil {
			return nil, nil, err
		}
		return l, l.Stop, nil
	}
	opts, err := f.Options()
	if err != nil {
		return nil, nil, err
	}
	x, err := NewExternal(ctx, opts)
	if err != nil {
		return nil, nil, err
	}
	return x, x.Close, nil
}

// pairs is a repeatable key=value flag.
type pairs []pair

type pair struct{ key, value string }

func (p *pairs) String() string {
	if p == nil {
		return ""
	}
	out := make([]string, 0, len(*p))
	for _, kv := range *p {
		out = append(out, kv.key+"="+kv.value)
	}
	return strings.Join(out, ",")
}

func (p *pairs) Set(s string) error {
	k, v, ok := strings.Cut(s, "=")
	if !ok || k == "" || v == "" {
		return fmt.Errorf("%q: want key=value", s)
	}
	*p = append(*p, pair{k, v})
	return nil
}
