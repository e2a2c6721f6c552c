// Package xds turns the federated registry into xDS resources and serves them
// with go-control-plane: workload discovery (Address resources, delta ADS) for
// ztunnels, in Isthmus's encoding and in Istio's (istio.workload.Address and
// istio.security.Authorization, for Istio's ztunnel: istio.go), and
// CDS/EDS/LDS/RDS for Envoy and proxyless gRPC clients.
//
// Clients are grouped into classes by the network and cluster in their node
// metadata (NETWORK, CLUSTER_ID, as Istio names them). On TLS those claims are
// authorized against the client certificate's identity (see auth.go): the
// registry must run a workload of that identity in the claimed cluster (on the
// claimed node, for a ztunnel), on the claimed network. Each class has one
// cache per type URL (typeCache, serving delta and SotW streams), created when
// the first client of the class connects. A batch of registry changes rebuilds
// only the resources owned by the changed keys and hands them to every class's
// caches with UpdateResources(updated, deleted); the caches push to each
// subscriber only what it does not have yet, each response encoded once and
// its bytes shared by every stream it goes to.
package xds

import "github.com/isthmus-mesh/isthmus/pilot/model"

// Registry is the federated registry as pilot/xds consumes it.
//
// Every method is safe for concurrent use. Returned values are immutable: a
// change replaces a value, it never mutates one already returned.
//
// Change feed contract: a change of a service's definition or of any of its
// endpoint shards is a ServiceChange keyed by its hostname; a change of a
// workload (including its Services port mappings) is a WorkloadChange keyed by
// its uid; a change of any gateway of a network is a GatewayChange keyed by
// the network.
type Registry interface {
	// Services returns every federated service.
	Services() []*model.Service
	// Service returns the service with hostname, or nil if absent.
	Service(hostname string) *model.Service
	// Workloads returns every workload.
	Workloads() []*model.Workload
	// Workload returns the workload with uid, or nil if absent.
	Workload(uid string) *model.Workload
	// OwnsAddresses reports whether workload uid owns the addresses it
	// carries on its network: only owners are served, so a client gets at
	// most one workload per address. A change of ownership is a
	// WorkloadChange of each workload concerned.
	OwnsAddresses(uid string) bool
	// IdentityNetworks returns the networks of the workloads of service
	// account sa in namespace ns that run in cluster, on node (or anywhere in
	// the cluster when node is ""); none if there is no such workload.
	IdentityNetworks(cluster, node, ns, sa string) []model.Network
	// HasCluster reports whether cluster's state is in the registry (the
	// cluster has synced).
	HasCluster(cluster string) bool
	// Gateways returns the east-west gateway candidates of every network;
	// only trusted ones (Ignored == "") reach clients.
	Gateways() []model.NetworkGateway
	// Subscribe calls fn, serially from one goroutine, with each debounced
	// batch of changes (model.ChangeSet; Key = hostname for ServiceChange, uid
	// for WorkloadChange, network for GatewayChange). cancel stops the calls;
	// the Server tolerates a call that races with cancel.
	Subscribe(fn func(model.ChangeSet)) (cancel func())
}
