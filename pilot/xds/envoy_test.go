package xds_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/stretchr/testify/require"
	statuspb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"

	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/xds"
	"github.com/isthmus-mesh/isthmus/pilot/xds/xdstest"
)

// sotwClient is a raw state-of-the-world ADS client.
type sotwClient struct {
	t      testing.TB
	stream discovery.AggregatedDiscoveryService_StreamAggregatedResourcesClient
	cancel context.CancelFunc
	recv   chan *discovery.DiscoveryResponse
	done   chan struct{}
	node   *corev3.Node
}

func openSotw(t testing.TB, cc *grpc.ClientConn, n *corev3.Node) *sotwClient {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	stream, err := discovery.NewAggregatedDiscoveryServiceClient(cc).StreamAggregatedResources(ctx)
	require.NoError(t, err)
	c := &sotwClient{t: t, stream: stream, cancel: cancel, recv: make(chan *discovery.DiscoveryResponse, 100), done: make(chan struct{}), node: n}
	go func() {
		defer close(c.done)
		for {
			r, err := stream.Recv()
			if err != nil {
				return
			}
			c.recv <- r
		}
	}()
	t.Cleanup(func() { cancel(); <-c.done })
	return c
}

func (c *sotwClient) send(req *discovery.DiscoveryRequest) {
	c.t.Helper()
	req.Node = c.node
	require.NoError(c.t, c.stream.Send(req))
}

// next returns the next response of typeURL, skipping others.
func (c *sotwClient) next(typeURL string) *discovery.DiscoveryResponse {
	c.t.Helper()
	deadline := time.After(waitFor)
	for {
		select {
		case r := <-c.recv:
			if r.GetTypeUrl() == typeURL {
				return r
			}
		case <-deadline:
			c.t.Fatalf("no %s response within %s", typeURL, waitFor)
			return nil
		}
	}
}

func (c *sotwClient) ack(r *discovery.DiscoveryResponse, names ...string) {
	c.send(&discovery.DiscoveryRequest{TypeUrl: r.GetTypeUrl(), VersionInfo: r.GetVersionInfo(), ResponseNonce: r.GetNonce(), ResourceNames: names})
}

func unpack[T any, P interface {
	*T
	protoMessage
}](t testing.TB, r *discovery.DiscoveryResponse) []P {
	t.Helper()
	out := make([]P, 0, len(r.GetResources()))
	for _, a := range r.GetResources() {
		m := P(new(T))
		require.NoError(t, a.UnmarshalTo(m))
		out = append(out, m)
	}
	return out
}

// twoNetworks publishes echo with two ready pods on net1/c1 (locality
// r1/z1) and two on net2/c2, and net2's gateway.
func twoNetworks(reg *xdstest.Registry) model.NetworkGateway {
	gw2 := model.NetworkGateway{Network: "net2", Cluster: "c2", Address: ip("10.2.255.1"), HBONEPort: 15008, TLSPassthroughPort: 15443,
		Source: "istio-system/eastwest", ServiceAccounts: []string{"eastwest"}}
	reg.SetGateway(gw2)
	l1, l2 := xdstest.Pod("c1", "net1", ns, "l1", ip("10.1.0.1")), xdstest.Pod("c1", "net1", ns, "l2", ip("10.1.0.2"))
	l1.Locality = model.Locality{Region: "r1", Zone: "z1"}
	l2.Locality = l1.Locality
	r1, r2 := xdstest.Pod("c2", "net2", ns, "r1", ip("10.2.0.1")), xdstest.Pod("c2", "net2", ns, "r2", ip("10.2.0.2"))
	r1.Locality = model.Locality{Region: "r2", Zone: "z1"}
	r2.Locality = r1.Locality
	svc, ws := xdstest.Backing("echo", ns, tcp80, map[model.ClusterID][]netip.Addr{"c1": {ip("10.96.0.10")}}, l1, l2, r1, r2)
	publish(reg, svc, ws)
	return gw2
}

// TestSotwEnvoyResources proves the CDS/EDS/LDS/RDS a network-1 client gets
// over SotW ADS: an EDS cluster over ADS per service port, endpoints grouped
// by locality with network 2 replaced by its gateway's SNI passthrough port
// (15443, never its HBONE port) weighted by the two endpoints behind it and
// marked for Istio's mTLS, which the cluster's transport socket match gives
// Istio's SNI and the remote endpoints' identities; and an API listener
// whose RDS route targets the cluster. Every resource passes Envoy's own
// validation (Validate).
func TestSotwEnvoyResources(t *testing.T) {
	reg := xdstest.New()
	gw2 := twoNetworks(reg)
	e := start(t, reg)
	c := openSotw(t, dial(t, e.addr), node("envoy-1", "net1", "c1"))
	cn, ln := xds.ClusterName(echoHost, 80), xds.ListenerName(echoHost, 80)
	require.Equal(t, "outbound|80||echo.default.svc.cluster.local", cn)

	c.send(&discovery.DiscoveryRequest{TypeUrl: resource.ClusterType})
	r := c.next(resource.ClusterType)
	clusters := unpack[clusterv3.Cluster](t, r)
	require.Len(t, clusters, 1)
	require.Equal(t, cn, clusters[0].GetName())
	require.Equal(t, clusterv3.Cluster_EDS, clusters[0].GetType())
	require.NotNil(t, clusters[0].GetEdsClusterConfig().GetEdsConfig().GetAds())
	require.NoError(t, clusters[0].ValidateAll())
	requireIstioMTLS(t, clusters[0], "outbound_.80_._."+echoHost, "spiffe://cluster.local/ns/default/sa/default")
	c.ack(r)

	c.send(&discovery.DiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNames: []string{cn}})
	r = c.next(resource.EndpointType)
	clas := unpack[endpointv3.ClusterLoadAssignment](t, r)
	require.Len(t, clas, 1)
	type ep struct {
		locality, addr string
		port, weight   uint32
	}
	require.NoError(t, clas[0].ValidateAll())
	var got []ep
	for _, le := range clas[0].GetEndpoints() {
		require.Positive(t, le.GetLoadBalancingWeight().GetValue())
		for _, lb := range le.GetLbEndpoints() {
			sa := lb.GetEndpoint().GetAddress().GetSocketAddress()
			tlsMode := lb.GetMetadata().GetFilterMetadata()["envoy.transport_socket_match"].GetFields()["tlsMode"].GetStringValue()
			require.Equal(t, sa.GetAddress() == gw2.Address.String(), tlsMode == "istio", "only the gateway's endpoint is marked for Istio's mTLS")
			got = append(got, ep{le.GetLocality().GetRegion() + "/" + le.GetLocality().GetZone(), sa.GetAddress(), sa.GetPortValue(), lb.GetLoadBalancingWeight().GetValue()})
		}
	}
	require.ElementsMatch(t, []ep{
		{"r1/z1", "10.1.0.1", 8080, 1}, {"r1/z1", "10.1.0.2", 8080, 1},
		{"r2/z1", gw2.Address.String(), 15443, 2},
	}, got)
	c.ack(r, cn)

	c.send(&discovery.DiscoveryRequest{TypeUrl: resource.ListenerType, ResourceNames: []string{ln}})
	r = c.next(resource.ListenerType)
	ls := unpack[listenerv3.Listener](t, r)
	require.Len(t, ls, 1)
	require.NoError(t, ls[0].ValidateAll())
	hcm := &hcmv3.HttpConnectionManager{}
	require.NoError(t, ls[0].GetApiListener().GetApiListener().UnmarshalTo(hcm))
	require.Equal(t, ln, hcm.GetRds().GetRouteConfigName())
	require.NotNil(t, hcm.GetRds().GetConfigSource().GetAds())
	c.ack(r, ln)

	c.send(&discovery.DiscoveryRequest{TypeUrl: resource.RouteType, ResourceNames: []string{ln}})
	r = c.next(resource.RouteType)
	rcs := unpack[routev3.RouteConfiguration](t, r)
	require.Len(t, rcs, 1)
	require.NoError(t, rcs[0].ValidateAll())
	require.Contains(t, rcs[0].GetVirtualHosts()[0].GetDomains(), ln)
	require.Equal(t, cn, rcs[0].GetVirtualHosts()[0].GetRoutes()[0].GetRoute().GetCluster())
}

// TestSotwNackThenFix proves a NACK is counted and visible in syncz with the
// last good version kept as ACKed, and that the next good push is ACKed.
func TestSotwNackThenFix(t *testing.T) {
	reg := xdstest.New()
	svc, ws := xdstest.Backing("echo", ns, tcp80, nil, xdstest.Pod("c1", "net1", ns, "a", ip("10.0.0.1")))
	publish(reg, svc, ws)
	e := start(t, reg)
	c := openSotw(t, dial(t, e.addr), node("envoy-1", "net1", "c1"))
	c.send(&discovery.DiscoveryRequest{TypeUrl: resource.ClusterType})
	good := c.next(resource.ClusterType)
	c.ack(good)

	other, ows := xdstest.Backing("other", ns, tcp80, nil, xdstest.Pod("c1", "net1", ns, "o", ip("10.0.0.2")))
	publish(reg, other, ows)
	bad := c.next(resource.ClusterType)
	require.Len(t, bad.GetResources(), 2)
	c.send(&discovery.DiscoveryRequest{TypeUrl: resource.ClusterType, VersionInfo: good.GetVersionInfo(), ResponseNonce: bad.GetNonce(),
		ErrorDetail: &statuspb.Status{Code: 3, Message: "bad cluster"}})

	require.EventuallyWithT(t, func(ct *assertT) {
		st := clusterStatus(e, "envoy-1")
		if !assertNotNil(ct, st) || !assertNotNil(ct, st.LastNack) {
			return
		}
		assertEqual(ct, "bad cluster", st.LastNack.Message)
		assertEqual(ct, good.GetVersionInfo(), st.AckedVersion)
		assertEqual(ct, false, st.Pending)
	}, waitFor, 10*time.Millisecond)
	require.Equal(t, 1.0, counter(t, e, "isthmus_xds_nacks_total"))

	// The fix: the registry changes again; the new push is ACKed.
	reg.RemoveService(other.Hostname)
	fixed := c.next(resource.ClusterType)
	require.Len(t, fixed.GetResources(), 1)
	c.ack(fixed)
	require.EventuallyWithT(t, func(ct *assertT) {
		st := clusterStatus(e, "envoy-1")
		if assertNotNil(ct, st) {
			assertEqual(ct, fixed.GetVersionInfo(), st.AckedVersion)
		}
	}, waitFor, 10*time.Millisecond)
}

// TestDeltaNackThenFix proves the same for a delta (ztunnel) client.
func TestDeltaNackThenFix(t *testing.T) {
	reg := xdstest.New()
	reg.SetWorkload(xdstest.Pod("c1", "net1", ns, "a", ip("10.0.0.1")))
	e := start(t, reg)
	c := openDelta(t, dial(t, e.addr), wildcard(node("zt-1", "net1", "c1")))
	good := c.next()
	c.apply(good)
	reg.SetWorkload(xdstest.Pod("c1", "net1", ns, "b", ip("10.0.0.2")))
	bad := c.next()
	c.nack(bad, "cannot parse workload")
	require.EventuallyWithT(t, func(ct *assertT) {
		st := typeStatus(e, "zt-1", xds.WorkloadType)
		if assertNotNil(ct, st) && assertNotNil(ct, st.LastNack) {
			assertEqual(ct, good.GetSystemVersionInfo(), st.AckedVersion)
			assertEqual(ct, bad.GetNonce(), st.LastNack.Nonce)
		}
	}, waitFor, 10*time.Millisecond)
	require.Equal(t, 1.0, counter(t, e, "isthmus_xds_nacks_total"))

	reg.SetWorkload(xdstest.Pod("c1", "net1", ns, "c", ip("10.0.0.3")))
	fixed := c.next()
	require.Equal(t, []string{"c1/default/c"}, names(fixed))
	c.apply(fixed)
	require.EventuallyWithT(t, func(ct *assertT) {
		st := typeStatus(e, "zt-1", xds.WorkloadType)
		if assertNotNil(ct, st) {
			assertEqual(ct, fixed.GetNonce(), st.AckedNonce)
		}
	}, waitFor, 10*time.Millisecond)
}

// TestClusterLocalService proves a cluster-local service is seen only by
// clients of its own cluster, and only with that cluster's endpoints.
func TestClusterLocalService(t *testing.T) {
	reg := xdstest.New()
	svc, ws := xdstest.Backing("kubernetes", "default", []model.Port{{Name: "https", Port: 443, TargetPort: 6443, Protocol: model.TCP}},
		map[model.ClusterID][]netip.Addr{"c1": {ip("10.96.0.1")}, "c2": {ip("10.97.0.1")}},
		xdstest.Pod("c1", "net1", "default", "api-1", ip("10.0.1.1")), xdstest.Pod("c2", "net1", "default", "api-2", ip("10.0.2.1")))
	svc.Scope = model.ScopeClusterLocal
	publish(reg, svc, ws)
	e := start(t, reg)
	cn := xds.ClusterName(svc.Hostname, 443)

	c := openSotw(t, dial(t, e.addr), node("envoy-c1", "net1", "c1"))
	c.send(&discovery.DiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNames: []string{cn}})
	clas := unpack[endpointv3.ClusterLoadAssignment](t, c.next(resource.EndpointType))
	require.Len(t, clas, 1)
	require.Len(t, clas[0].GetEndpoints(), 1)
	require.Len(t, clas[0].GetEndpoints()[0].GetLbEndpoints(), 1)
	require.Equal(t, "10.0.1.1", clas[0].GetEndpoints()[0].GetLbEndpoints()[0].GetEndpoint().GetAddress().GetSocketAddress().GetAddress())

	d := openDelta(t, dial(t, e.addr), wildcard(node("zt-c1", "net1", "c1")))
	r := d.next()
	d.apply(r)
	s := d.resources[xds.ServiceResourceName("default", svc.Hostname)].GetService()
	require.Len(t, s.GetAddresses(), 1)
	require.Equal(t, []byte(ip("10.96.0.1").AsSlice()), s.GetAddresses()[0].GetAddress())

	// The other cluster's API server pod (same network) is listed, but not
	// as an endpoint of c1's cluster-local service: a ztunnel of c1 must
	// never send kubernetes.default traffic to c2.
	svcName := xds.ServiceResourceName("default", svc.Hostname)
	require.Contains(t, d.resources["c1/default/api-1"].GetWorkload().GetServices(), svcName)
	require.Contains(t, d.state, "c2/default/api-2")
	require.NotContains(t, d.resources["c2/default/api-2"].GetWorkload().GetServices(), svcName)

	// A client of a cluster that does not define it does not see it.
	d3 := openDelta(t, dial(t, e.addr), wildcard(node("zt-c3", "net1", "c3")))
	r = d3.next()
	d3.apply(r)
	require.NotContains(t, d3.state, svcName)
	require.Empty(t, d3.resources["c1/default/api-1"].GetWorkload().GetServices())
}

// TestExportModeLocalShards proves a service that a cluster does not export
// (MCS export mode) keeps that cluster's endpoints to clients of that
// cluster, in EDS and in workload service bindings, and that exporting it
// later makes them visible without any workload change.
func TestExportModeLocalShards(t *testing.T) {
	reg := xdstest.New()
	svc, ws := xdstest.Backing("echo", ns, tcp80, nil,
		xdstest.Pod("c1", "net1", ns, "e1", ip("10.0.1.1")), xdstest.Pod("c2", "net1", ns, "e2", ip("10.0.2.1")))
	svc.LocalClusters = map[model.ClusterID]bool{"c2": true} // c2 does not export it
	publish(reg, svc, ws)
	e := start(t, reg)
	cn := xds.ClusterName(svc.Hostname, 80)
	svcName := xds.ServiceResourceName(ns, svc.Hostname)

	c := openSotw(t, dial(t, e.addr), node("envoy-c1", "net1", "c1"))
	c.send(&discovery.DiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNames: []string{cn}})
	clas := unpack[endpointv3.ClusterLoadAssignment](t, c.next(resource.EndpointType))
	require.Len(t, clas, 1)
	require.Len(t, clas[0].GetEndpoints()[0].GetLbEndpoints(), 1, "c2's endpoint stays in c2")

	d := openDelta(t, dial(t, e.addr), wildcard(node("zt-c1", "net1", "c1")))
	d.apply(d.next())
	require.Contains(t, d.resources["c1/default/e1"].GetWorkload().GetServices(), svcName)
	require.NotContains(t, d.resources["c2/default/e2"].GetWorkload().GetServices(), svcName)
	d2 := openDelta(t, dial(t, e.addr), wildcard(node("zt-c2", "net1", "c2")))
	d2.apply(d2.next())
	require.Contains(t, d2.resources["c2/default/e2"].GetWorkload().GetServices(), svcName)

	// c2 exports it: only the service changes, and c1's ztunnel now gets
	// e2 as an endpoint of it.
	exported := *svc
	exported.LocalClusters = nil
	reg.SetService(&exported)
	require.EventuallyWithT(t, func(ct *assertT) {
		select {
		case r := <-d.recv:
			d.apply(r)
		case <-time.After(10 * time.Millisecond):
		}
		assertNotNil(ct, d.resources["c2/default/e2"])
		_, ok := d.resources["c2/default/e2"].GetWorkload().GetServices()[svcName]
		assertEqual(ct, true, ok)
	}, waitFor, time.Millisecond)
}
