package xds

import (
	"cmp"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strconv"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	routerv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	rawbufferv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/raw_buffer/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// ClusterName is the name of the Envoy cluster (and of its
// ClusterLoadAssignment) for port of the service with hostname:
// outbound|<port>||<hostname>, as Istio names it.
func ClusterName(hostname string, port uint16) string {
	return "outbound|" + strconv.Itoa(int(port)) + "||" + hostname
}

// ListenerName is the name of the API listener and of the route
// configuration for port of the service with hostname: <hostname>:<port>,
// the name a proxyless gRPC client asks for when dialing xds:///<hostname>:<port>.
func ListenerName(hostname string, port uint16) string {
	return hostname + ":" + strconv.Itoa(int(port))
}

// envoyTypes are the Envoy type URLs the server serves.
var envoyTypes = []string{resource.ClusterType, resource.EndpointType, resource.ListenerType, resource.RouteType}

// envoyBuilder builds the Envoy resources of services. It is immutable after
// newEnvoyBuilder and safe for concurrent use.
type envoyBuilder struct {
	connectTimeout *durationpb.Duration
	ads            *corev3.ConfigSource
	routerFilter   *hcmv3.HttpFilter
	// sds is where Envoy gets its certificate and roots (Istio's agent).
	sds *corev3.ConfigSource
	// rawBuffer is the plaintext transport socket of local endpoints.
	rawBuffer *corev3.TransportSocket
	// withheld reports endpoints a class's clients cannot reach.
	withheld func(c class, hostname string, reason string, n uint32)
}

func newEnvoyBuilder(connectTimeout time.Duration, withheld func(c class, hostname, reason string, n uint32)) (*envoyBuilder, error) {
	router, err := anypb.New(&routerv3.Router{})
	if err != nil {
		return nil, fmt.Errorf("router filter config: %w", err)
	}
	raw, err := anypb.New(&rawbufferv3.RawBuffer{})
	if err != nil {
		return nil, fmt.Errorf("raw buffer transport socket: %w", err)
	}
	return &envoyBuilder{
		withheld:       withheld,
		sds:            sdsSource(),
		rawBuffer:      &corev3.TransportSocket{Name: "envoy.transport_sockets.raw_buffer", ConfigType: &corev3.TransportSocket_TypedConfig{TypedConfig: raw}},
		connectTimeout: durationpb.New(connectTimeout),
		ads: &corev3.ConfigSource{
			ResourceApiVersion:    corev3.ApiVersion_V3,
			ConfigSourceSpecifier: &corev3.ConfigSource_Ads{Ads: &corev3.AggregatedConfigSource{}},
		},
		routerFilter: &hcmv3.HttpFilter{
			Name:       "envoy.filters.http.router",
			ConfigType: &hcmv3.HttpFilter_TypedConfig{TypedConfig: router},
		},
	}, nil
}

// build adds to out (keyed by type URL, then resource name) the Envoy
// resources of s for clients of c: per TCP port a Cluster, a
// ClusterLoadAssignment, an API Listener and a RouteConfiguration.
func (b *envoyBuilder) build(c class, s *model.Service, gws gatewayIndex, td trustDomains, out map[string]map[string]types.Resource) error {
	if s == nil || !c.sees(s) {
		return nil
	}
	for _, p := range s.Ports {
		if p.Protocol != "" && p.Protocol != model.TCP {
			continue
		}
		cn := ClusterName(s.Hostname, p.Port)
		ln := ListenerName(s.Hostname, p.Port)
		cla, peers := b.loadAssignment(c, s, p.Port, cn, gws, td)
		cl, err := b.cluster(c, cn, s.Hostname, p.Port, peers)
		if err != nil {
			return err
		}
		out[resource.ClusterType][cn] = cl
		out[resource.EndpointType][cn] = cla
		l, err := b.listener(ln)
		if err != nil {
			return err
		}
		out[resource.ListenerType][ln] = l
		out[resource.RouteType][ln] = routeConfig(ln, s.Hostname, cn)
	}
	return nil
}

// cluster builds the Cluster name of port of the service hostname. When
// the load assignment has endpoints behind gateways (peers.remote names the
// identities they run as), an Envoy client gets Istio's transport socket
// match: mutual TLS with Istio's SNI for the endpoints marked tlsMode=istio
// (the gateways' SNI passthrough ports), plaintext for the rest. A
// proxyless gRPC client with xDS security reaches every endpoint over mTLS
// with Istio's SNI (gRPC has no transport socket matches), verifying it as
// one of peers.all.
func (b *envoyBuilder) cluster(c class, name, hostname string, port uint16, peers endpointPeers) (*clusterv3.Cluster, error) {
	cl := &clusterv3.Cluster{
		Name:                 name,
		ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_EDS},
		EdsClusterConfig:     &clusterv3.Cluster_EdsClusterConfig{EdsConfig: b.ads, ServiceName: name},
		ConnectTimeout:       b.connectTimeout,
		LbPolicy:             clusterv3.Cluster_ROUND_ROBIN,
	}
	if c.Kind == kindProxylessTLS && len(peers.all) > 0 {
		ts, err := proxylessMTLS(hostname, port, peers.all)
		if err != nil {
			return nil, fmt.Errorf("cluster %s: %w", name, err)
		}
		cl.TransportSocket = ts
		return cl, nil
	}
	if c.Kind != kindEnvoy || len(peers.remote) == 0 {
		return cl, nil
	}
	tlsSocket, err := b.istioMTLS(hostname, port, peers.remote)
	if err != nil {
		return nil, fmt.Errorf("cluster %s: %w", name, err)
	}
	cl.TransportSocketMatches = []*clusterv3.Cluster_TransportSocketMatch{
		{Name: "tlsMode-istio", Match: tlsModeIstio(), TransportSocket: tlsSocket},
		{Name: "tlsMode-disabled", Match: &structpb.Struct{}, TransportSocket: b.rawBuffer},
	}
	return cl, nil
}

func (b *envoyBuilder) listener(name string) (*listenerv3.Listener, error) {
	hcm, err := anypb.New(&hcmv3.HttpConnectionManager{
		StatPrefix: name,
		RouteSpecifier: &hcmv3.HttpConnectionManager_Rds{Rds: &hcmv3.Rds{
			ConfigSource:    b.ads,
			RouteConfigName: name,
		}},
		HttpFilters: []*hcmv3.HttpFilter{b.routerFilter},
	})
	if err != nil {
		return nil, fmt.Errorf("listener %s: %w", name, err)
	}
	return &listenerv3.Listener{Name: name, ApiListener: &listenerv3.ApiListener{ApiListener: hcm}}, nil
}

func routeConfig(name, hostname, cluster string) *routev3.RouteConfiguration {
	return &routev3.RouteConfiguration{
		Name: name,
		VirtualHosts: []*routev3.VirtualHost{{
			Name:    name,
			Domains: []string{name, hostname},
			Routes: []*routev3.Route{{
				Match: &routev3.RouteMatch{PathSpecifier: &routev3.RouteMatch_Prefix{Prefix: "/"}},
				Action: &routev3.Route_Route{Route: &routev3.RouteAction{
					ClusterSpecifier: &routev3.RouteAction_Cluster{Cluster: cluster},
				}},
			}},
		}},
	}
}

func socketAddress(a netip.Addr, port uint32) *corev3.Address {
	return &corev3.Address{Address: &corev3.Address_SocketAddress{SocketAddress: &corev3.SocketAddress{
		Address:       a.Unmap().String(),
		PortSpecifier: &corev3.SocketAddress_PortValue{PortValue: port},
	}}}
}

// remoteKey groups the endpoints of another network by locality and
// priority.
type remoteKey struct {
	network  model.Network
	locality model.Locality
	priority uint32
}

// groupKey is one LocalityLbEndpoints: a locality at a priority.
type groupKey struct {
	locality model.Locality
	priority uint32
}

// failoverOverprovisioning is the overprovisioning factor (in percent) of
// assignments with priorities: a tier takes all the traffic while any of
// its endpoints is healthy (Envoy's default, 140, spills to the next tier
// as soon as fewer than 5 in 7 are), which is the workload API's FAILOVER.
const failoverOverprovisioning = 100000

// tier returns how many scopes of lb, in order, endpoint e shares with
// clients of c, and whether e qualifies at all (STRICT: all of them). EDS
// classes carry no node, so NODE never matches, nor does a scope the class
// has no value for (an empty zone): the workload API's rule for a client
// that does not know it.
func tier(lb *model.LoadBalancing, c class, e *model.Endpoint) (int, bool) {
	n := 0
	for _, sc := range lb.Preference {
		l := e.Locality()
		var ok bool
		switch sc {
		case model.RouteNetwork:
			ok = e.Network() == c.Network
		case model.RouteCluster:
			ok = c.Cluster != "" && e.Cluster() == c.Cluster
		case model.RouteRegion:
			ok = c.Locality.Region != "" && l.Region == c.Locality.Region
		case model.RouteZone:
			ok = c.Locality.Zone != "" && l.Zone == c.Locality.Zone
		case model.RouteSubzone:
			ok = c.Locality.Subzone != "" && l.Subzone == c.Locality.Subzone
		}
		if !ok {
			break
		}
		n++
	}
	return n, !lb.Strict || n == len(lb.Preference)
}

// loadAssignment builds the ClusterLoadAssignment of port of s for clients of
// c, grouped by locality. Endpoints on c's network are listed directly;
// the ready endpoints of another network (those its gateways forward to)
// are replaced, per locality, by the SNI passthrough ports of the network's
// trusted gateways, their number spread over the gateways by capacity, for
// clients that can speak mTLS with Istio's SNI (gatewayEndpoints); they are
// withheld, and reported, from clients that cannot. Gateways without an IP
// are left out (EDS endpoints must be addresses). It returns the
// identities of the endpoints it lists (endpointPeers).
//
// A service with a routing preference for c's cluster
// (Service.LoadBalancingFor) has priorities: an endpoint's priority is the
// number of the preference's scopes it does not share with c (see tier),
// renumbered to be contiguous from 0, so the client's best tier is priority
// 0; STRICT leaves out the endpoints that do not share them all; and a
// tier takes all the traffic while it has a healthy endpoint
// (failoverOverprovisioning). Without a preference every endpoint has
// priority 0.
func (b *envoyBuilder) loadAssignment(c class, s *model.Service, port uint16, name string, gws gatewayIndex, td trustDomains) (*endpointv3.ClusterLoadAssignment, endpointPeers) {
	lb := s.LoadBalancingFor(c.Cluster)
	groups := map[groupKey][]*endpointv3.LbEndpoint{}
	remote := map[remoteKey]uint32{}
	identities := map[model.Network]map[string]struct{}{}
	local := map[string]struct{}{}
	clusters := make([]model.ClusterID, 0, len(s.Shards))
	for cl := range s.Shards {
		if c.seesShard(s, cl) {
			clusters = append(clusters, cl)
		}
	}
	slices.Sort(clusters)
	for _, cl := range clusters {
		shard := s.Shards[cl]
		for i := range shard {
			e := &shard[i]
			target, ok := e.TargetPort(port)
			if !ok || !e.Address().IsValid() {
				continue
			}
			var prio uint32
			if lb != nil {
				n, ok := tier(lb, c, e)
				if !ok {
					continue
				}
				prio = uint32(len(lb.Preference) - n)
			}
			if e.Network() != c.Network {
				// Only what a gateway forwards to counts: HBONE endpoints.
				if healthy(e.Ready(), e.Terminating()) && e.Workload.Tunnelled() {
					remote[remoteKey{e.Network(), e.Locality(), prio}]++
					if identities[e.Network()] == nil {
						identities[e.Network()] = map[string]struct{}{}
					}
					identities[e.Network()][spiffeID(td(cl), e.Namespace(), cmp.Or(e.ServiceAccount(), "default"))] = struct{}{}
				}
				continue
			}
			local[spiffeID(td(cl), e.Namespace(), cmp.Or(e.ServiceAccount(), "default"))] = struct{}{}
			hs := corev3.HealthStatus_HEALTHY
			switch {
			case e.Terminating():
				hs = corev3.HealthStatus_DRAINING
			case !e.Ready():
				hs = corev3.HealthStatus_UNHEALTHY
			}
			k := groupKey{e.Locality(), prio}
			groups[k] = append(groups[k], &endpointv3.LbEndpoint{
				HostIdentifier:      &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{Address: socketAddress(e.Address(), uint32(target))}},
				HealthStatus:        hs,
				LoadBalancingWeight: wrapperspb.UInt32(1),
			})
		}
	}
	var withheld map[string]uint32
	used := map[string]struct{}{}
	for k, n := range remote {
		eps, reason := gatewayEndpoints(c.Kind, gws[k.network], n)
		if reason != "" {
			if withheld == nil {
				withheld = map[string]uint32{}
			}
			withheld[reason] += n
			continue
		}
		for id := range identities[k.network] {
			used[id] = struct{}{}
		}
		if len(eps) > 0 {
			g := groupKey{k.locality, k.priority}
			groups[g] = append(groups[g], eps...)
		}
	}
	for reason, n := range withheld {
		b.withheld(c, s.Hostname, reason, n)
	}
	keys := make([]groupKey, 0, len(groups))
	usedPrio := map[uint32]bool{}
	for k := range groups {
		keys = append(keys, k)
		usedPrio[k.priority] = true
	}
	slices.SortFunc(keys, func(a, b groupKey) int {
		return cmp.Or(cmp.Compare(a.priority, b.priority), cmp.Compare(a.locality.String(), b.locality.String()))
	})
	// Contiguous priorities: the i-th used one becomes i.
	renumber := map[uint32]uint32{}
	for _, p := range slices.Sorted(maps.Keys(usedPrio)) {
		renumber[p] = uint32(len(renumber))
	}
	cla := &endpointv3.ClusterLoadAssignment{ClusterName: name}
	if lb != nil {
		cla.Policy = &endpointv3.ClusterLoadAssignment_Policy{OverprovisioningFactor: wrapperspb.UInt32(failoverOverprovisioning)}
	}
	for _, k := range keys {
		eps := groups[k]
		slices.SortFunc(eps, func(a, b *endpointv3.LbEndpoint) int {
			sa, sb := a.GetEndpoint().GetAddress().GetSocketAddress(), b.GetEndpoint().GetAddress().GetSocketAddress()
			return cmp.Or(cmp.Compare(sa.GetAddress(), sb.GetAddress()), cmp.Compare(sa.GetPortValue(), sb.GetPortValue()))
		})
		var weight uint32
		for _, e := range eps {
			weight += e.GetLoadBalancingWeight().GetValue()
		}
		l := k.locality
		cla.Endpoints = append(cla.Endpoints, &endpointv3.LocalityLbEndpoints{
			Locality:            &corev3.Locality{Region: l.Region, Zone: l.Zone, SubZone: l.Subzone},
			LbEndpoints:         eps,
			LoadBalancingWeight: wrapperspb.UInt32(weight),
			Priority:            renumber[k.priority],
		})
	}
	var peers endpointPeers
	peers.remote = sortedKeys(used)
	for id := range local {
		used[id] = struct{}{}
	}
	peers.all = sortedKeys(used)
	return cla, peers
}

// endpointPeers are the SPIFFE identities (sorted) of the endpoints of a
// load assignment: those behind gateways, and all.
type endpointPeers struct {
	remote, all []string
}

func sortedKeys(m map[string]struct{}) []string {
	if len(m) == 0 {
		return nil
	}
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// gatewayEndpoints stands for n ready endpoints behind gws, for a client
// of kind k: one endpoint per gateway with an IP and an SNI passthrough
// port, at that port, marked for Istio's mTLS (tlsModeIstio), weighted by
// its share of those gateways' capacity (at least 1). None, and why, when
// the client cannot use them: a client without TLS (WithheldNoTLS), or no
// such gateway (WithheldNoGatewayTLS). The gateways' HBONE port is never
// sent: these clients do not speak HBONE.
func gatewayEndpoints(k clientKind, gws []model.NetworkGateway, n uint32) ([]*endpointv3.LbEndpoint, string) {
	if k == kindProxylessPlain {
		return nil, WithheldNoTLS
	}
	usable := func(gw model.NetworkGateway) bool { return gw.Address.IsValid() && gw.TLSPassthroughPort != 0 }
	var total uint64
	for _, gw := range gws {
		if usable(gw) {
			total += uint64(max(gw.Capacity, 1))
		}
	}
	if total == 0 {
		return nil, WithheldNoGatewayTLS
	}
	var out []*endpointv3.LbEndpoint
	for _, gw := range gws {
		if !usable(gw) {
			continue
		}
		w := max(uint32(uint64(n)*uint64(max(gw.Capacity, 1))/total), 1)
		out = append(out, &endpointv3.LbEndpoint{
			HostIdentifier: &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{
				Address: socketAddress(gw.Address, uint32(gw.TLSPassthroughPort)),
			}},
			HealthStatus:        corev3.HealthStatus_HEALTHY,
			LoadBalancingWeight: wrapperspb.UInt32(w),
			Metadata:            &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{transportSocketMatchKey: tlsModeIstio()}},
		})
	}
	return out, ""
}
