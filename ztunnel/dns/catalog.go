package dns

import (
	"net/netip"
	"slices"

	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// Client is who sends a query, as the answers depend on it: the namespace
// anchors the search path, the network decides which endpoint addresses
// are reachable.
type Client struct {
	// Namespace is the client pod's namespace ("" when unknown: short
	// single-label names are then forwarded).
	Namespace string
	// Network is the client's network ("": the catalog's default).
	Network string
}

// Name is a mesh name to resolve: a service, or one pod of a headless
// service.
type Name struct {
	Service   string
	Namespace string
	// Pod is set for <pod>.<svc>.<ns>.svc.<zone>: the pod's name (its
	// hostname), else empty.
	Pod string
	// Cluster restricts Pod to a cluster (clusterset.local pod names carry
	// it: <pod>.<cluster>.<svc>.<ns>.svc.clusterset.local); empty means any.
	Cluster string
	// ClusterSet is set for a name under clusterset.local (MCS): an
	// exported service then answers its clusterset (ServiceImport) IP.
	ClusterSet bool
}

// Catalog answers mesh names. Implementations must be safe for concurrent
// use and must not block: Lookup runs for every query.
type Catalog interface {
	// Lookup returns the addresses name resolves to for client, whether the
	// service is exported (MCS: it answers under clusterset.local), and
	// found=false when the mesh has no such name. found with no addresses
	// means the name exists but has no address now (answered NODATA). The
	// returned slice must not be modified.
	Lookup(name Name, client Client) (addrs []netip.Addr, exported, found bool)
}

// Attributes are what DNS needs of a service beyond what state.Service
// carries today: whether it is headless, whether it is exported (MCS), and
// the addresses pilot allocated for it (valid in the client's network: for
// a service with no VIP there, and for an exported service that is not
// headless, its clusterset IP, in every network).
type Attributes struct {
	Headless  bool
	Exported  bool
	Allocated []netip.Addr
}

// StoreCatalog answers from a ztunnel state store. Its snapshots hold only
// what the node's xDS class may reach, VIPs of the node's network only, and
// endpoints on other networks as synthetic workloads without address.
//
// Resolution:
//   - under clusterset.local, an exported service that is not headless
//     answers its allocated addresses (its ServiceImport IPs), or, while
//     it has none, as under the cluster domain;
//   - a service with VIPs answers its VIPs, less the allocated ones when
//     it has others (an exported service's local ClusterIPs);
//   - a headless service answers the addresses of its ready endpoints on
//     the client's network; when it has none there, its allocated
//     addresses (the gateway path: capture maps them back to the service);
//   - a service with neither VIPs nor (if headless) local endpoints
//     answers its allocated addresses;
//   - <pod>.<svc>: the pod's addresses when it is on the client's network,
//     else (a remote pod, or an unknown pod of a service with endpoints on
//     other networks, whose pods this node cannot name) the allocated
//     addresses; NXDOMAIN when neither applies. Only headless services have
//     pod names.
type StoreCatalog struct {
	// Store is read with Load: lock-free.
	Store *state.Store
	// Domain is the cluster domain of service hostnames (cluster.local).
	Domain string
	// Network is the node's network, the default for clients of unknown
	// network.
	Network string
	// Node is this ztunnel's node: ClientFor knows only its pods.
	Node string
	// Attributes gives a service's attributes; nil takes them from the
	// service as xDS describes it (tests may override them).
	Attributes func(*state.Service) Attributes
}

// Lookup implements Catalog.
func (c *StoreCatalog) Lookup(name Name, client Client) ([]netip.Addr, bool, bool) {
	snap := c.Store.Load()
	domain := c.Domain
	if domain == "" {
		domain = DefaultConfig().Domain
	}
	svc, ok := snap.ServiceByHostname(name.Service + "." + name.Namespace + ".svc." + domain)
	if !ok {
		return nil, false, false
	}
	attr := Attributes{Headless: svc.Headless, Exported: svc.Exported, Allocated: svc.Allocated}
	if c.Attributes != nil {
		attr = c.Attributes(svc)
	}
	network := client.Network
	if network == "" {
		network = c.Network
	}
	if name.Pod != "" {
		addrs, found := podAddrs(snap.Endpoints(svc.Key()), name, network, attr)
		return addrs, attr.Exported, found && attr.Headless
	}
	if !attr.Headless && name.ClusterSet && len(attr.Allocated) > 0 {
		return attr.Allocated, attr.Exported, true
	}
	if !attr.Headless && len(svc.VIPs) > 0 {
		return ownVIPs(svc.VIPs, attr.Allocated), attr.Exported, true
	}
	if attr.Headless {
		var addrs []netip.Addr
		for _, w := range snap.Endpoints(svc.Key()) {
			if w.Status == state.StatusReady && w.Network == network {
				addrs = append(addrs, w.Addresses...)
			}
		}
		if len(addrs) > 0 {
			return addrs, attr.Exported, true
		}
	}
	return attr.Allocated, attr.Exported, true
}

// ownVIPs returns vips less the allocated addresses, or vips whole when
// those are all it has (a service with no VIP of its own on the network).
// It allocates only when there is something to remove.
func ownVIPs(vips, allocated []netip.Addr) []netip.Addr {
	if len(allocated) == 0 {
		return vips
	}
	own := make([]netip.Addr, 0, len(vips))
	for _, a := range vips {
		if !slices.Contains(allocated, a) {
			own = append(own, a)
		}
	}
	if len(own) == 0 {
		return vips
	}
	return own
}

// podAddrs resolves a pod name of a headless service.
func podAddrs(eps []*state.Workload, name Name, network string, attr Attributes) ([]netip.Addr, bool) {
	remote := false
	for _, w := range eps {
		if w.Synthetic() || (len(w.Addresses) > 0 && w.Network != network) {
			remote = true
		}
		if w.Name != name.Pod || w.Synthetic() || (name.Cluster != "" && w.Cluster != name.Cluster) {
			continue
		}
		if w.Network == network && len(w.Addresses) > 0 {
			return w.Addresses, true
		}
		return attr.Allocated, true
	}
	if remote && len(attr.Allocated) > 0 {
		return attr.Allocated, true
	}
	return nil, false
}

// ClientFor identifies a client by the workload owning src in the store:
// its namespace and network. Only pods of Node are clients: any other
// source (another node's pod, a hostNetwork workload, an address the mesh
// does not know, and anyone when Node is empty) is a stranger. Use it as
// Deps.Client for a listener shared by the node's pods (a node address).
func (c *StoreCatalog) ClientFor(src netip.Addr) (Client, bool) {
	w, ok := c.Store.Load().WorkloadByAddr(src.Unmap())
	if !ok || c.Node == "" || w.Node != c.Node || w.Synthetic() || w.HostNetwork {
		return Client{}, false
	}
	return Client{Namespace: w.Namespace, Network: w.Network}, true
}
