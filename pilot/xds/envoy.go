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
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
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
}

func newEnvoyBuilder(connectTimeout time.Duration) (*envoyBuilder, error) {
	router, err := anypb.New(&routerv3.Router{})
	if err != nil {
		return nil, fmt.Errorf("router filter config: %w", err)
	}
	return &envoyBuilder{
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
func (b *envoyBuilder) build(c class, s *model.Service, gws gatewayIndex, out map[string]map[string]types.Resource) error {
	if s == nil || !c.sees(s) {
		return nil
	}
	for _, p := range s.Ports {
		if p.Protocol != "" && p.Protocol != model.TCP {
			continue
		}
		cn := ClusterName(s.Hostname, p.Port)
		ln := ListenerName(s.Hostname, p.Port)
		out[resource.ClusterType][cn] = b.cluster(cn)
		out[resource.EndpointType][cn] = loadAssignment(c, s, p.Port, cn, gws)
		l, err := b.listener(ln)
		if err != nil {
			return err
		}
		out[resource.ListenerType][ln] = l
		out[resource.RouteType][ln] = routeConfig(ln, s.Hostname, cn)
	}
	return nil
}

func (b *envoyBuilder) cluster(name string) *clusterv3.Cluster {
	return &clusterv3.Cluster{
		Name:                 name,
		ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_EDS},
		EdsClusterConfig:     &clusterv3.Cluster_EdsClusterConfig{EdsConfig: b.ads, ServiceName: name},
		ConnectTimeout:       b.connectTimeout,
		LbPolicy:             clusterv3.Cluster_ROUND_ROBIN,
	}
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
// the ready endpoints of another network are replaced, per locality, by the
// network's trusted gateways, their number spread over the gateways by
// capacity. Gateways without an IP are left out (EDS endpoints must be
// addresses).
//
// A service with a routing preference for c's cluster
// (Service.LoadBalancingFor) has priorities: an endpoint's priority is the
// number of the preference's scopes it does not share with c (see tier),
// renumbered to be contiguous from 0, so the client's best tier is priority
// 0; STRICT leaves out the endpoints that do not share them all; and a
// tier takes all the traffic while it has a healthy endpoint
// (failoverOverprovisioning). Without a preference every endpoint has
// priority 0.
func loadAssignment(c class, s *model.Service, port uint16, name string, gws gatewayIndex) *endpointv3.ClusterLoadAssignment {
	lb := s.LoadBalancingFor(c.Cluster)
	groups := map[groupKey][]*endpointv3.LbEndpoint{}
	remote := map[remoteKey]uint32{}
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
				if healthy(e.Ready(), e.Terminating()) {
					remote[remoteKey{e.Network(), e.Locality(), prio}]++
				}
				continue
			}
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
	for k, n := range remote {
		if eps := gatewayEndpoints(gws[k.network], n); len(eps) > 0 {
			g := groupKey{k.locality, k.priority}
			groups[g] = append(groups[g], eps...)
		}
	}
	keys := make([]groupKey, 0, len(groups))
	used := map[uint32]bool{}
	for k := range groups {
		keys = append(keys, k)
		used[k.priority] = true
	}
	slices.SortFunc(keys, func(a, b groupKey) int {
		return cmp.Or(cmp.Compare(a.priority, b.priority), cmp.Compare(a.locality.String(), b.locality.String()))
	})
	// Contiguous priorities: the i-th used one becomes i.
	renumber := map[uint32]uint32{}
	for _, p := range slices.Sorted(maps.Keys(used)) {
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
	return cla
}

// gatewayEndpoints stands for n ready endpoints behind gws: one endpoint per
// gateway with an IP, weighted by its share of the gateways' capacity (at
// least 1).
func gatewayEndpoints(gws []model.NetworkGateway, n uint32) []*endpointv3.LbEndpoint {
	var total uint64
	for _, gw := range gws {
		if gw.Address.IsValid() {
			total += uint64(max(gw.Capacity, 1))
		}
	}
	var out []*endpointv3.LbEndpoint
	for _, gw := range gws {
		if !gw.Address.IsValid() {
			continue
		}
		w := max(uint32(uint64(n)*uint64(max(gw.Capacity, 1))/total), 1)
		out = append(out, &endpointv3.LbEndpoint{
			HostIdentifier: &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{
				Address: socketAddress(gw.Address, uint32(cmp.Or(gw.HBONEPort, model.HBONEPort))),
			}},
			HealthStatus:        corev3.HealthStatus_HEALTHY,
			LoadBalancingWeight: wrapperspb.UInt32(w),
		})
	}
	return out
}
