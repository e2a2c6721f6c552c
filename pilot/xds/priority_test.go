package xds_test

import (
	"context"
	"fmt"
	"net/netip"
	"sort"
	"testing"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/peer"
	grpcxds "google.golang.org/grpc/xds"

	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/xds"
	"github.com/isthmus-mesh/isthmus/pilot/xds/xdstest"
)

// tiered publishes echo with endpoints at every tier seen from a client of
// net1/c1 in r1/z1: two in r1/z1 of c1, one in r1/z2 of c1, one in r2/z9
// of c1, one in r1/z1 of c2 (also net1), and two ready ones in r1/z1 on
// net2 behind its gateway. c1's definition of echo has preference lb.
func tiered(reg *xdstest.Registry, lb *model.LoadBalancing) {
	gw2 := model.NetworkGateway{Network: "net2", Cluster: "c3", Address: ip("10.2.255.1"), HBONEPort: 15008, TLSPassthroughPort: 15443, Source: "istio-system/eastwest", ServiceAccounts: []string{"eastwest"}}
	reg.SetGateway(gw2)
	at := func(cluster model.ClusterID, network model.Network, name, addr string, l model.Locality) *model.Workload {
		w := xdstest.Pod(cluster, network, ns, name, ip(addr))
		w.Locality = l
		return w
	}
	z1, z2, far := model.Locality{Region: "r1", Zone: "z1"}, model.Locality{Region: "r1", Zone: "z2"}, model.Locality{Region: "r2", Zone: "z9"}
	svc, ws := xdstest.Backing("echo", ns, tcp80, map[model.ClusterID][]netip.Addr{"c1": {ip("10.96.0.10")}},
		at("c1", "net1", "zone-a", "10.1.0.1", z1), at("c1", "net1", "zone-b", "10.1.0.2", z1),
		at("c1", "net1", "region", "10.1.0.3", z2), at("c1", "net1", "cluster", "10.1.0.4", far),
		at("c2", "net1", "network", "10.1.0.5", z1),
		at("c3", "net2", "remote-a", "10.2.0.1", z1), at("c3", "net2", "remote-b", "10.2.0.2", z1))
	svc.Definitions = []*model.ClusterService{{Cluster: "c1", Name: "echo", Namespace: ns, LoadBalancing: lb}}
	publish(reg, svc, ws)
}

// prioritiesOf returns, for a client of net1/c1 at locality l (nil: none), the
// ClusterLoadAssignment of echo port 80, after checking it with Validate:
// the addresses at each priority, and the assignment.
func prioritiesOf(t *testing.T, e *env, id string, l *corev3.Locality) ([][]string, *endpointv3.ClusterLoadAssignment) {
	t.Helper()
	n := node(id, "net1", "c1")
	n.Locality = l
	c := openSotw(t, dial(t, e.addr), n)
	cn := xds.ClusterName(echoHost, 80)
	c.send(&discovery.DiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNames: []string{cn}})
	clas := unpack[endpointv3.ClusterLoadAssignment](t, c.next(resource.EndpointType))
	require.Len(t, clas, 1)
	cla := clas[0]
	require.NoError(t, cla.Validate())
	var out [][]string
	for _, le := range cla.GetEndpoints() {
		p := int(le.GetPriority())
		for len(out) <= p {
			out = append(out, nil)
		}
		var w uint32
		for _, lb := range le.GetLbEndpoints() {
			out[p] = append(out[p], lb.GetEndpoint().GetAddress().GetSocketAddress().GetAddress())
			w += lb.GetLoadBalancingWeight().GetValue()
		}
		require.Equal(t, w, le.GetLoadBalancingWeight().GetValue(), "locality weight is the sum of its endpoints'")
	}
	for i := range out {
		require.NotEmpty(t, out[i], "priority %d is empty: priorities must be contiguous", i)
		sort.Strings(out[i])
	}
	return out, cla
}

// TestEDSPriorities proves EDS carries the routing preference's tiers as
// priorities relative to the requesting client's network, cluster and
// node locality (the workload API's order: zone, region, cluster, network,
// then the other network's gateway), contiguous from 0, with a failover
// overprovisioning factor; STRICT drops the others; a client without a
// locality, or in a zone without endpoints, gets the tiers it can tell; and
// a service without a preference keeps one priority, as before.
func TestEDSPriorities(t *testing.T) {
	const gw = "10.2.255.1"
	zone := *model.PreferSameZone()
	for _, tc := range []struct {
		name     string
		lb       *model.LoadBalancing
		locality *corev3.Locality
		want     [][]string
	}{
		{name: "PreferSameZone from r1/z1", lb: &zone, locality: &corev3.Locality{Region: "r1", Zone: "z1"},
			want: [][]string{{"10.1.0.1", "10.1.0.2"}, {"10.1.0.3"}, {"10.1.0.4"}, {"10.1.0.5"}, {gw}}},
		{name: "PreferSameZone from a zone without endpoints", lb: &zone, locality: &corev3.Locality{Region: "r1", Zone: "z7"},
			want: [][]string{{"10.1.0.1", "10.1.0.2", "10.1.0.3"}, {"10.1.0.4"}, {"10.1.0.5"}, {gw}}},
		{name: "PreferSameZone from a client without a locality", lb: &zone,
			want: [][]string{{"10.1.0.1", "10.1.0.2", "10.1.0.3", "10.1.0.4"}, {"10.1.0.5"}, {gw}}},
		{name: "PreferSameNode stops at the subzone (EDS knows no client node)", lb: model.PreferSameNode(),
			locality: &corev3.Locality{Region: "r1", Zone: "z1"},
			want:     [][]string{{"10.1.0.1", "10.1.0.2"}, {"10.1.0.3"}, {"10.1.0.4"}, {"10.1.0.5"}, {gw}}},
		{name: "STRICT cluster", lb: &model.LoadBalancing{Preference: []model.RoutingScope{model.RouteCluster}, Strict: true},
			locality: &corev3.Locality{Region: "r1", Zone: "z1"},
			want:     [][]string{{"10.1.0.1", "10.1.0.2", "10.1.0.3", "10.1.0.4"}}},
		{name: "no preference: one priority", lb: &model.LoadBalancing{Preference: []model.RoutingScope{}},
			locality: &corev3.Locality{Region: "r1", Zone: "z1"},
			want:     [][]string{{"10.1.0.1", "10.1.0.2", "10.1.0.3", "10.1.0.4", "10.1.0.5", gw}}},
		{name: "default: one priority, no policy", locality: &corev3.Locality{Region: "r1", Zone: "z1"},
			want: [][]string{{"10.1.0.1", "10.1.0.2", "10.1.0.3", "10.1.0.4", "10.1.0.5", gw}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reg := xdstest.New()
			tiered(reg, tc.lb)
			e := start(t, reg)
			got, cla := prioritiesOf(t, e, "envoy-1", tc.locality)
			require.Equal(t, tc.want, got)
			if tc.lb == nil {
				require.Nil(t, cla.GetPolicy(), "a service without a preference is served as before")
			} else {
				require.Equal(t, uint32(100000), cla.GetPolicy().GetOverprovisioningFactor().GetValue())
			}
		})
	}
}

// TestEDSLocalityClassesBounded proves the localities clients claim are
// bounded per network and cluster: past MaxLocalities a client is served
// as one without a locality, and a locality already admitted still is.
func TestEDSLocalityClassesBounded(t *testing.T) {
	reg := xdstest.New()
	zone := *model.PreferSameZone()
	tiered(reg, &zone)
	e := startWith(t, reg, xds.Config{AllowPlaintext: true, MaxLocalities: 1})
	z1 := &corev3.Locality{Region: "r1", Zone: "z1"}
	first, _ := prioritiesOf(t, e, "envoy-1", z1)
	require.Len(t, first, 5)
	over, _ := prioritiesOf(t, e, "envoy-2", &corev3.Locality{Region: "r1", Zone: "z2"})
	require.Equal(t, [][]string{{"10.1.0.1", "10.1.0.2", "10.1.0.3", "10.1.0.4"}, {"10.1.0.5"}, {"10.2.255.1"}}, over,
		"past the bound: served without a locality")
	again, _ := prioritiesOf(t, e, "envoy-3", z1)
	require.Equal(t, first, again)
	long, _ := prioritiesOf(t, e, "envoy-4", &corev3.Locality{Region: fmt.Sprintf("%064d", 0), Zone: "z1"})
	require.Len(t, long, 3, "a locality longer than a label value is none")

	// The other Envoy types do not depend on the locality: a client with
	// one gets them (from its network and cluster's view).
	n := node("envoy-5", "net1", "c1")
	n.Locality = z1
	c := openSotw(t, dial(t, e.addr), n)
	c.send(&discovery.DiscoveryRequest{TypeUrl: resource.ClusterType})
	clusters := unpack[clusterv3.Cluster](t, c.next(resource.ClusterType))
	require.Len(t, clusters, 1)
	require.Equal(t, xds.ClusterName(echoHost, 80), clusters[0].GetName())
}

// TestProxylessGRPCPriorities proves a real grpc-go xDS client, whose
// bootstrap names its locality, follows the EDS priorities of a
// PreferSameZone service: every call to its zone's instance while it is
// ready, to the other zone's when it is not, to the other cluster's only
// when its cluster has no ready instance, and back.
func TestProxylessGRPCPriorities(t *testing.T) {
	addrs := map[string]netip.AddrPort{
		"zone":    echoServer(t, "127.0.30.1"),
		"region":  echoServer(t, "127.0.30.2"),
		"network": echoServer(t, "127.0.30.3"),
	}
	reg := xdstest.New()
	ports := []model.Port{{Name: "grpc", Port: 7070, Protocol: model.TCP, AppProtocol: "grpc"}}
	zone := *model.PreferSameZone()
	publishReady := func(ready map[string]bool) {
		at := func(cluster model.ClusterID, name string, l model.Locality) *model.Workload {
			w := xdstest.Pod(cluster, "net1", ns, name, addrs[name].Addr())
			w.Locality, w.Ready = l, ready[name]
			return w
		}
		svc, ws := xdstest.Backing("echo", ns, ports, nil,
			at("c1", "zone", model.Locality{Region: "r1", Zone: "z1"}), at("c1", "region", model.Locality{Region: "r1", Zone: "z2"}),
			at("c2", "network", model.Locality{Region: "r1", Zone: "z1"}))
		for cl, shard := range svc.Shards {
			for i := range shard {
				svc.Shards[cl][i].Ports = []model.PortMapping{{ServicePort: 7070, TargetPort: addrs[shard[i].Workload.Name].Port()}}
			}
		}
		svc.Definitions = []*model.ClusterService{{Cluster: "c1", Name: "echo", Namespace: ns, LoadBalancing: &zone}}
		publish(reg, svc, ws)
	}
	publishReady(map[string]bool{"zone": true, "region": true, "network": true})
	e := start(t, reg)
	bootstrap := fmt.Sprintf(`{
		"xds_servers": [{"server_uri": %q, "channel_creds": [{"type": "insecure"}], "server_features": ["xds_v3"]}],
		"node": {"id": "proxyless-z1", "locality": {"region": "r1", "zone": "z1"}, "metadata": {"NETWORK": "net1", "CLUSTER_ID": "c1"}}
	}`, e.addr)
	rb, err := grpcxds.NewXDSResolverWithConfigForTesting([]byte(bootstrap))
	require.NoError(t, err)
	cc, err := grpc.NewClient("xds:///"+echoHost+":7070", grpc.WithResolvers(rb), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer cc.Close()
	client := healthpb.NewHealthClient(cc)
	call := func() (netip.AddrPort, error) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		var p peer.Peer
		if _, err := client.Check(ctx, &healthpb.HealthCheckRequest{}, grpc.Peer(&p)); err != nil {
			return netip.AddrPort{}, err
		}
		return netip.ParseAddrPort(p.Addr.String())
	}
	only := func(name string) {
		t.Helper()
		require.EventuallyWithT(t, func(ct *assertT) {
			for range 10 {
				a, err := call()
				if !assertNoError(ct, err) || !assertEqual(ct, addrs[name], a) {
					return
				}
			}
		}, 10*time.Second, 20*time.Millisecond, "every call to %s", name)
	}
	only("zone")
	publishReady(map[string]bool{"region": true, "network": true})
	only("region")
	publishReady(map[string]bool{"network": true})
	only("network")
	publishReady(map[string]bool{"zone": true, "region": true, "network": true})
	only("zone")
	for range 20 {
		a, err := call()
		require.NoError(t, err)
		require.Equal(t, addrs["zone"], a)
	}
}
