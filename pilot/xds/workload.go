package xds

import (
	"cmp"
	"maps"
	"net/netip"
	"slices"
	"strings"

	"github.com/envoyproxy/go-control-plane/pkg/cache/types"

	"github.com/isthmus-mesh/isthmus/internal/spiffe"
	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// WorkloadType is the type URL of workload discovery resources.
const WorkloadType = workloadv1.TypeURL

// class is a set of clients that see exactly the same resources: those on one
// network in one cluster (the cluster matters only for cluster-local services
// and routing preferences), and for the Envoy types in one locality (EDS
// orders endpoints into priorities by it: envoy.go).
type class struct {
	Network  model.Network
	Cluster  model.ClusterID
	Locality model.Locality
	// Kind is what the class's clients of the Envoy types can dial
	// (envoytls.go).
	Kind clientKind
}

// String renders the class as network|cluster, then |locality if it has one.
func (c class) String() string {
	s := string(c.Network) + "|" + string(c.Cluster)
	if c.Locality != (model.Locality{}) {
		s += "|" + c.Locality.String()
	}
	return s
}

// sees reports whether clients of c see service s at all: whether any
// cluster's definition or endpoints of it are visible to them.
func (c class) sees(s *model.Service) bool {
	if s.Shards[c.Cluster] != nil {
		return true
	}
	return slices.ContainsFunc(s.Clusters, func(cl model.ClusterID) bool { return c.seesShard(s, cl) })
}

// seesShard reports whether clients of c see the endpoints s has in cluster
// (a cluster-local service's, or in export mode a service's that cluster
// does not export, only from that cluster).
func (c class) seesShard(s *model.Service, cluster model.ClusterID) bool {
	return s.ShardVisible(cluster, c.Cluster)
}

// visibility summarises what decides which clusters' endpoints of s clients
// see; a change of it changes the service bindings of s's workloads.
func visibility(s *model.Service) string {
	if s == nil {
		return ""
	}
	v := string(s.Scope)
	for _, cl := range slices.Sorted(maps.Keys(s.LocalClusters)) {
		if s.LocalClusters[cl] {
			v += "," + string(cl)
		}
	}
	return v
}

// gatewayIndex lists, per network, the trusted gateways through which it is
// reached, sorted by Key so that every build sends them in the same order.
// Ignored candidates never enter it.
type gatewayIndex map[model.Network][]model.NetworkGateway

func newGatewayIndex(gws []model.NetworkGateway) gatewayIndex {
	idx := make(gatewayIndex, len(gws))
	for _, g := range gws {
		if g.Trusted() {
			idx[g.Network] = append(idx[g.Network], g)
		}
	}
	for _, l := range idx {
		slices.SortFunc(l, func(a, b model.NetworkGateway) int { return cmp.Compare(a.Key(), b.Key()) })
	}
	return idx
}

// spiffeID returns the SPIFFE URI of service account sa in namespace ns.
func spiffeID(trustDomain, ns, sa string) string {
	return spiffe.Identity{TrustDomain: trustDomain, Namespace: ns, ServiceAccount: sa}.String()
}

// ServiceResourceName is the workload discovery resource name of the service
// with hostname in namespace ns.
func ServiceResourceName(ns, hostname string) string { return ns + "/" + hostname }

// SplitHorizonUID is the uid of the synthetic workload that stands for the
// endpoints of service hostname (in namespace ns) on network.
func SplitHorizonUID(network model.Network, ns, hostname string) string {
	return workloadv1.SplitHorizonUIDPrefix + string(network) + "/" + ns + "/" + hostname
}

// namespaceOf returns the namespace label of a Kubernetes service hostname
// (<name>.<ns>.svc.<domain>), or "" when hostname has no such label.
func namespaceOf(hostname string) string {
	_, rest, ok := strings.Cut(hostname, ".")
	if !ok {
		return ""
	}
	ns, _, _ := strings.Cut(rest, ".")
	return ns
}

func addrBytes(a netip.Addr) []byte { return a.Unmap().AsSlice() }

func healthy(ready, terminating bool) bool { return ready && !terminating }

// buildWorkload returns the Address clients of c get for w, or nil when they
// do not see it: a workload on another network is seen only through the
// split-horizon workloads of its services. w is bound only to the services
// whose endpoints in w's cluster clients of c may reach (service looks a
// service up by hostname).
func buildWorkload(c class, w *model.Workload, td trustDomains, service func(hostname string) *model.Service) *workloadv1.Address {
	if w == nil || w.Network != c.Network {
		return nil
	}
	out := &workloadv1.Workload{
		Uid:            w.UID,
		Name:           w.Name,
		Namespace:      w.Namespace,
		Network:        string(w.Network),
		ClusterId:      string(w.Cluster),
		Node:           w.Node,
		TrustDomain:    td(w.Cluster),
		ServiceAccount: cmp.Or(w.ServiceAccount, "default"),
		TunnelProtocol: workloadv1.TunnelProtocol_HBONE,
		Status:         workloadv1.WorkloadStatus_HEALTHY,
	}
	if !healthy(w.Ready, w.Terminating) {
		out.Status = workloadv1.WorkloadStatus_UNHEALTHY
	}
	if !w.Tunnelled() {
		out.TunnelProtocol = workloadv1.TunnelProtocol_NONE
	}
	out.HostNetwork = w.HostNetwork
	if !w.FromSlice {
		out.WorkloadName, out.CanonicalName, out.CanonicalRevision = w.WorkloadName(), w.CanonicalName(), w.CanonicalRevision()
	}
	if w.Locality != (model.Locality{}) {
		out.Locality = &workloadv1.Locality{Region: w.Locality.Region, Zone: w.Locality.Zone, Subzone: w.Locality.Subzone}
	}
	for _, a := range w.Addresses {
		out.Addresses = append(out.Addresses, addrBytes(a))
	}
	if len(w.Services) > 0 {
		out.Services = make(map[string]*workloadv1.PortList, len(w.Services))
		for host, maps := range w.Services {
			if s := service(host); s != nil && !c.seesShard(s, w.Cluster) {
				continue
			}
			pl := &workloadv1.PortList{Ports: make([]*workloadv1.Port, 0, len(maps))}
			for _, m := range maps {
				pl.Ports = append(pl.Ports, &workloadv1.Port{ServicePort: uint32(m.ServicePort), TargetPort: uint32(m.TargetPort)})
			}
			out.Services[ServiceResourceName(namespaceOf(host), host)] = pl
		}
	}
	return &workloadv1.Address{Type: &workloadv1.Address_Workload{Workload: out}}
}

// clusterNetwork returns the network of a cluster's VIPs: as discovery
// reported it, else (a registry that does not say) the network of the
// cluster's endpoints, else the client's.
func clusterNetwork(s *model.Service, cluster model.ClusterID, fallback model.Network) model.Network {
	if n, ok := s.VIPNetworks[cluster]; ok {
		return n
	}
	for _, e := range s.Shards[cluster] {
		return e.Network()
	}
	return fallback
}

// buildServiceAddresses adds to out the Address resources service s owns for
// clients of c: the Service itself and one split-horizon workload per other
// network that has ready endpoints of s and a gateway. A service with no
// address on c's network is given its allocated addresses there; an
// exported (MCS) service that is not headless is given them in every
// network, beside any local VIP: they are its ServiceImport IPs, one
// allocation for the whole clusterset (alloc may be nil).
func buildServiceAddresses(c class, s *model.Service, gws gatewayIndex, td trustDomains, alloc Allocations, out map[string]types.Resource) {
	if s == nil || !c.sees(s) {
		return
	}
	svc := &workloadv1.Service{
		Name:      s.Name,
		Namespace: s.Namespace,
		Hostname:  s.Hostname,
		Scope:     workloadv1.ServiceScope_GLOBAL,
		Headless:  s.Headless,
		Exported:  s.HasExport(),
	}
	if s.Scope == model.ScopeClusterLocal {
		svc.Scope = workloadv1.ServiceScope_CLUSTER_LOCAL
	}
	svc.LoadBalancing = loadBalancing(s.LoadBalancingFor(c.Cluster))
	for _, cl := range slices.Sorted(maps.Keys(s.LocalClusters)) {
		if s.LocalClusters[cl] {
			svc.LocalClusters = append(svc.LocalClusters, string(cl))
		}
	}
	clusters := make([]model.ClusterID, 0, len(s.VIPs))
	for cl := range s.VIPs {
		if c.seesShard(s, cl) {
			clusters = append(clusters, cl)
		}
	}
	slices.Sort(clusters)
	local := false
	for _, cl := range clusters {
		nw := clusterNetwork(s, cl, c.Network)
		for _, vip := range s.VIPs[cl] {
			svc.Addresses = append(svc.Addresses, &workloadv1.NetworkAddress{Network: string(nw), Address: addrBytes(vip)})
			local = local || nw == c.Network
		}
	}
	clusterSetIP := s.HasExport() && !s.Headless
	if (!local || clusterSetIP) && alloc != nil && s.Scope != model.ScopeClusterLocal {
		v4, v6 := alloc.Addresses(s.Hostname)
		if want4, want6 := s.Families(); !want4 {
			v4 = netip.Addr{}
		} else if !want6 {
			v6 = netip.Addr{}
		}
		for _, a := range []netip.Addr{v4, v6} {
			if a.IsValid() {
				svc.Addresses = append(svc.Addresses, &workloadv1.NetworkAddress{Network: string(c.Network), Address: addrBytes(a)})
				svc.AllocatedAddresses = append(svc.AllocatedAddresses, addrBytes(a))
			}
		}
	}
	for _, p := range s.Ports {
		svc.Ports = append(svc.Ports, &workloadv1.ServicePort{
			ServicePort: uint32(p.Port), TargetPort: uint32(p.TargetPort), Name: p.Name, AppProtocol: p.AppProtocol,
		})
	}
	out[ServiceResourceName(s.Namespace, s.Hostname)] = &workloadv1.Address{Type: &workloadv1.Address_Service{Service: svc}}

	for nw, r := range remoteReady(c, s, td) {
		gws := gws[nw]
		if len(gws) == 0 {
			continue
		}
		out[SplitHorizonUID(nw, s.Namespace, s.Hostname)] = splitWorkload(s, nw, gws, r, td)
	}
}

// remoteEndpoints summarises the ready endpoints of a service on one remote
// network: how many there are and which identities they run as.
type remoteEndpoints struct {
	ready      uint32
	identities map[string]struct{}
	domains    map[string]struct{} // their trust domains
}

// remoteReady summarises the ready endpoints of s per network other than c's.
func remoteReady(c class, s *model.Service, td trustDomains) map[model.Network]*remoteEndpoints {
	var out map[model.Network]*remoteEndpoints
	for cl, shard := range s.Shards {
		if !c.seesShard(s, cl) {
			continue
		}
		for i := range shard {
			e := &shard[i]
			// Only what a gateway forwards to counts: it tunnels to HBONE
			// endpoints of its network and to nothing else.
			if e.Network() == c.Network || !healthy(e.Ready(), e.Terminating()) || !e.Workload.Tunnelled() {
				continue
			}
			if out == nil {
				out = make(map[model.Network]*remoteEndpoints)
			}
			r := out[e.Network()]
			if r == nil {
				r = &remoteEndpoints{identities: map[string]struct{}{}, domains: map[string]struct{}{}}
				out[e.Network()] = r
			}
			r.ready++
			r.identities[spiffeID(td(cl), e.Namespace(), cmp.Or(e.ServiceAccount(), "default"))] = struct{}{}
			r.domains[td(cl)] = struct{}{}
		}
	}
	return out
}

// gatewayAddress is how a client reaches and verifies gateway gw.
func gatewayAddress(gw model.NetworkGateway, td trustDomains) *workloadv1.GatewayAddress {
	ga := &workloadv1.GatewayAddress{HboneMtlsPort: uint32(cmp.Or(gw.HBONEPort, model.HBONEPort)), Capacity: gw.Capacity}
	if gw.Address.IsValid() {
		ga.Destination = &workloadv1.GatewayAddress_Address{Address: addrBytes(gw.Address)}
	} else {
		ga.Destination = &workloadv1.GatewayAddress_Hostname{Hostname: gw.Hostname}
	}
	for _, sa := range gw.ServiceAccounts {
		ga.Identities = append(ga.Identities, spiffeID(td(gw.Cluster), gw.Namespace(), sa))
	}
	return ga
}

// splitWorkload is the synthetic workload standing for the ready endpoints
// of s on network nw, reached through gws (every trusted gateway of nw). It
// names the identities those endpoints run as, which the end-to-end TLS peer
// must present. Its ports map every service port to itself: the gateway is
// asked for <hostname>:<service port>.
func splitWorkload(s *model.Service, nw model.Network, gws []model.NetworkGateway, r *remoteEndpoints, td trustDomains) *workloadv1.Address {
	// The workload's trust domain is its endpoints' when they share one
	// (their identities are listed in full either way).
	trustDomain := td("")
	if len(r.domains) == 1 {
		for d := range r.domains {
			trustDomain = d
		}
	}
	pl := &workloadv1.PortList{Ports: make([]*workloadv1.Port, 0, len(s.Ports))}
	for _, p := range s.Ports {
		pl.Ports = append(pl.Ports, &workloadv1.Port{ServicePort: uint32(p.Port), TargetPort: uint32(p.Port)})
	}
	w := &workloadv1.Workload{
		Uid:            SplitHorizonUID(nw, s.Namespace, s.Hostname),
		Name:           s.Hostname,
		Namespace:      s.Namespace,
		Network:        string(nw),
		TrustDomain:    trustDomain,
		TunnelProtocol: workloadv1.TunnelProtocol_HBONE,
		Services:       map[string]*workloadv1.PortList{ServiceResourceName(s.Namespace, s.Hostname): pl},
		Status:         workloadv1.WorkloadStatus_HEALTHY,
		Capacity:       r.ready,
		Identities:     slices.Sorted(maps.Keys(r.identities)),
	}
	for _, gw := range gws {
		w.NetworkGateways = append(w.NetworkGateways, gatewayAddress(gw, td))
	}
	return &workloadv1.Address{Type: &workloadv1.Address_Workload{Workload: w}}
}

// routingScopes maps the model's routing scopes to the workload API's.
var routingScopes = [...]workloadv1.LoadBalancing_Scope{
	model.RouteNetwork: workloadv1.LoadBalancing_NETWORK, model.RouteCluster: workloadv1.LoadBalancing_CLUSTER,
	model.RouteRegion: workloadv1.LoadBalancing_REGION, model.RouteZone: workloadv1.LoadBalancing_ZONE,
	model.RouteSubzone: workloadv1.LoadBalancing_SUBZONE, model.RouteNode: workloadv1.LoadBalancing_NODE,
}

// loadBalancing is the workload API form of a routing preference: nil (the
// client's default order) for nil, else the scopes and an explicit mode.
func loadBalancing(lb *model.LoadBalancing) *workloadv1.LoadBalancing {
	if lb == nil {
		return nil
	}
	out := &workloadv1.LoadBalancing{Mode: workloadv1.LoadBalancing_FAILOVER, RoutingPreference: make([]workloadv1.LoadBalancing_Scope, 0, len(lb.Preference))}
	if lb.Strict {
		out.Mode = workloadv1.LoadBalancing_STRICT
	}
	for _, sc := range lb.Preference {
		if int(sc) < len(routingScopes) && sc != 0 {
			out.RoutingPreference = append(out.RoutingPreference, routingScopes[sc])
		}
	}
	return out
}
