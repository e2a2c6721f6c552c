package xds_test

import (
	"encoding/json"
	"maps"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"slices"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/wrapperspb"
	"istio.io/api/security/v1beta1"
	securityclient "istio.io/client-go/pkg/apis/security/v1"
	"istio.io/istio/pkg/workloadapi"
	"istio.io/istio/pkg/workloadapi/security"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/internal/nodebind"
	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/xds"
	"github.com/isthmus-mesh/isthmus/pilot/xds/xdstest"
)

// Istio's type URLs, spelled out: the test pins what Istio's ztunnel
// subscribes to, not pilot's constants.
const (
	istioAddressURL = "type.googleapis.com/istio.workload.Address"
	istioAuthzURL   = "type.googleapis.com/istio.security.Authorization"
	// istioZtunnelID is the identity Istio's ztunnel presents: its
	// ServiceAccount's.
	istioZtunnelID = "spiffe://cluster.local/ns/istio-system/sa/ztunnel"
)

// istioClient is a delta ADS stream decoding every resource with Istio's
// own Go types, as Istio's ztunnel would.
type istioClient struct {
	*deltaClient
	addresses map[string]*workloadapi.Address
	authz     map[string]*security.Authorization
}

func openIstio(t *testing.T, e *authEnv, nodeName string, bind nodebind.Binding, typeURL string) *istioClient {
	t.Helper()
	cc := e.dialAs(t, e.ca, istioZtunnelID, bind)
	first := &discovery.DeltaDiscoveryRequest{Node: claims("ztunnel~"+nodeName, string(bind.Cluster), "", nodeName), TypeUrl: typeURL}
	return &istioClient{deltaClient: openDelta(t, cc, first), addresses: map[string]*workloadapi.Address{}, authz: map[string]*security.Authorization{}}
}

// step receives one response, decodes it into the client's state and ACKs
// it; it returns the response.
func (c *istioClient) step() *discovery.DeltaDiscoveryResponse {
	c.t.Helper()
	r := c.next()
	for _, res := range r.GetResources() {
		switch r.GetTypeUrl() {
		case istioAddressURL:
			a := &workloadapi.Address{}
			require.NoError(c.t, res.GetResource().UnmarshalTo(a), res.GetName())
			c.addresses[res.GetName()] = a
		case istioAuthzURL:
			a := &security.Authorization{}
			require.NoError(c.t, res.GetResource().UnmarshalTo(a), res.GetName())
			c.authz[res.GetName()] = a
		default:
			c.t.Fatalf("response of type %q", r.GetTypeUrl())
		}
	}
	for _, n := range r.GetRemovedResources() {
		delete(c.addresses, n)
		delete(c.authz, n)
	}
	require.NoError(c.t, c.stream.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: r.GetTypeUrl(), ResponseNonce: r.GetNonce()}))
	return r
}

func (c *istioClient) workload(t *testing.T, name string) *workloadapi.Workload {
	t.Helper()
	require.Contains(t, c.addresses, name)
	return c.addresses[name].GetWorkload()
}

// istioRegistry is two clusters on two networks, each with a trusted
// east-west gateway and an Istio ztunnel (istio-system/ztunnel,
// hostNetwork) on its node: service echo has a pod in each cluster,
// remote-only a pod in c2 only.
func istioRegistry() (*xdstest.Registry, []model.NetworkGateway) {
	reg := xdstest.New()
	gws := []model.NetworkGateway{
		{Network: "net1", Cluster: "c1", Address: ip("10.1.255.1"), HBONEPort: 15008, Source: "istio-system/eastwest", ServiceAccounts: []string{"eastwest"}},
		{Network: "net2", Cluster: "c2", Address: ip("10.2.255.1"), HBONEPort: 15009, Source: "istio-system/eastwest", ServiceAccounts: []string{"eastwest"}},
	}
	for _, g := range gws {
		reg.SetGateway(g)
	}
	local := xdstest.Pod("c1", "net1", ns, "local", ip("10.1.0.1"))
	local.Labels = map[string]string{"app": "echo"}
	local.Locality = model.Locality{Region: "r1", Zone: "z1"}
	remote := xdstest.Pod("c2", "net2", ns, "remote", ip("10.2.0.1"))
	remote.Labels = map[string]string{"app": "echo"}
	vips := map[model.ClusterID][]netip.Addr{"c1": {ip("10.96.0.10")}, "c2": {ip("10.97.0.10")}}
	svc, ws := xdstest.Backing("echo", ns, tcp80, vips, local, remote)
	publish(reg, svc, ws)
	only, ows := xdstest.Backing("remote-only", ns, tcp80, map[model.ClusterID][]netip.Addr{"c2": {ip("10.97.0.20")}},
		xdstest.Pod("c2", "net2", ns, "ro", ip("10.2.0.9")))
	publish(reg, only, ows)
	for _, cl := range []model.ClusterID{"c1", "c2"} {
		zt := xdstest.Pod(cl, model.Network("net"+string(cl[1:])), "istio-system", "ztunnel", ip("10."+string(cl[1:])+".9.1"))
		zt.ServiceAccount, zt.HostNetwork = "ztunnel", true
		reg.SetWorkload(zt)
	}
	return reg, gws
}

// istioPolicies are a namespace-wide ALLOW policy of namespace default
// (returned) and a DENY policy selecting app=echo.
func istioPolicies(t *testing.T) (*fakePolicies, *securityclient.AuthorizationPolicy) {
	allow := &securityclient.AuthorizationPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "allow-client"}}
	allow.Spec.Action = v1beta1.AuthorizationPolicy_ALLOW
	allow.Spec.Rules = []*v1beta1.Rule{{
		From: []*v1beta1.Rule_From{{Source: &v1beta1.Source{Principals: []string{"cluster.local/ns/default/sa/client"}, NotIpBlocks: []string{"10.9.0.0/16"}}}},
		To:   []*v1beta1.Rule_To{{Operation: &v1beta1.Operation{Ports: []string{"8080"}}}},
	}}
	return newFakePolicies(t, true, allow, authPolicy(ns, "sel", map[string]string{"app": "echo"})), allow
}

// Resource names of istioRegistry in Istio's type.
const (
	istioEchoKey   = "default/echo.default.svc.cluster.local"
	istioOnlyKey   = "default/remote-only.default.svc.cluster.local"
	istioSplitEcho = "net2/SplitHorizonWorkload/istio-system/eastwest/10.2.255.1/" + istioEchoKey
	istioSplitOnly = "net2/SplitHorizonWorkload/istio-system/eastwest/10.2.255.1/" + istioOnlyKey
	istioStrict    = "istio-system/istio_converted_static_strict"
)

// TestIstioWorkloadAPI: an Istio ztunnel, authenticated by its
// ServiceAccount's certificate, is served Istio's istio.workload.Address
// and istio.security.Authorization, decoded here with Istio's own Go types:
// every resource of a two-cluster, two-network registry, as the registry
// has it (pods in Istio's uid format, services by namespace/hostname, the
// other network's endpoints only through its gateway in network_gateway
// form), the converted policies of its node; updates and removals follow.
func TestIstioWorkloadAPI(t *testing.T) {
	reg, gws := istioRegistry()
	pols, allow := istioPolicies(t)
	e := startTLSWith(t, reg, xds.Config{NodeAccounts: []string{"istio-system/ztunnel"}, Policies: pols})
	bind := nodebind.Binding{Cluster: "c1", Node: "c1-node"}
	c := openIstio(t, e, "c1-node", bind, istioAddressURL)
	c.step()

	// (The hostNetwork ztunnel pods own no address: never served.)
	require.ElementsMatch(t, []string{"c1//Pod/default/local", istioEchoKey, istioOnlyKey, istioSplitEcho, istioSplitOnly},
		slices.Collect(maps.Keys(c.addresses)))
	requireIstioNetwork1(t, c, gws)
	requireIstioNetwork2(t, e)

	// Authorization, per node.
	a := openIstio(t, e, "c1-node", bind, istioAuthzURL)
	requireIstioAuthorizations(t, a)

	// Updates: the local pod turns unready.
	unready := *reg.Workload("c1/default/local")
	unready.Ready = false
	reg.SetWorkload(&unready)
	r := c.step()
	require.Equal(t, []string{"c1//Pod/default/local"}, names(r))
	require.Equal(t, workloadapi.WorkloadStatus_UNHEALTHY, c.workload(t, "c1//Pod/default/local").GetStatus())

	// The selector policy goes: removed from the node's Authorizations and
	// from the workload's list.
	pols.set(t, allow)
	pols.notify()
	r = a.step()
	require.Equal(t, []string{"default/sel"}, r.GetRemovedResources())
	r = c.step()
	require.Equal(t, []string{"c1//Pod/default/local"}, names(r))
	require.Equal(t, []string{istioStrict}, c.workload(t, "c1//Pod/default/local").GetAuthorizationPolicies())

	// A mesh-wide policy arrives, GLOBAL.
	pols.set(t, allow, authPolicy(rootNS, "mesh-deny", nil))
	pols.notify()
	r = a.step()
	require.Equal(t, []string{"istio-system/mesh-deny"}, names(r))
	require.Equal(t, security.Scope_GLOBAL, a.authz["istio-system/mesh-deny"].GetScope())

	// The local pod goes: its Address is removed, and its node keeps only
	// the mesh-wide policy.
	reg.RemoveWorkload("c1/default/local")
	r = c.step()
	require.Equal(t, []string{"c1//Pod/default/local"}, r.GetRemovedResources())
	r = a.step()
	require.ElementsMatch(t, []string{"default/allow-client", istioStrict}, r.GetRemovedResources())
	require.Equal(t, []string{"istio-system/mesh-deny"}, slices.Collect(maps.Keys(a.authz)))
}

// requireIstioNetwork1 checks what the network-1 Istio ztunnel of
// TestIstioWorkloadAPI holds first.
func requireIstioNetwork1(t *testing.T, c *istioClient, gws []model.NetworkGateway) {
	t.Helper()
	equalProto(t, &workloadapi.Workload{
		Uid: "c1//Pod/default/local", Name: "local", Namespace: ns, Addresses: [][]byte{ip("10.1.0.1").AsSlice()},
		Network: "net1", ClusterId: "c1", Node: "c1-node", TrustDomain: "cluster.local", ServiceAccount: "default",
		TunnelProtocol: workloadapi.TunnelProtocol_HBONE, WorkloadType: workloadapi.WorkloadType_POD,
		WorkloadName: "local", CanonicalName: "echo", CanonicalRevision: "latest",
		Locality: &workloadapi.Locality{Region: "r1", Zone: "z1"},
		Services: map[string]*workloadapi.PortList{istioEchoKey: {Ports: []*workloadapi.Port{{ServicePort: 80, TargetPort: 8080}}}},
		// The selector policy that selects it, and STRICT (the default).
		AuthorizationPolicies: []string{"default/sel", istioStrict},
	}, c.workload(t, "c1//Pod/default/local"))

	equalProto(t, &workloadapi.Service{
		Name: "echo", Namespace: ns, Hostname: "echo.default.svc.cluster.local",
		Addresses: []*workloadapi.NetworkAddress{
			{Network: "net1", Address: ip("10.96.0.10").AsSlice()},
			{Network: "net2", Address: ip("10.97.0.10").AsSlice()},
		},
		Ports: []*workloadapi.Port{{ServicePort: 80, TargetPort: 8080}},
	}, c.addresses[istioEchoKey].GetService())
	require.Equal(t, []*workloadapi.NetworkAddress{{Network: "net2", Address: ip("10.97.0.20").AsSlice()}},
		c.addresses[istioOnlyKey].GetService().GetAddresses(), "a service of the remote cluster only")

	for key, split := range map[string]string{istioEchoKey: istioSplitEcho, istioOnlyKey: istioSplitOnly} {
		equalProto(t, &workloadapi.Workload{
			Uid: split, Name: split, Namespace: ns, Network: "net2", ClusterId: "c2", TrustDomain: "cluster.local",
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE, WorkloadType: workloadapi.WorkloadType_POD,
			Capacity: wrapperspb.UInt32(1),
			NetworkGateway: &workloadapi.GatewayAddress{
				Destination:   &workloadapi.GatewayAddress_Address{Address: &workloadapi.NetworkAddress{Network: "net2", Address: gws[1].Address.AsSlice()}},
				HboneMtlsPort: 15009,
			},
			Services: map[string]*workloadapi.PortList{key: {Ports: []*workloadapi.Port{{ServicePort: 80, TargetPort: 80}}}},
		}, c.workload(t, split))
	}
}

// requireIstioNetwork2 checks what a network-2 Istio ztunnel holds: that
// network's pods of the remote cluster with their addresses, and network 1
// through its gateway.
func requireIstioNetwork2(t *testing.T, e *authEnv) {
	t.Helper()
	c2 := openIstio(t, e, "c2-node", nodebind.Binding{Cluster: "c2", Node: "c2-node"}, istioAddressURL)
	c2.step()
	require.ElementsMatch(t, []string{"c2//Pod/default/remote", "c2//Pod/default/ro", istioEchoKey, istioOnlyKey,
		"net1/SplitHorizonWorkload/istio-system/eastwest/10.1.255.1/" + istioEchoKey}, slices.Collect(maps.Keys(c2.addresses)))
	remote := c2.workload(t, "c2//Pod/default/remote")
	require.Equal(t, [][]byte{ip("10.2.0.1").AsSlice()}, remote.GetAddresses())
	require.Equal(t, "c2", remote.GetClusterId())
	require.Equal(t, "net2", remote.GetNetwork())
	require.Equal(t, []string{"default/sel", istioStrict}, remote.GetAuthorizationPolicies(), "default/sel selects it too")
	require.Equal(t, uint32(15008), c2.workload(t, "net1/SplitHorizonWorkload/istio-system/eastwest/10.1.255.1/"+istioEchoKey).GetNetworkGateway().GetHboneMtlsPort())
}

// requireIstioAuthorizations checks the Authorizations of node c1-node:
// the namespace policy and the selector policy of its workload, and
// Istio's static STRICT policy.
func requireIstioAuthorizations(t *testing.T, a *istioClient) {
	t.Helper()
	a.step()
	require.ElementsMatch(t, []string{"default/allow-client", "default/sel", istioStrict}, slices.Collect(maps.Keys(a.authz)))
	presence := &security.StringMatch{MatchType: &security.StringMatch_Presence{Presence: &emptypb.Empty{}}}
	equalProto(t, &security.Authorization{
		Name: "allow-client", Namespace: ns, Scope: security.Scope_NAMESPACE, Action: security.Action_ALLOW,
		Groups: []*security.Group{{Rules: []*security.Rules{
			{Matches: []*security.Match{{
				Principals:   []*security.StringMatch{{MatchType: &security.StringMatch_Exact{Exact: "cluster.local/ns/default/sa/client"}}},
				NotSourceIps: []*security.Address{{Address: ip("10.9.0.0").AsSlice(), Length: 16}},
			}}},
			{Matches: []*security.Match{{DestinationPorts: []uint32{8080}}}},
		}}},
	}, a.authz["default/allow-client"])
	equalProto(t, &security.Authorization{
		Name: "sel", Namespace: ns, Scope: security.Scope_WORKLOAD_SELECTOR, Action: security.Action_DENY,
		Groups: []*security.Group{{}},
	}, a.authz["default/sel"])
	equalProto(t, &security.Authorization{
		Name: "istio_converted_static_strict", Namespace: rootNS, Scope: security.Scope_WORKLOAD_SELECTOR, Action: security.Action_DENY,
		Groups: []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{{NotPrincipals: []*security.StringMatch{presence}}}}}}},
	}, a.authz[istioStrict])
}

// TestIstioTypeEncodedOnDemand: a class encodes Istio's type only once an
// Istio ztunnel of it asks, and Isthmus's only once an Isthmus ztunnel
// does; a change reaches both encodings of a class that serves both.
func TestIstioTypeEncodedOnDemand(t *testing.T) {
	reg := xdstest.New()
	svc, ws := xdstest.Backing("echo", ns, tcp80, nil, xdstest.Pod("c1", "net1", ns, "a", ip("10.1.0.1")), xdstest.Pod("c2", "net1", ns, "b", ip("10.1.0.2")))
	publish(reg, svc, ws)
	e := start(t, reg)
	dump := func(id string) map[string]map[string]json.RawMessage {
		rec := httptest.NewRecorder()
		e.srv.DebugHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/debug/config_dump?proxy="+id, nil))
		require.Equal(t, http.StatusOK, rec.Code, rec.Body.String())
		var d struct {
			Resources map[string]map[string]json.RawMessage `json:"resources"`
		}
		require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &d))
		return d.Resources
	}

	own := openDelta(t, dial(t, e.addr), wildcard(node("zt-own", "net1", "c1")))
	own.apply(own.next())
	d := dump("zt-own")
	require.Contains(t, d[xds.WorkloadType], "c1/default/a")
	require.Empty(t, d[istioAddressURL], "no Istio client in the class yet")

	istio := &istioClient{deltaClient: openDelta(t, dial(t, e.addr), &discovery.DeltaDiscoveryRequest{Node: node("zt-istio", "net1", "c1"), TypeUrl: istioAddressURL}),
		addresses: map[string]*workloadapi.Address{}}
	istio.step()
	require.ElementsMatch(t, []string{"c1//Pod/default/a", "c2//Pod/default/b", ns + "/echo.default.svc.cluster.local"}, slices.Collect(maps.Keys(istio.addresses)))
	d = dump("zt-istio")
	require.Len(t, d[xds.WorkloadType], 3)
	require.Len(t, d[istioAddressURL], 3)

	// Another class with Istio ztunnels only holds Istio's encoding only.
	other := &istioClient{deltaClient: openDelta(t, dial(t, e.addr), &discovery.DeltaDiscoveryRequest{Node: node("zt-istio-2", "net1", "c2"), TypeUrl: istioAddressURL}),
		addresses: map[string]*workloadapi.Address{}}
	other.step()
	d = dump("zt-istio-2")
	require.Empty(t, d[xds.WorkloadType])
	require.Len(t, d[istioAddressURL], 3)

	// A change reaches both encodings.
	moved := *reg.Workload("c1/default/a")
	moved.Addresses = []netip.Addr{ip("10.1.0.9")}
	reg.SetWorkload(&moved)
	r := own.next()
	require.Equal(t, []string{"c1/default/a"}, names(r))
	r = istio.step()
	require.Equal(t, []string{"c1//Pod/default/a"}, names(r))
	require.Equal(t, [][]byte{ip("10.1.0.9").AsSlice()}, istio.workload(t, "c1//Pod/default/a").GetAddresses())
}

// TestIstioAuthorizationOnlyForNodeProxies: Istio's authorization type is
// refused, as Isthmus's is, to a stream that is not a verified node proxy.
func TestIstioAuthorizationOnlyForNodeProxies(t *testing.T) {
	reg, _ := istioRegistry()
	e := startTLSWith(t, reg, xds.Config{NodeAccounts: []string{"istio-system/ztunnel"}})
	workload := e.dialAs(t, e.ca, clientID)
	msg := refusedWith(t, workload, &discovery.DeltaDiscoveryRequest{Node: claims("w", "c1", "", ""), TypeUrl: istioAuthzURL}, codes.PermissionDenied)
	require.Contains(t, msg, istioAuthzURL)
	// Nor is Isthmus's ztunnel account when pilot is configured with
	// Istio's only: it is then a workload identity that runs nowhere.
	isthmus := e.dialAs(t, e.ca, ztunnelID, nodebind.Binding{Cluster: "c1", Node: "c1-node"})
	refusedWith(t, isthmus, &discovery.DeltaDiscoveryRequest{Node: claims("z", "c1", "", "c1-node"), TypeUrl: istioAuthzURL}, codes.PermissionDenied)
}

func TestIstioWorkloadUID(t *testing.T) {
	for in, want := range map[string]string{
		"c1/default/echo-7d9f":                          "c1//Pod/default/echo-7d9f",
		"c1/default/endpointslice.db.10.0.0.7":          "c1/discovery.k8s.io/EndpointSlice/default/db/10.0.0.7",
		"c1/default/endpointslice.db.fd00::7":           "c1/discovery.k8s.io/EndpointSlice/default/db/fd00::7",
		model.WorkloadUID("c-2", "ns", "pod.with.dots"): "c-2//Pod/ns/pod.with.dots",
		"not-a-uid": "not-a-uid",
	} {
		require.Equal(t, want, xds.IstioWorkloadUID(in), in)
	}
}

// TestIstioEnumsAligned pins what the encoder relies on: Isthmus's enums
// number their values as Istio's do.
func TestIstioEnumsAligned(t *testing.T) {
	same := func(isthmus, istio map[int32]string, rename map[string]string) {
		t.Helper()
		for n, name := range isthmus {
			if r, ok := rename[name]; ok {
				name = r
			}
			require.Equal(t, name, istio[n], "value %d", n)
		}
	}
	same(workloadv1.LoadBalancing_Scope_name, workloadapi.LoadBalancing_Scope_name, map[string]string{"SCOPE_UNSPECIFIED": "UNSPECIFIED_SCOPE"})
	same(workloadv1.LoadBalancing_Mode_name, workloadapi.LoadBalancing_Mode_name, nil)
	same(workloadv1.TunnelProtocol_name, workloadapi.TunnelProtocol_name, nil)
	same(workloadv1.WorkloadStatus_name, workloadapi.WorkloadStatus_name, nil)
}

// TestIstioAddressesWaitForPolicies: Istio's ztunnel enforces only the
// policies its workloads name, so no workload is sent before the policies
// are read: then every one names its own.
func TestIstioAddressesWaitForPolicies(t *testing.T) {
	reg, _ := istioRegistry()
	pols, _ := istioPolicies(t)
	pols.synced.Store(false)
	e := startTLSWith(t, reg, xds.Config{NodeAccounts: []string{"istio-system/ztunnel"}, Policies: pols})
	c := openIstio(t, e, "c1-node", nodebind.Binding{Cluster: "c1", Node: "c1-node"}, istioAddressURL)
	c.quiet(300 * time.Millisecond)
	// Isthmus's own type is answered meanwhile (its ztunnel fails closed
	// on a workload whose binding it does not hold yet).
	own := openDelta(t, e.dialAs(t, e.ca, istioZtunnelID, nodebind.Binding{Cluster: "c1", Node: "c1-node"}),
		&discovery.DeltaDiscoveryRequest{Node: claims("own", "c1", "", "c1-node"), TypeUrl: xds.WorkloadType})
	own.apply(own.next())

	pols.synced.Store(true)
	pols.notify()
	c.step()
	require.Equal(t, []string{"default/sel", "istio-system/istio_converted_static_strict"}, c.workload(t, "c1//Pod/default/local").GetAuthorizationPolicies())
}

// TestIstioSplitHorizonGatewayForms: a gateway known by hostname is sent in
// Istio's NamespacedHostname form; of several trusted gateways, Istio's one
// network_gateway is the first by key (Isthmus's type lists them all), and
// a tenant's candidate is never used.
func TestIstioSplitHorizonGatewayForms(t *testing.T) {
	reg := xdstest.New()
	for _, g := range []model.NetworkGateway{
		{Network: "net2", Cluster: "c2", Hostname: "gw.example.com", HBONEPort: 15443, Source: "istio-system/eastwest-b"},
		{Network: "net2", Cluster: "c2", Address: ip("10.2.255.1"), Source: "istio-system/eastwest-c"},
		{Network: "net2", Cluster: "c2", Address: ip("10.2.255.66"), Source: "aaa/evil", Ignored: model.GatewayIgnoredUntrustedNamespace},
	} {
		reg.SetGateway(g)
	}
	svc, ws := xdstest.Backing("echo", ns, tcp80, nil, xdstest.Pod("c2", "net2", ns, "r", ip("10.2.0.1")))
	publish(reg, svc, ws)
	e := start(t, reg)
	c := &istioClient{deltaClient: openDelta(t, dial(t, e.addr), &discovery.DeltaDiscoveryRequest{Node: node("zt", "net1", "c1"), TypeUrl: istioAddressURL}),
		addresses: map[string]*workloadapi.Address{}}
	c.step()
	split := "net2/SplitHorizonWorkload/istio-system/eastwest-b/gw.example.com/" + istioEchoKey
	require.ElementsMatch(t, []string{istioEchoKey, split}, slices.Collect(maps.Keys(c.addresses)))
	equalProto(t, &workloadapi.GatewayAddress{
		Destination:   &workloadapi.GatewayAddress_Hostname{Hostname: &workloadapi.NamespacedHostname{Namespace: "istio-system", Hostname: "gw.example.com"}},
		HboneMtlsPort: 15443,
	}, c.workload(t, split).GetNetworkGateway())

	// The hostname gateway goes: the split workload is renamed for the
	// next gateway (its port defaulting to 15008).
	reg.Update(func(tx *xdstest.Tx) {
		tx.RemoveGateway(model.NetworkGateway{Network: "net2", Cluster: "c2", Hostname: "gw.example.com", HBONEPort: 15443, Source: "istio-system/eastwest-b"})
	})
	r := c.step()
	next := "net2/SplitHorizonWorkload/istio-system/eastwest-c/10.2.255.1/" + istioEchoKey
	require.Equal(t, []string{split}, r.GetRemovedResources())
	require.Equal(t, []string{next}, names(r))
	equalProto(t, &workloadapi.GatewayAddress{
		Destination:   &workloadapi.GatewayAddress_Address{Address: &workloadapi.NetworkAddress{Network: "net2", Address: ip("10.2.255.1").AsSlice()}},
		HboneMtlsPort: 15008,
	}, c.workload(t, next).GetNetworkGateway())
}
