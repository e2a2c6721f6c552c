package xds_test

import (
	"fmt"
	"net/netip"
	"sort"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/xds"
	"github.com/isthmus-mesh/isthmus/pilot/xds/xdstest"
)

// tiered publishes echo with endpoints at every tier seen from a client of
// net1/c1 in r1/z1: two in r1/z1 of c1, one in r1/z2 of c1, one in r2/z9
// of c1, one in r1/z1 of c2 (also net1), and two ready ones in r1/z1 on
// net2 behind its gateway. c1's definition of echo has preference lb.
func tiered(reg *xdstest.Registry, lb *model.LoadBalancing) {
	gw2 := model.NetworkGateway{Network: "net2", Cluster: "c3", Address: ip("10.2.255.1"), HBONEPort: 15008, Source: "istio-system/eastwest", ServiceAccounts: []string{"eastwest"}}
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

// edsOf returns, for a client of net1/c1 at locality l (nil: none), the
// ClusterLoadAssignment of echo port 80, after checking it with Validate:
// the addresses at each priority, and the assignment.
func edsOf(t *testing.T, e *env, id string, l *corev3.Locality) ([][]string, *endpointv3.ClusterLoadAssignment) {
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
	zone := model.PreferSameZone
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
		{name: "PreferSameNode stops at the subzone (EDS knows no client node)", lb: &model.PreferSameNode,
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
			got, cla := edsOf(t, e, "envoy-1", tc.locality)
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
	zone := model.PreferSameZone
	tiered(reg, &zone)
	e := startWith(t, reg, xds.Config{AllowPlaintext: true, MaxLocalities: 1})
	z1 := &corev3.Locality{Region: "r1", Zone: "z1"}
	first, _ := edsOf(t, e, "envoy-1", z1)
	require.Len(t, first, 5)
	over, _ := edsOf(t, e, "envoy-2", &corev3.Locality{Region: "r1", Zone: "z2"})
	require.Equal(t, [][]string{{"10.1.0.1", "10.1.0.2", "10.1.0.3", "10.1.0.4"}, {"10.1.0.5"}, {"10.2.255.1"}}, over,
		"past the bound: served without a locality")
	again, _ := edsOf(t, e, "envoy-3", z1)
	require.Equal(t, first, again)
	long, _ := edsOf(t, e, "envoy-4", &corev3.Locality{Region: fmt.Sprintf("%064d", 0), Zone: "z1"})
	require.Len(t, long, 3, "a locality longer than a label value is none")
}
