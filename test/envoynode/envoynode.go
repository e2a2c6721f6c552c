// Package envoynode builds the Node a real Istio sidecar's Envoy sends in
// its first xDS request: its user agent and build, the extensions compiled
// into it (node.extensions, most of the node's 25 KB), its client features
// and Istio's metadata. Tests and benchmarks use it where the size of a
// real client's node matters.
package envoynode

import (
	"fmt"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// Extension categories of an Envoy build, with how many extensions of each
// it lists (an Envoy 1.3x build lists over 200).
var categories = []struct {
	name string
	n    int
}{
	{"envoy.filters.http", 42}, {"envoy.filters.network", 22}, {"envoy.filters.listener", 6},
	{"envoy.access_loggers", 8}, {"envoy.clusters", 10}, {"envoy.transport_sockets.upstream", 12},
	{"envoy.transport_sockets.downstream", 10}, {"envoy.tracers", 8}, {"envoy.stats_sinks", 8},
	{"envoy.resolvers", 4}, {"envoy.health_checkers", 6}, {"envoy.retry_priorities", 3},
	{"envoy.matching.input_matchers", 8}, {"envoy.matching.http.input", 12}, {"envoy.formatter", 6},
	{"envoy.rbac.matchers", 4}, {"envoy.upstreams", 6}, {"envoy.load_balancing_policies", 10},
	{"envoy.http.stateful_session", 4}, {"envoy.bootstrap", 8}, {"envoy.quic.connection_id_generator", 3},
	{"envoy.tls.cert_validator", 3}, {"envoy.compression.compressor", 4}, {"envoy.wasm.runtime", 4},
	{"envoy.path.match", 3}, {"envoy.regex_engines", 2}, {"network.connection.client", 3},
	{"envoy.common.key_value", 2}, {"envoy.http.original_ip_detection", 3}, {"envoy.rate_limit_descriptors", 2},
}

// Sidecar returns the node of sidecar id, with metadata (pilot's keys:
// CLUSTER_ID, NETWORK...) added to Istio's usual metadata.
func Sidecar(id string, metadata map[string]string) *corev3.Node {
	n := &corev3.Node{
		Id:      id,
		Cluster: "echo.default",
		UserAgentVersionType: &corev3.Node_UserAgentBuildVersion{UserAgentBuildVersion: &corev3.BuildVersion{
			Metadata: mustStruct(map[string]any{"revision.sha": "0123456789abcdef0123456789abcdef01234567", "revision.status": "Clean", "build.type": "RELEASE", "ssl.version": "BoringSSL"}),
		}},
		UserAgentName:  "envoy",
		ClientFeatures: []string{"envoy.config.require-any-fields-contain-struct", "envoy.lb.does_not_support_overprovisioning", "envoy.lrs.supports_send_all_clusters"},
		Locality:       &corev3.Locality{Region: "region-1", Zone: "zone-a"},
	}
	for _, c := range categories {
		for i := range c.n {
			n.Extensions = append(n.Extensions, &corev3.Extension{
				Name:     fmt.Sprintf("%s.extension_%02d", c.name, i),
				Category: c.name,
				TypeUrls: []string{fmt.Sprintf("envoy.extensions.%s.v3.Config%02d", c.name[len("envoy."):], i)},
			})
		}
	}
	md := map[string]any{
		"ISTIO_VERSION": "1.28.0", "MESH_ID": "cluster.local", "NAMESPACE": "default", "NAME": id,
		"WORKLOAD_NAME": "echo", "SERVICE_ACCOUNT": "echo", "INTERCEPTION_MODE": "REDIRECT",
		"OWNER":          "kubernetes://apis/apps/v1/namespaces/default/deployments/echo",
		"LABELS":         map[string]any{"app": "echo", "version": "v1", "pod-template-hash": "5d8f7c9b6d", "security.istio.io/tlsMode": "istio", "service.istio.io/canonical-name": "echo", "service.istio.io/canonical-revision": "v1"},
		"ANNOTATIONS":    map[string]any{"kubectl.kubernetes.io/default-container": "echo", "sidecar.istio.io/status": `{"initContainers":["istio-init"],"containers":["istio-proxy"],"volumes":["workload-socket","credential-socket","workload-certs","istio-envoy","istio-data","istio-podinfo","istio-token","istiod-ca-cert"],"imagePullSecrets":null,"revision":"default"}`, "prometheus.io/path": "/stats/prometheus", "prometheus.io/port": "15020", "prometheus.io/scrape": "true"},
		"APP_CONTAINERS": "echo", "INSTANCE_IPS": "10.244.1.17,fd00:10:244:1::11", "POD_PORTS": `[{"name":"http","containerPort":8080,"protocol":"TCP"},{"name":"grpc","containerPort":7070,"protocol":"TCP"}]`,
		"PROXY_CONFIG":      map[string]any{"binaryPath": "/usr/local/bin/envoy", "concurrency": 2, "configPath": "./etc/istio/proxy", "controlPlaneAuthPolicy": "MUTUAL_TLS", "discoveryAddress": "istiod.istio-system.svc:15012", "drainDuration": "45s", "proxyAdminPort": 15000, "serviceCluster": "istio-proxy", "statNameLength": 189, "statusPort": 15020, "terminationDrainDuration": "5s", "tracing": map[string]any{"zipkin": map[string]any{"address": "zipkin.istio-system:9411"}}},
		"PLATFORM_METADATA": map[string]any{}, "ISTIO_PROXY_SHA": "0123456789abcdef0123456789abcdef01234567",
		"ENVOY_STATUS_PORT": 15021, "ENVOY_PROMETHEUS_PORT": 15090,
	}
	for k, v := range metadata {
		md[k] = v
	}
	n.Metadata = mustStruct(md)
	return n
}

func mustStruct(m map[string]any) *structpb.Struct {
	s, err := structpb.NewStruct(m)
	if err != nil {
		panic(err) // the maps above hold only JSON values
	}
	return s
}
