package server

import (
	"cmp"
	"context"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"
	corev1 "k8s.io/api/core/v1"

	"github.com/isthmus-mesh/isthmus/controller"
	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/pilot/mcs"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/registry"
	"github.com/isthmus-mesh/isthmus/pilot/vip"
)

// mcsServices lists the services some cluster exports, as the ServiceImport
// writer merges them: each exporting cluster's definition (its
// ServiceExport's age, type and ports) and the allocated clusterset
// addresses.
func mcsServices(reg *registry.Registry, alloc *vip.Allocator) func() []mcs.Service {
	return func() []mcs.Service {
		var out []mcs.Service
		for _, s := range reg.Services() {
			if !s.HasExport() {
				continue
			}
			ms := mcs.Service{Namespace: s.Namespace, Name: s.Name}
			v4, v6 := alloc.Addresses(s.Hostname)
			want4, want6 := s.Families()
			if v4.IsValid() && want4 {
				ms.IPs = append(ms.IPs, v4)
			}
			if v6.IsValid() && want6 {
				ms.IPs = append(ms.IPs, v6)
			}
			for _, d := range s.Definitions {
				if !d.Exported {
					continue
				}
				ce := mcs.ClusterExport{Cluster: string(d.Cluster), Created: d.ExportCreated, Headless: d.Headless}
				for _, p := range d.Ports {
					ce.Ports = append(ce.Ports, mcs.Port{Name: p.Name, Protocol: corev1.Protocol(p.Protocol), AppProtocol: p.AppProtocol, Port: int32(p.Port)})
				}
				ce.Endpoints = mcsEndpoints(s.Shards[d.Cluster], d.Ports)
				ms.Exports = append(ms.Exports, ce)
			}
			out = append(out, ms)
		}
		return out
	}
}

// mcsEndpoints are an exporting cluster's endpoints (its shard) for the
// imported EndpointSlices: each with the service ports it serves, named
// as the cluster's Service names them, at the endpoint's target port.
func mcsEndpoints(shard []model.Endpoint, ports []model.Port) []mcs.Endpoint {
	out := make([]mcs.Endpoint, 0, len(shard))
	for i := range shard {
		e := &shard[i]
		me := mcs.Endpoint{Addresses: e.Workload.Addresses, Network: string(e.Network()), Zone: e.Locality().Zone,
			Ready: e.Ready() && !e.Terminating(), Serving: e.Ready(), Terminating: e.Terminating()}
		for _, p := range ports {
			if target, ok := e.TargetPort(p.Port); ok {
				me.Ports = append(me.Ports, mcs.Port{Name: p.Name, Protocol: corev1.Protocol(p.Protocol), AppProtocol: p.AppProtocol, Port: int32(target)})
			}
		}
		out = append(out, me)
	}
	return out
}

// mcsClusters lists the clusters the registry holds with their dynamic
// clients and networks, for the ServiceImport writer.
func mcsClusters(reg *registry.Registry, mc *multicluster.Controller) func() []mcs.Cluster {
	return func() []mcs.Cluster {
		var out []mcs.Cluster
		for id := range reg.Clusters() {
			if c, ok := mc.KubeClient(string(id)); ok && c.Dynamic != nil {
				nw, _ := mc.Network(string(id))
				out = append(out, mcs.Cluster{Name: string(id), Client: c.Dynamic, Network: string(nw)})
			}
		}
		slices.SortFunc(out, func(a, b mcs.Cluster) int { return cmp.Compare(a.Name, b.Name) })
		return out
	}
}

// leaderTasks are the parts of pilot that write shared state to clusters
// (ServiceExport status, ServiceImports): one replica runs them, under one
// Lease.
func (s *Server) leaderTasks(log *slog.Logger) (func(context.Context) error, error) {
	imports, err := mcs.New(mcs.Config{}, mcs.Deps{
		Services: mcsServices(s.Registry, s.VIP),
		Clusters: mcsClusters(s.Registry, s.Multicluster),
		Log:      log.With("component", "service-imports"),
	})
	if err != nil {
		return nil, err
	}
	stop := s.Registry.Subscribe(func(cs model.ChangeSet) {
		if slices.ContainsFunc(cs.Changes, func(c model.Change) bool { return c.Kind == model.ServiceChange }) {
			imports.Notify()
		}
	})
	s.vipHooks.add(func([]string) { imports.Notify() })
	status := controller.NewExportStatusWriter(s.Registry, s.Multicluster.KubeClient, log)
	status.Conflicts = func(ns, name string) (reason, message string, ok bool) {
		for _, c := range imports.Conflicts(ns, name) {
			return c.Reason, c.Message, true
		}
		return "", "", false
	}
	return func(ctx context.Context) error {
		defer stop()
		g, ctx := errgroup.WithContext(ctx)
		g.Go(func() error { return imports.Run(ctx) })
		g.Go(func() error { return status.Run(ctx) })
		return g.Wait()
	}, nil
}

// hooks are functions called with the hostnames whose allocated addresses
// changed; safe for concurrent use.
type hooks struct {
	mu  sync.Mutex
	fns []func([]string)
}

func (h *hooks) add(fn func([]string)) {
	h.mu.Lock()
	h.fns = append(h.fns, fn)
	h.mu.Unlock()
}

func (h *hooks) call(hosts []string) {
	h.mu.Lock()
	fns := slices.Clone(h.fns)
	h.mu.Unlock()
	for _, fn := range fns {
		fn(hosts)
	}
}

// LeaseName is the Lease (in the control-plane namespace) the replicas
// elect their leader with.
const LeaseName = "isthmus-pilot-leader"

// LeaderElection times the leader Lease.
type LeaderElection struct {
	LeaseDuration, RenewDeadline, RetryPeriod time.Duration
}

func (l LeaderElection) withDefaults() LeaderElection {
	if l.LeaseDuration <= 0 {
		l.LeaseDuration = 15 * time.Second
	}
	if l.RenewDeadline <= 0 {
		l.RenewDeadline = 10 * time.Second
	}
	if l.RetryPeriod <= 0 {
		l.RetryPeriod = 2 * time.Second
	}
	return l
}

// leadership says whether this replica is the leader: the one that writes
// shared state. With leader election off it always is.
type leadership struct {
	leading atomic.Bool
}

// Leading reports whether this replica is the leader.
func (s *Server) Leading() bool { return s.lead.leading.Load() }
