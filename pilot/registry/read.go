package registry

import (
	"maps"
	"slices"
	"strings"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// Services returns every federated service (immutable values), sorted by
// hostname.
func (r *Registry) Services() []*model.Service {
	r.mu.RLock()
	out := make([]*model.Service, 0, len(r.services))
	for _, s := range r.services {
		out = append(out, s)
	}
	r.mu.RUnlock()
	slices.SortFunc(out, func(a, b *model.Service) int { return strings.Compare(a.Hostname, b.Hostname) })
	return out
}

// ServiceCount returns the number of federated services (hostnames).
func (r *Registry) ServiceCount() int {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return len(r.services)
}

// Service returns the federated service of hostname (nil if none). In
// export mode, <name>.<ns>.svc.clusterset.local names an exported service.
func (r *Registry) Service(hostname string) *model.Service {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if s := r.services[hostname]; s != nil {
		return s
	}
	if r.cfg.ExportMode {
		if prefix, ok := strings.CutSuffix(hostname, ".svc."+ClusterSetDomain); ok {
			if s := r.services[prefix+".svc."+r.cfg.Domain]; s != nil && exportedAnywhere(s) {
				return s
			}
		}
	}
	return nil
}

// exportedAnywhere reports whether a cluster where s is global exports it.
func exportedAnywhere(s *model.Service) bool {
	for _, d := range s.Definitions {
		if d.Exported && !s.LocalClusters[d.Cluster] {
			return true
		}
	}
	return false
}

// Workloads returns every workload (immutable values).
func (r *Registry) Workloads() []*model.Workload {
	r.mu.RLock()
	defer r.mu.RUnlock()
	var out []*model.Workload
	for _, cs := range r.clusters {
		cs.eachWorkload(func(w *model.Workload) { out = append(out, w) })
	}
	return out
}

// Workload returns the workload of uid (nil if none).
func (r *Registry) Workload(uid string) *model.Workload {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.workloadLocked(uid)
}

// Gateways returns every east-west gateway candidate, trusted or ignored
// (model.NetworkGateway.Ignored says why), sorted.
func (r *Registry) Gateways() []model.NetworkGateway {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return slices.Clone(r.gateways)
}

// GatewaysOf returns the gateway candidates of network n.
func (r *Registry) GatewaysOf(n model.Network) []model.NetworkGateway {
	var out []model.NetworkGateway
	for _, g := range r.Gateways() {
		if g.Network == n {
			out = append(out, g)
		}
	}
	return out
}

// ServiceAccountOnNode reports whether a workload of service account sa in
// namespace ns runs on node in cluster (for the CA's impersonation check).
func (r *Registry) ServiceAccountOnNode(cluster, node, ns, sa string) bool {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return node != "" && len(r.placements[saKey{model.ClusterID(cluster), node, ns, sa}]) > 0
}

// IdentityNetworks returns, sorted, the networks of the workloads of service
// account sa in namespace ns that run in cluster: on node, or anywhere in
// the cluster when node is "". None: no such workload.
func (r *Registry) IdentityNetworks(cluster, node, ns, sa string) []model.Network {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return slices.Sorted(maps.Keys(r.placements[saKey{model.ClusterID(cluster), node, ns, sa}]))
}

// StaleClusters returns the clusters marked unreachable, with the time.
func (r *Registry) StaleClusters() map[model.ClusterID]int64 {
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := make(map[model.ClusterID]int64, len(r.stale))
	for c, t := range r.stale {
		out[c] = t.Unix()
	}
	return out
}

// HasCluster reports whether cluster contributes state (it has synced).
func (r *Registry) HasCluster(cluster string) bool {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.clusters[model.ClusterID(cluster)] != nil
}

// Clusters returns the clusters that contribute state, with their serving
// generation.
func (r *Registry) Clusters() map[model.ClusterID]uint64 {
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := make(map[model.ClusterID]uint64, len(r.clusters))
	for c, cs := range r.clusters {
		out[c] = cs.gen
	}
	return out
}

// Subscribe calls fn, serially from Run's goroutine, with each debounced
// change set. fn must not block for long. The returned func unsubscribes.
func (r *Registry) Subscribe(fn func(model.ChangeSet)) (cancel func()) {
	return r.feed.subscribe(fn)
}

func clusterServiceEqual(a, b *model.ClusterService) bool {
	return a.Name == b.Name && a.Namespace == b.Namespace && a.Cluster == b.Cluster && slices.Equal(a.VIPs, b.VIPs) &&
		slices.Equal(a.Ports, b.Ports) && a.Headless == b.Headless && maps.Equal(a.Selector, b.Selector) &&
		a.Exported == b.Exported && a.ScopeLocal == b.ScopeLocal && a.Network == b.Network && a.Created.Equal(b.Created) &&
		a.LoadBalancing.Equal(b.LoadBalancing) && a.LoadBalancingError == b.LoadBalancingError
}

func shardEqual(a, b []model.Endpoint) bool {
	return slices.EqualFunc(a, b, func(x, y model.Endpoint) bool { return x.Equal(&y) })
}
