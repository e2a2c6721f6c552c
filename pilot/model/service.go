package model

import (
	"net/netip"
	"time"
)

// ClusterService is one cluster's Service object, as that cluster's
// discovery sees it (before federation).
type ClusterService struct {
	Cluster   ClusterID
	Name      string
	Namespace string
	// VIPs are the cluster IPs (none for a headless service).
	VIPs []netip.Addr
	// Network is the network the VIPs are reachable on: the cluster's
	// (its control-plane namespace's network label, else its default).
	Network  Network
	Ports    []Port
	Headless bool
	// Selector is the pod selector; nil for a selector-less service whose
	// endpoints come from EndpointSlices.
	Selector map[string]string
	// Exported is set when a ServiceExport (MCS API) exists for the service;
	// ExportCreated is that ServiceExport's creation time (the oldest export
	// wins MCS conflicts).
	Exported      bool
	ExportCreated time.Time
	// ScopeLocal is set when the service's scope in this cluster is local
	// (its istio.io/global label, its namespace's, or pilot's service scope
	// rules): this cluster's endpoints are then seen only by clients in it.
	ScopeLocal bool
	// LoadBalancing is the service's routing preference in this cluster
	// (its spec.trafficDistribution, Istio's traffic-distribution
	// annotation or Isthmus's routing-preference annotation); nil is the
	// default order. LoadBalancingError says why an annotation was ignored
	// ("" when none was).
	LoadBalancing      *LoadBalancing
	LoadBalancingError string
	// Created is the object's creation time (oldest wins port conflicts).
	Created time.Time
}

// Key returns the service's federation key.
func (s *ClusterService) Key() ServiceKey { return ServiceKey{Namespace: s.Namespace, Name: s.Name} }

// Service is a federated service: every cluster's Service of the same name
// and namespace, merged, with its endpoint shards.
type Service struct {
	Name      string
	Namespace string
	Hostname  string
	// Ports merged by name across clusters (the oldest definition wins).
	Ports []Port
	// VIPs per cluster, and the network of each cluster's VIPs.
	VIPs        map[ClusterID][]netip.Addr
	VIPNetworks map[ClusterID]Network
	Scope       Scope
	Headless    bool
	// Clusters lists the clusters that define the service, sorted.
	Clusters []ClusterID
	// Shards holds the endpoints per cluster; a shard is replaced whole on
	// change and never mutated after publication.
	Shards map[ClusterID][]Endpoint
	// LocalClusters names clusters whose shard is visible only to clients in
	// that same cluster: those where the service's scope is local
	// (ClusterService.ScopeLocal) and, in MCS export mode, those that do not
	// export it. With Scope ScopeClusterLocal every shard is local.
	LocalClusters map[ClusterID]bool
	// PortConflicts describes ports whose definitions differ between
	// clusters (ignored definitions), empty when there is none.
	PortConflicts []string
	// Definitions are every cluster's Service object, oldest first (then by
	// cluster ID); shared, never modified.
	Definitions []*ClusterService
}

// HasExport reports whether some cluster has a ServiceExport (MCS) for s:
// it then has a clusterset name and a ServiceImport. A cluster-local
// service never has one.
func (s *Service) HasExport() bool {
	if s.Scope == ScopeClusterLocal {
		return false
	}
	for _, d := range s.Definitions {
		if d.Exported {
			return true
		}
	}
	return false
}

// Key returns the service's federation key.
func (s *Service) Key() ServiceKey { return ServiceKey{Namespace: s.Namespace, Name: s.Name} }

// Port returns the service port numbered p.
func (s *Service) Port(p uint16) (Port, bool) {
	for _, sp := range s.Ports {
		if sp.Port == p {
			return sp, true
		}
	}
	return Port{}, false
}

// ShardVisible reports whether the shard of cluster shard may be served to
// a client in cluster client.
func (s *Service) ShardVisible(shard, client ClusterID) bool {
	if shard == client {
		return true
	}
	return s.Scope != ScopeClusterLocal && !s.LocalClusters[shard]
}

// EndpointCount returns the number of endpoints over all shards.
func (s *Service) EndpointCount() int {
	n := 0
	for _, sh := range s.Shards {
		n += len(sh)
	}
	return n
}

// ChangeKind names what a change is about.
type ChangeKind uint8

// Kinds of registry changes.
const (
	ServiceChange ChangeKind = iota + 1
	WorkloadChange
	GatewayChange
)

// String names the kind.
func (k ChangeKind) String() string {
	switch k {
	case ServiceChange:
		return "service"
	case WorkloadChange:
		return "workload"
	case GatewayChange:
		return "gateway"
	}
	return "unknown"
}

// Op says what happened to the keyed object.
type Op uint8

// Operations of a change.
const (
	Added Op = iota + 1
	Updated
	Removed
)

// String names the operation.
func (o Op) String() string {
	switch o {
	case Added:
		return "added"
	case Updated:
		return "updated"
	case Removed:
		return "removed"
	}
	return "unknown"
}

// Change is one keyed change of the federated registry. Key is the service
// hostname, the workload uid, or the gateway's network.
type Change struct {
	Kind ChangeKind
	Op   Op
	Key  string
}

// ChangeSet is a debounced batch of changes; a key appears at most once per
// kind, with the net operation.
type ChangeSet struct {
	Changes []Change
	// Version increases with every published batch.
	Version uint64
}

// ClusterState is everything one cluster contributes to the federation, as
// its discovery sees it.
type ClusterState struct {
	Services map[ServiceKey]*ClusterService
	// Shards are the cluster's endpoints per service, each sorted by
	// workload UID.
	Shards map[ServiceKey][]Endpoint
	// Workloads are the pods' workloads by UID. Workloads made from
	// EndpointSlice addresses (FromSlice) are in their service's shard
	// only; a ClusterDelta names the changes of both.
	Workloads map[string]*Workload
	Gateways  []NetworkGateway
}

// ClusterDelta is a change of one cluster's state. A nil map value (or a nil
// shard) means removed.
type ClusterDelta struct {
	Services  map[ServiceKey]*ClusterService
	Shards    map[ServiceKey][]Endpoint
	Workloads map[string]*Workload
	// Gateways replaces the cluster's gateways when GatewaysChanged.
	Gateways        []NetworkGateway
	GatewaysChanged bool
}

// Empty reports whether the delta changes nothing.
func (d *ClusterDelta) Empty() bool {
	return len(d.Services) == 0 && len(d.Shards) == 0 && len(d.Workloads) == 0 && !d.GatewaysChanged
}

// Families reports which IP families s uses: those of its VIPs in any
// cluster, else (headless) those of its endpoints, else IPv4. Allocated
// addresses follow them.
func (s *Service) Families() (v4, v6 bool) {
	for _, vips := range s.VIPs {
		for _, a := range vips {
			v4, v6 = v4 || a.Unmap().Is4(), v6 || (a.Is6() && !a.Is4In6())
		}
	}
	if !v4 && !v6 {
		for _, sh := range s.Shards {
			for i := range sh {
				for _, a := range sh[i].Workload.Addresses {
					v4, v6 = v4 || a.Unmap().Is4(), v6 || (a.Is6() && !a.Is4In6())
				}
			}
		}
	}
	if !v4 && !v6 {
		v4 = true
	}
	return v4, v6
}
