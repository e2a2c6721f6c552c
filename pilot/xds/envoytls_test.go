package xds_test

import (
	"strconv"
	"testing"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	rawbufferv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/raw_buffer/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/isthmus-mesh/isthmus/internal/promread"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/xds"
	"github.com/isthmus-mesh/isthmus/pilot/xds/xdstest"
)

// requireIstioMTLS checks that cl sends the endpoints marked tlsMode=istio
// over Istio's sidecar mTLS (SDS certificate "default" and roots "ROOTCA",
// server name sni, peer one of sans) and the rest in plaintext, and that
// each transport socket's typed config passes Envoy's validation.
func requireIstioMTLS(t *testing.T, cl *clusterv3.Cluster, sni string, sans ...string) {
	t.Helper()
	require.Nil(t, cl.GetTransportSocket())
	ms := cl.GetTransportSocketMatches()
	require.Len(t, ms, 2)
	require.Equal(t, "istio", ms[0].GetMatch().GetFields()["tlsMode"].GetStringValue())
	require.Equal(t, "envoy.transport_sockets.tls", ms[0].GetTransportSocket().GetName())
	tc := &tlsv3.UpstreamTlsContext{}
	require.NoError(t, ms[0].GetTransportSocket().GetTypedConfig().UnmarshalTo(tc))
	require.NoError(t, tc.ValidateAll())
	require.Equal(t, sni, tc.GetSni())
	common := tc.GetCommonTlsContext()
	require.Equal(t, "default", common.GetTlsCertificateSdsSecretConfigs()[0].GetName())
	cvc := common.GetCombinedValidationContext()
	require.Equal(t, "ROOTCA", cvc.GetValidationContextSdsSecretConfig().GetName())
	var got []string
	for _, m := range cvc.GetDefaultValidationContext().GetMatchTypedSubjectAltNames() {
		require.Equal(t, tlsv3.SubjectAltNameMatcher_URI, m.GetSanType())
		got = append(got, m.GetMatcher().GetExact())
	}
	require.Equal(t, sans, got)
	require.Empty(t, ms[1].GetMatch().GetFields(), "the rest: plaintext")
	raw := &rawbufferv3.RawBuffer{}
	require.NoError(t, ms[1].GetTransportSocket().GetTypedConfig().UnmarshalTo(raw))
	require.NoError(t, raw.ValidateAll())
}

// edsOf fetches, over SotW, the cluster and load assignment of echo:80 a
// client with node n gets, both validated.
func edsOf(t *testing.T, e *env, n *corev3.Node) (*clusterv3.Cluster, *endpointv3.ClusterLoadAssignment) {
	t.Helper()
	c := openSotw(t, dial(t, e.addr), n)
	cn := xds.ClusterName(echoHost, 80)
	c.send(&discovery.DiscoveryRequest{TypeUrl: resource.ClusterType})
	r := c.next(resource.ClusterType)
	clusters := unpack[clusterv3.Cluster](t, r)
	require.Len(t, clusters, 1)
	require.NoError(t, clusters[0].ValidateAll())
	c.ack(r)
	c.send(&discovery.DiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNames: []string{cn}})
	r = c.next(resource.EndpointType)
	clas := unpack[endpointv3.ClusterLoadAssignment](t, r)
	require.Len(t, clas, 1)
	require.NoError(t, clas[0].ValidateAll())
	return clusters[0], clas[0]
}

// endpointAddrs lists a load assignment's endpoints as address:port.
func endpointAddrs(cla *endpointv3.ClusterLoadAssignment) []string {
	var out []string
	for _, le := range cla.GetEndpoints() {
		for _, lb := range le.GetLbEndpoints() {
			sa := lb.GetEndpoint().GetAddress().GetSocketAddress()
			out = append(out, sa.GetAddress()+":"+strconv.Itoa(int(sa.GetPortValue())))
		}
	}
	return out
}

func withheld(t *testing.T, e *env, reason string) float64 {
	t.Helper()
	v, err := promread.Value(e.metrics, "isthmus_xds_endpoints_withheld_total", map[string]string{"reason": reason})
	require.NoError(t, err)
	return v
}

// TestProxylessGetsOnlyReachableEndpoints: a proxyless gRPC client (known
// by Istio's GENERATOR=grpc metadata or by gRPC's user agent name) cannot
// speak HBONE nor, as far as pilot can tell, mTLS with Istio's SNI: it is
// sent only the endpoints of its own network, a cluster without a
// transport socket, and pilot counts the endpoints it withheld, by reason.
func TestProxylessGetsOnlyReachableEndpoints(t *testing.T) {
	for name, n := range map[string]*corev3.Node{
		"generator": func() *corev3.Node {
			n := node("grpc-1", "net1", "c1")
			n.Metadata.Fields[xds.MetadataGenerator] = structpb.NewStringValue("grpc")
			return n
		}(),
		"user agent": func() *corev3.Node {
			n := node("grpc-2", "net1", "c1")
			n.UserAgentName = "gRPC Go"
			return n
		}(),
	} {
		t.Run(name, func(t *testing.T) {
			reg := xdstest.New()
			twoNetworks(reg)
			e := start(t, reg)
			cl, cla := edsOf(t, e, n)
			require.Nil(t, cl.GetTransportSocket())
			require.Empty(t, cl.GetTransportSocketMatches())
			require.ElementsMatch(t, []string{"10.1.0.1:8080", "10.1.0.2:8080"}, endpointAddrs(cla))
			require.GreaterOrEqual(t, withheld(t, e, xds.WithheldNoTLS), 2.0, "the two endpoints behind net2's gateway")

			// An Envoy of the same network and cluster still gets them.
			_, cla = edsOf(t, e, node("envoy-1", "net1", "c1"))
			require.ElementsMatch(t, []string{"10.1.0.1:8080", "10.1.0.2:8080", "10.2.255.1:15443"}, endpointAddrs(cla))
		})
	}
}

// TestEnvoyNeverGetsHBONEPort: a gateway without an SNI passthrough port
// (only HBONE) is no way for an Envoy client: its network's endpoints are
// withheld and counted, and no endpoint is the HBONE port.
func TestEnvoyNeverGetsHBONEPort(t *testing.T) {
	reg := xdstest.New()
	twoNetworks(reg)
	reg.SetGateway(model.NetworkGateway{Network: "net2", Cluster: "c2", Address: ip("10.2.255.1"), HBONEPort: 15008,
		Source: "istio-system/eastwest", ServiceAccounts: []string{"eastwest"}})
	e := start(t, reg)
	cl, cla := edsOf(t, e, node("envoy-1", "net1", "c1"))
	require.ElementsMatch(t, []string{"10.1.0.1:8080", "10.1.0.2:8080"}, endpointAddrs(cla))
	require.Empty(t, cl.GetTransportSocketMatches(), "no endpoint needs mTLS")
	require.GreaterOrEqual(t, withheld(t, e, xds.WithheldNoGatewayTLS), 2.0)
}

// TestProxylessTLSResources: a proxyless gRPC client whose node says it has
// xDS security and sets the SNI from xDS (ISTHMUS_PROXYLESS_TLS) is sent the
// remote network as its gateway's 15443 and a Cluster whose transport
// socket gRPC accepts: an UpstreamTlsContext with Istio's SNI, its
// certificate and roots from the certificate provider instance "default",
// and every endpoint's identity as the SANs to match (gRPC has no
// transport socket matches: every endpoint is reached over mTLS).
func TestProxylessTLSResources(t *testing.T) {
	reg := xdstest.New()
	twoNetworks(reg)
	e := start(t, reg)
	n := node("grpc-tls", "net1", "c1")
	n.Metadata.Fields[xds.MetadataGenerator] = structpb.NewStringValue("grpc")
	n.Metadata.Fields[xds.MetadataProxylessTLS] = structpb.NewStringValue("true")
	cl, cla := edsOf(t, e, n)
	require.ElementsMatch(t, []string{"10.1.0.1:8080", "10.1.0.2:8080", "10.2.255.1:15443"}, endpointAddrs(cla))
	require.Empty(t, cl.GetTransportSocketMatches(), "gRPC refuses transport socket matches")
	ts := cl.GetTransportSocket()
	require.Equal(t, "envoy.transport_sockets.tls", ts.GetName())
	tc := &tlsv3.UpstreamTlsContext{}
	require.NoError(t, ts.GetTypedConfig().UnmarshalTo(tc))
	require.NoError(t, tc.ValidateAll())
	require.Equal(t, "outbound_.80_._."+echoHost, tc.GetSni())
	common := tc.GetCommonTlsContext()
	require.Equal(t, "default", common.GetTlsCertificateProviderInstance().GetInstanceName())
	vc := common.GetValidationContext()
	require.Equal(t, "default", vc.GetCaCertificateProviderInstance().GetInstanceName())
	var sans []string
	for _, m := range vc.GetMatchSubjectAltNames() { //nolint:staticcheck // the field gRPC reads
		sans = append(sans, m.GetExact())
	}
	require.Equal(t, []string{"spiffe://cluster.local/ns/default/sa/default"}, sans)
	require.Zero(t, withheld(t, e, xds.WithheldNoTLS), "nothing is withheld from it")
}
