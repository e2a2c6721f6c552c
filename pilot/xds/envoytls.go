package xds

import (
	"fmt"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	matcherv3 "github.com/envoyproxy/go-control-plane/envoy/type/matcher/v3"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/isthmus-mesh/isthmus/internal/sni"
)

// Clients of the Envoy types (CDS/EDS/LDS/RDS) reach an endpoint of another
// network only through that network's east-west gateway, and only on a
// port they speak: never its HBONE port. Envoy sidecars speak mutual TLS
// with Istio's SNI (outbound_.<port>_._.<hostname>) to the gateway's SNI
// passthrough port (15443), which carries the TLS, unterminated, to a local
// endpoint; their TLS ends at the destination workload. A proxyless gRPC
// client is sent only the endpoints it can dial directly, on its own
// network: pilot cannot tell from its node whether its bootstrap has xDS
// security and its gRPC sets the SNI from xDS (grpc-go does only behind
// GRPC_EXPERIMENTAL_XDS_SNI), so the endpoints behind gateways are
// withheld from it and counted (isthmus_xds_endpoints_withheld_total),
// unless its node says it can (MetadataProxylessTLS): then every endpoint
// is reached over mTLS from its certificate provider, the remote ones
// through the gateways' passthrough ports with Istio's SNI.

// clientKind is what a client of the Envoy types can dial.
type clientKind uint8

const (
	// kindEnvoy: an Envoy sidecar (and any client not known to be
	// proxyless): mTLS with Istio's SNI to gateways' passthrough ports.
	kindEnvoy clientKind = iota
	// kindProxylessPlain: a proxyless gRPC client, sent only endpoints of
	// its own network.
	kindProxylessPlain
	// kindProxylessTLS: a proxyless gRPC client with xDS security whose
	// gRPC sets the SNI from xDS (MetadataProxylessTLS).
	kindProxylessTLS
)

// String names the kind in logs.
func (k clientKind) String() string {
	switch k {
	case kindProxylessPlain:
		return "proxyless"
	case kindProxylessTLS:
		return "proxyless-tls"
	}
	return "envoy"
}

// MetadataGenerator is Istio's node metadata key naming the generator a
// client wants; "grpc" is a proxyless gRPC client.
const MetadataGenerator = "GENERATOR"

// MetadataProxylessTLS, "true" in a proxyless gRPC client's node metadata,
// says the client can reach endpoints over mTLS with Istio's SNI: its
// bootstrap has the certificate provider instance "default" (its
// certificate and the mesh roots), it dials with xDS credentials, and its
// gRPC sets the TLS server name from xDS (gRFC A101; grpc-go:
// GRPC_EXPERIMENTAL_XDS_SNI=true). Every endpoint it is sent is then
// reached over mTLS, so its own network's servers must serve mTLS too.
const MetadataProxylessTLS = "ISTHMUS_PROXYLESS_TLS"

// Istio's certificate provider instance and certificate names for
// proxyless gRPC.
const (
	providerInstance = "default"
	providerRoots    = "ROOTCA"
)

// grpcUserAgentPrefix starts the node user_agent_name of gRPC's xDS
// clients ("gRPC Go", "gRPC C++", "gRPC Java").
const grpcUserAgentPrefix = "gRPC"

// kindOf returns the kind of client node n (as kept, keptNode) is.
func kindOf(n *corev3.Node) clientKind {
	f := n.GetMetadata().GetFields()
	if f[MetadataGenerator].GetStringValue() != "grpc" && !strings.HasPrefix(n.GetUserAgentName(), grpcUserAgentPrefix) {
		return kindEnvoy
	}
	if f[MetadataProxylessTLS].GetStringValue() == "true" {
		return kindProxylessTLS
	}
	return kindProxylessPlain
}

// Reasons endpoints behind a gateway are withheld from a client.
const (
	// WithheldNoTLS: the client cannot speak mTLS with Istio's SNI
	// (proxyless gRPC).
	WithheldNoTLS = "client_without_tls"
	// WithheldNoGatewayTLS: no trusted gateway of the endpoints' network
	// has an address and an SNI passthrough port.
	WithheldNoGatewayTLS = "no_gateway_tls_port"
)

// transportSocketMatchKey is Envoy's filter metadata namespace that
// transport socket matches read from an endpoint.
const transportSocketMatchKey = "envoy.transport_socket_match"

// tlsModeIstio is the endpoint metadata (and match) of Istio's mTLS.
func tlsModeIstio() *structpb.Struct {
	return &structpb.Struct{Fields: map[string]*structpb.Value{"tlsMode": structpb.NewStringValue("istio")}}
}

// Istio agent's SDS: its cluster name and its secrets' names.
const (
	sdsCluster     = "sds-grpc"
	sdsCertificate = "default"
	sdsRootCA      = "ROOTCA"
	tlsSocketName  = "envoy.transport_sockets.tls"
)

func sdsSource() *corev3.ConfigSource {
	return &corev3.ConfigSource{
		ResourceApiVersion: corev3.ApiVersion_V3,
		ConfigSourceSpecifier: &corev3.ConfigSource_ApiConfigSource{ApiConfigSource: &corev3.ApiConfigSource{
			ApiType:                   corev3.ApiConfigSource_GRPC,
			TransportApiVersion:       corev3.ApiVersion_V3,
			SetNodeOnFirstMessageOnly: true,
			GrpcServices: []*corev3.GrpcService{{TargetSpecifier: &corev3.GrpcService_EnvoyGrpc_{
				EnvoyGrpc: &corev3.GrpcService_EnvoyGrpc{ClusterName: sdsCluster}}}},
		}},
	}
}

// istioMTLS is the transport socket of Istio's sidecar mTLS to port of the
// service hostname through a gateway: its own certificate and roots from
// SDS (as Istio's agent serves them), Istio's SNI, and the peer verified
// as one of ids (the SPIFFE identities of the endpoints behind the
// gateway: the gateway itself never terminates the TLS).
func (b *envoyBuilder) istioMTLS(hostname string, port uint16, ids []string) (*corev3.TransportSocket, error) {
	sans := make([]*tlsv3.SubjectAltNameMatcher, 0, len(ids))
	for _, id := range ids {
		sans = append(sans, &tlsv3.SubjectAltNameMatcher{SanType: tlsv3.SubjectAltNameMatcher_URI,
			Matcher: &matcherv3.StringMatcher{MatchPattern: &matcherv3.StringMatcher_Exact{Exact: id}}})
	}
	ctx := &tlsv3.UpstreamTlsContext{
		Sni: sni.Outbound(hostname, port),
		CommonTlsContext: &tlsv3.CommonTlsContext{
			TlsParams:                      &tlsv3.TlsParameters{TlsMinimumProtocolVersion: tlsv3.TlsParameters_TLSv1_2},
			TlsCertificateSdsSecretConfigs: []*tlsv3.SdsSecretConfig{{Name: sdsCertificate, SdsConfig: b.sds}},
			ValidationContextType: &tlsv3.CommonTlsContext_CombinedValidationContext{CombinedValidationContext: &tlsv3.CommonTlsContext_CombinedCertificateValidationContext{
				DefaultValidationContext:         &tlsv3.CertificateValidationContext{MatchTypedSubjectAltNames: sans},
				ValidationContextSdsSecretConfig: &tlsv3.SdsSecretConfig{Name: sdsRootCA, SdsConfig: b.sds},
			}},
		},
	}
	a, err := anypb.New(ctx)
	if err != nil {
		return nil, fmt.Errorf("upstream tls context: %w", err)
	}
	return &corev3.TransportSocket{Name: tlsSocketName, ConfigType: &corev3.TransportSocket_TypedConfig{TypedConfig: a}}, nil
}

// proxylessMTLS is the transport socket of a proxyless gRPC client with xDS
// security to port of the service hostname: its certificate and the roots
// from its certificate provider instance "default", Istio's SNI, and the
// peer verified as one of ids (gRPC reads match_subject_alt_names).
func proxylessMTLS(hostname string, port uint16, ids []string) (*corev3.TransportSocket, error) {
	sans := make([]*matcherv3.StringMatcher, 0, len(ids))
	for _, id := range ids {
		sans = append(sans, &matcherv3.StringMatcher{MatchPattern: &matcherv3.StringMatcher_Exact{Exact: id}})
	}
	ctx := &tlsv3.UpstreamTlsContext{
		Sni: sni.Outbound(hostname, port),
		CommonTlsContext: &tlsv3.CommonTlsContext{
			TlsCertificateProviderInstance: &tlsv3.CertificateProviderPluginInstance{InstanceName: providerInstance, CertificateName: sdsCertificate},
			ValidationContextType: &tlsv3.CommonTlsContext_ValidationContext{ValidationContext: &tlsv3.CertificateValidationContext{
				CaCertificateProviderInstance: &tlsv3.CertificateProviderPluginInstance{InstanceName: providerInstance, CertificateName: providerRoots},
				MatchSubjectAltNames:          sans, //nolint:staticcheck // deprecated in Envoy, the field gRPC reads

			}},
		},
	}
	a, err := anypb.New(ctx)
	if err != nil {
		return nil, fmt.Errorf("upstream tls context: %w", err)
	}
	return &corev3.TransportSocket{Name: tlsSocketName, ConfigType: &corev3.TransportSocket_TypedConfig{TypedConfig: a}}, nil
}
