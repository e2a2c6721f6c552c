package xds

import (
	"cmp"
	"fmt"
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

// remoteKey groups the endpoints of another network by locality.
type remoteKey struct {
	network  model.Network
	locality model.Locality
}

// loadAssignment builds the ClusterLoadAssignment of port of s for clients of
// c, grouped by locality. Endpoints on c's network are listed directly;
// the ready endpoints of another network are replaced, per locality, by the
// network's trusted gateways, their number spread over the gateways by
// capacity. Gateways without an IP are left out (EDS endpoints must be
// addresses).
func loadAssignment(c class, s *model.Service, port uint16, name string, gws gatewayIndex) *endpointv3.ClusterLoadAssignment {
	groups := map[model.Locality][]*endpointv3.LbEndpoint{}
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
			if e.Network() != c.Network {
				if healthy(e.Ready(), e.Terminating()) {
					remote[remoteKey{e.Network(), e.Locality()}]++
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
			groups[e.Locality()] = append(groups[e.Locality()], &endpointv3.LbEndpoint{
				HostIdentifier:      &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{Address: socketAddress(e.Address(), uint32(target))}},
				HealthStatus:        hs,
				LoadBalancingWeight: wrapperspb.UInt32(1),
			})
		}
	}
	for k, n := range remote {
		groups[k.locality] = append(groups[k.locality], gatewayEndpoints(gws[k.network], n)...)
	}
	localities := make([]model.Locality, 0, len(groups))
	for l := range groups {
		localities = append(localities, l)
	}
	slices.SortFunc(localities, func(a, b model.Locality) int { return cmp.Compare(a.String(), b.String()) })
	cla := &endpointv3.ClusterLoadAssignment{ClusterName: name}
	for _, l := range localities {
		eps := groups[l]
		slices.SortFunc(eps, func(a, b *endpointv3.LbEndpoint) int {
			sa, sb := a.GetEndpoint().GetAddress().GetSocketAddress(), b.GetEndpoint().GetAddress().GetSocketAddress()
			return cmp.Or(cmp.Compare(sa.GetAddress(), sb.GetAddress()), cmp.Compare(sa.GetPortValue(), sb.GetPortValue()))
		})
		var weight uint32
		for _, e := range eps {
			weight += e.GetLoadBalancingWeight().GetValue()
		}
		cla.Endpoints = append(cla.Endpoints, &endpointv3.LocalityLbEndpoints{
			Locality:            &corev3.Locality{Region: l.Region, Zone: l.Zone, SubZone: l.Subzone},
			LbEndpoints:         eps,
			LoadBalancingWeight: wrapperspb.UInt32(weight),
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
