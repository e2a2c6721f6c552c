package xdsclient

import (
	"net/netip"
	"testing"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

func res(t *testing.T, name string, a proto.Message) *discovery.Resource {
	t.Helper()
	b, err := proto.Marshal(a)
	require.NoError(t, err)
	return &discovery.Resource{Name: name, Version: "v1", Resource: &anypb.Any{TypeUrl: workloadv1.TypeURL, Value: b}}
}

func pod(mut func(*workloadv1.Workload)) *workloadv1.Address {
	w := &workloadv1.Workload{
		Uid: "c1/ns/p", Name: "p", Namespace: "ns", Addresses: [][]byte{{10, 0, 0, 1}},
		Network: "n1", ServiceAccount: "sa", TunnelProtocol: workloadv1.TunnelProtocol_HBONE,
		Services: map[string]*workloadv1.PortList{"ns/s.ns.svc.cluster.local": {Ports: []*workloadv1.Port{{ServicePort: 80, TargetPort: 8080}}}},
	}
	if mut != nil {
		mut(w)
	}
	return &workloadv1.Address{Type: &workloadv1.Address_Workload{Workload: w}}
}

// TestDecodeRejects proves each validation rule refuses a resource, with an
// error naming the resource.
func TestDecodeRejects(t *testing.T) {
	cv := converter{network: "n1", trustDomain: "cluster.local"}
	for _, tc := range []struct {
		name string
		r    *discovery.Resource
		want string
	}{
		{"empty name", res(t, "", pod(nil)), "without a name"},
		{"wrong type", &discovery.Resource{Name: "x", Resource: &anypb.Any{TypeUrl: "type.googleapis.com/other"}}, "type"},
		{"garbage", &discovery.Resource{Name: "x", Resource: &anypb.Any{TypeUrl: workloadv1.TypeURL, Value: []byte{0x0a, 0x05, 0xff}}}, "unmarshal"},
		{"empty address", res(t, "x", &workloadv1.Address{}), "neither a workload nor a service"},
		{"uid mismatch", res(t, "c1/ns/q", pod(nil)), "differs from the resource name"},
		{"3-byte ip", res(t, "c1/ns/p", pod(func(w *workloadv1.Workload) { w.Addresses = [][]byte{{1, 2, 3}} })), "IP of 3 bytes"},
		{"no address no gateway", res(t, "c1/ns/p", pod(func(w *workloadv1.Workload) { w.Addresses = nil })), "neither an address"},
		{"port out of range", res(t, "c1/ns/p", pod(func(w *workloadv1.Workload) {
			w.Services["ns/s.ns.svc.cluster.local"].Ports[0].TargetPort = 70000
		})), "bad target port"},
		{"service key mismatch", res(t, "ns/other", &workloadv1.Address{Type: &workloadv1.Address_Service{Service: &workloadv1.Service{Name: "s", Namespace: "ns"}}}), "differs from the resource name"},
		{"service without namespace", res(t, "x", &workloadv1.Address{Type: &workloadv1.Address_Service{Service: &workloadv1.Service{Name: "s"}}}), "name and namespace"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := cv.decode(tc.r)
			require.ErrorContains(t, err, tc.want)
		})
	}
}

// TestDecodeService proves a service converts with its default hostname,
// the VIPs of the client's network (or of no network) and its ports.
func TestDecodeService(t *testing.T) {
	cv := converter{network: "n1", trustDomain: "cluster.local"}
	r, err := cv.decode(res(t, "ns/s.ns.svc.cluster.local", &workloadv1.Address{Type: &workloadv1.Address_Service{Service: &workloadv1.Service{
		Name: "s", Namespace: "ns",
		Addresses: []*workloadv1.NetworkAddress{
			{Network: "n1", Address: []byte{10, 96, 0, 1}},
			{Network: "n2", Address: []byte{10, 97, 0, 1}},
			{Address: netip.MustParseAddr("fd00::1").AsSlice()},
		},
		Ports: []*workloadv1.ServicePort{{ServicePort: 80}, {ServicePort: 443, TargetPort: 8443}},
	}}}))
	require.NoError(t, err)
	require.Equal(t, kindService, r.kind)
	require.Equal(t, &state.Service{
		Name: "s", Namespace: "ns", Hostname: "s.ns.svc.cluster.local",
		VIPs:  []netip.Addr{netip.MustParseAddr("10.96.0.1"), netip.MustParseAddr("fd00::1")},
		Ports: []uint16{80, 443},
	}, r.service)
}

// TestDecodeWorkloadDefaults proves the trust domain default and the
// status mapping.
func TestDecodeWorkloadDefaults(t *testing.T) {
	cv := converter{network: "n1", trustDomain: "example.org"}
	r, err := cv.decode(res(t, "c1/ns/p", pod(func(w *workloadv1.Workload) {
		w.Status = workloadv1.WorkloadStatus_UNHEALTHY
	})))
	require.NoError(t, err)
	require.Equal(t, "spiffe://example.org/ns/ns/sa/sa", r.workload.Identity().String())
	require.Equal(t, state.StatusNotReady, r.workload.Status)
	require.Equal(t, "v1", r.version)
}

func splitW(mut func(*workloadv1.Workload)) *workloadv1.Address {
	w := &workloadv1.Workload{
		Uid: "split/n2/ns/s.ns.svc.cluster.local", Name: "s.ns.svc.cluster.local", Namespace: "ns", Network: "n2",
		TunnelProtocol: workloadv1.TunnelProtocol_HBONE, Capacity: 2,
		Identities: []string{"spiffe://cluster.local/ns/ns/sa/a", "spiffe://cluster.local/ns/ns/sa/b"},
		NetworkGateways: []*workloadv1.GatewayAddress{
			{Destination: &workloadv1.GatewayAddress_Hostname{Hostname: "gw.example"},
				Identities: []string{"spiffe://cluster.local/ns/isthmus-system/sa/eastwest"}, Capacity: 3},
			{Destination: &workloadv1.GatewayAddress_Address{Address: []byte{10, 2, 0, 1}}, HboneMtlsPort: 15443,
				Identities: []string{"spiffe://cluster.local/ns/isthmus-system/sa/eastwest"}},
		},
		Services: map[string]*workloadv1.PortList{"ns/s.ns.svc.cluster.local": {Ports: []*workloadv1.Port{{ServicePort: 80, TargetPort: 80}}}},
	}
	if mut != nil {
		mut(w)
	}
	return &workloadv1.Address{Type: &workloadv1.Address_Workload{Workload: w}}
}

// TestDecodeSplitHorizon proves a split-horizon workload keeps every
// gateway (by name or address) with the identities it may present and its
// capacity, and the identities of the endpoints behind them; and that a
// gateway or split workload without identities, or a workload with both an
// address and gateways, is refused.
func TestDecodeSplitHorizon(t *testing.T) {
	cv := converter{network: "n1", trustDomain: "cluster.local"}
	const name = "split/n2/ns/s.ns.svc.cluster.local"
	r, err := cv.decode(res(t, name, splitW(nil)))
	require.NoError(t, err)
	w := r.workload
	require.True(t, w.Synthetic())
	gwID := identity.Identity{TrustDomain: "cluster.local", Namespace: "isthmus-system", ServiceAccount: "eastwest"}
	require.Equal(t, []*state.NetworkGateway{
		{Network: "n2", Hostname: "gw.example", HBONEPort: 15008, Identities: []identity.Identity{gwID}, Capacity: 3},
		{Network: "n2", Address: netip.MustParseAddr("10.2.0.1"), HBONEPort: 15443, Identities: []identity.Identity{gwID}},
	}, w.Gateways)
	require.Equal(t, "gw.example:15008", w.Gateways[0].Target())
	require.Equal(t, []identity.Identity{
		{TrustDomain: "cluster.local", Namespace: "ns", ServiceAccount: "a"},
		{TrustDomain: "cluster.local", Namespace: "ns", ServiceAccount: "b"},
	}, w.PeerIdentities())

	for _, tc := range []struct {
		name string
		mut  func(*workloadv1.Workload)
		want string
	}{
		{"gateway hostname not a DNS name", func(w *workloadv1.Workload) {
			w.NetworkGateways[0].Destination = &workloadv1.GatewayAddress_Hostname{Hostname: "gw.example:15008"}
		}, "not a DNS name"},
		{"gateway without identity", func(w *workloadv1.Workload) { w.NetworkGateways[1].Identities = nil }, "names no identity"},
		{"gateway with a bad identity", func(w *workloadv1.Workload) {
			w.NetworkGateways[1].Identities = []string{"spiffe://cluster.local/workload"}
		}, "ns/<namespace>"},
		{"no end-to-end identity", func(w *workloadv1.Workload) { w.Identities = nil }, "no identity to verify end to end"},
		{"address and gateways", func(w *workloadv1.Workload) { w.Addresses = [][]byte{{10, 0, 0, 9}} }, "both addresses and network gateways"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := cv.decode(res(t, name, splitW(tc.mut)))
			require.ErrorContains(t, err, tc.want)
			require.ErrorContains(t, err, name)
		})
	}
}

// TestDecodeLoadBalancing proves a service's routing preference converts
// scope by scope with its mode (UNSPECIFIED_MODE is FAILOVER), that unset
// stays unset (the default order) and an empty preference stays empty (no
// preference), and that an unknown scope or mode, or a repeated scope, is
// refused.
func TestDecodeLoadBalancing(t *testing.T) {
	cv := converter{network: "n1", trustDomain: "cluster.local"}
	const name = "ns/s.ns.svc.cluster.local"
	svc := func(lb *workloadv1.LoadBalancing) *discovery.Resource {
		return res(t, name, &workloadv1.Address{Type: &workloadv1.Address_Service{Service: &workloadv1.Service{
			Name: "s", Namespace: "ns", Ports: []*workloadv1.ServicePort{{ServicePort: 80}}, LoadBalancing: lb,
		}}})
	}
	all := []workloadv1.LoadBalancing_Scope{workloadv1.LoadBalancing_NETWORK, workloadv1.LoadBalancing_CLUSTER,
		workloadv1.LoadBalancing_REGION, workloadv1.LoadBalancing_ZONE, workloadv1.LoadBalancing_SUBZONE, workloadv1.LoadBalancing_NODE}
	for _, tc := range []struct {
		name string
		lb   *workloadv1.LoadBalancing
		want *state.LoadBalancing
	}{
		{"unset", nil, nil},
		{"no preference", &workloadv1.LoadBalancing{Mode: workloadv1.LoadBalancing_FAILOVER}, &state.LoadBalancing{Preference: []state.Scope{}}},
		{"every scope, unspecified mode", &workloadv1.LoadBalancing{RoutingPreference: all},
			&state.LoadBalancing{Preference: []state.Scope{state.ScopeNetwork, state.ScopeCluster, state.ScopeRegion, state.ScopeZone, state.ScopeSubzone, state.ScopeNode}}},
		{"strict cluster", &workloadv1.LoadBalancing{Mode: workloadv1.LoadBalancing_STRICT, RoutingPreference: []workloadv1.LoadBalancing_Scope{workloadv1.LoadBalancing_CLUSTER}},
			&state.LoadBalancing{Preference: []state.Scope{state.ScopeCluster}, Strict: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := cv.decode(svc(tc.lb))
			require.NoError(t, err)
			require.Equal(t, tc.want, r.service.LoadBalancing)
		})
	}
	for _, tc := range []struct {
		name string
		lb   *workloadv1.LoadBalancing
		want string
	}{
		{"unknown scope", &workloadv1.LoadBalancing{RoutingPreference: []workloadv1.LoadBalancing_Scope{workloadv1.LoadBalancing_ZONE, 42}}, "routing preference 1: unknown scope 42"},
		{"unspecified scope", &workloadv1.LoadBalancing{RoutingPreference: []workloadv1.LoadBalancing_Scope{workloadv1.LoadBalancing_SCOPE_UNSPECIFIED}}, "unknown scope 0"},
		{"unknown mode", &workloadv1.LoadBalancing{Mode: 7}, "unknown mode 7"},
		{"repeated scope", &workloadv1.LoadBalancing{RoutingPreference: []workloadv1.LoadBalancing_Scope{workloadv1.LoadBalancing_ZONE, workloadv1.LoadBalancing_ZONE}}, "ZONE listed twice"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := cv.decode(svc(tc.lb))
			require.ErrorContains(t, err, tc.want)
			require.ErrorContains(t, err, name)
		})
	}
}
