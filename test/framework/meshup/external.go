package meshup

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
)

// ExternalCluster is a cluster given by a kubeconfig.
type ExternalCluster struct {
	// Name is the cluster's ID; Network its nodes' network.
	Name, Network string
	// Kubeconfig is the file; Context its context ("" is the current one).
	Kubeconfig, Context string
	// RemoteServer, when set, is the API server's URL as pilot's cluster
	// reaches it (for its remote Secret); the kubeconfig's server name
	// still verifies its certificate (tls-server-name). Default: the
	// kubeconfig's server.
	RemoteServer string
	// NodeIP overrides the node address other networks reach (default:
	// the InternalIP of the first node by name).
	NodeIP netip.Addr
	// Values are --set expressions by release (see Cluster.Values).
	Values map[string][]string
}

// ExternalOptions configures NewExternal.
type ExternalOptions struct {
	// Clusters in order: the first runs pilot.
	Clusters []ExternalCluster
	// Registry is where `make push` put the charts' images.
	Registry string
	// Images name the tests' own images (Env.ImageRef), pushed where the
	// clusters pull from.
	Images map[string]string
}

// External is an environment of existing clusters (kind, a cloud): it
// changes nothing but what the install and the tests create.
type External struct {
	opts     ExternalOptions
	clusters []Cluster
}

var _ Env = (*External)(nil)

// NewExternal loads each kubeconfig and finds each cluster's node address.
func NewExternal(ctx context.Context, opts ExternalOptions) (*External, error) {
	if opts.Registry == "" {
		return nil, errors.New("external clusters: no image registry (where make push put the images)")
	}
	x := &External{opts: opts}
	for _, ec := range opts.Clusters {
		c, err := loadCluster(ctx, ec)
		if err != nil {
			return nil, fmt.Errorf("cluster %s: %w", ec.Name, err)
		}
		x.clusters = append(x.clusters, c)
	}
	return x, nil
}

func loadCluster(ctx context.Context, ec ExternalCluster) (Cluster, error) {
	if ec.Name == "" || ec.Network == "" || ec.Kubeconfig == "" {
		return Cluster{}, errors.New("a cluster needs a name, a network and a kubeconfig")
	}
	if _, err := os.Stat(ec.Kubeconfig); err != nil {
		return Cluster{}, err
	}
	cc := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(
		&clientcmd.ClientConfigLoadingRules{ExplicitPath: ec.Kubeconfig}, &clientcmd.ConfigOverrides{CurrentContext: ec.Context})
	rc, err := cc.ClientConfig()
	if err != nil {
		return Cluster{}, fmt.Errorf("kubeconfig %s: %w", ec.Kubeconfig, err)
	}
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return Cluster{}, err
	}
	ip := ec.NodeIP
	if !ip.IsValid() {
		if ip, err = nodeInternalIP(ctx, client); err != nil {
			return Cluster{}, err
		}
	}
	return Cluster{Name: ec.Name, Network: ec.Network, Config: rc, Client: client, NodeIP: ip, Values: ec.Values}, nil
}

// nodeInternalIP is the InternalIP of the first node by name.
func nodeInternalIP(ctx context.Context, c kubernetes.Interface) (netip.Addr, error) {
	nodes, err := c.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return netip.Addr{}, fmt.Errorf("list nodes: %w", err)
	}
	slices.SortFunc(nodes.Items, func(a, b corev1.Node) int { return strings.Compare(a.Name, b.Name) })
	for _, n := range nodes.Items {
		for _, a := range n.Status.Addresses {
			if a.Type == corev1.NodeInternalIP {
				if ip, err := netip.ParseAddr(a.Address); err == nil {
					return ip, nil
				}
			}
		}
	}
	return netip.Addr{}, errors.New("no node with an InternalIP")
}

// Close closes the idle connections of every client of the clusters'
// configs (client-go shares one transport per config): the clusters stay.
func (x *External) Close() error {
	var errs []error
	for _, c := range x.clusters {
		hc, err := rest.HTTPClientFor(c.Config)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		hc.CloseIdleConnections()
	}
	return errors.Join(errs...)
}

// Clusters are the loaded clusters.
func (x *External) Clusters() []Cluster { return x.clusters }

// Expose does nothing: the clusters' networks are what they are.
func (x *External) Expose(netip.AddrPort) error { return nil }

// Registry is ExternalOptions.Registry.
func (x *External) Registry() string { return x.opts.Registry }

// ImageRef is the reference ExternalOptions.Images gives name.
func (x *External) ImageRef(name string) string { return x.opts.Images[name] }

// RemoteKubeconfig makes the reader identity in cluster (as
// create-remote-secret does) and its kubeconfig, whose server is
// RemoteServer when set.
func (x *External) RemoteKubeconfig(ctx context.Context, cluster, clusterID string) ([]byte, error) {
	i := slices.IndexFunc(x.clusters, func(c Cluster) bool { return c.Name == cluster })
	if i < 0 {
		return nil, fmt.Errorf("no cluster %q", cluster)
	}
	c, ec := x.clusters[i], x.opts.Clusters[i]
	token, err := remotesecret.EnsureReader(ctx, c.Client, remotesecret.ReaderOptions{})
	if err != nil {
		return nil, err
	}
	ca := c.Config.CAData
	if len(ca) == 0 && c.Config.CAFile != "" {
		if ca, err = os.ReadFile(c.Config.CAFile); err != nil {
			return nil, err
		}
	}
	kc, err := remotesecret.Kubeconfig(clusterID, c.Config.Host, ca, token)
	if err != nil || ec.RemoteServer == "" {
		return kc, err
	}
	return remotesecret.ReplaceServer(kc, ec.RemoteServer)
}
