package server_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"net/http"
	"os"
	"regexp"
	"sort"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/structpb"
	pb "istio.io/api/security/v1alpha1"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/pilot/ca"
	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/pilot/xds"
)

// dashboardFile is the Grafana dashboard the pilot chart ships.
const dashboardFile = "../../manifests/pilot/dashboards/pilot.json"

// grafanaVariable matches Grafana's $__interval-like variables, which
// PromQL cannot parse.
var grafanaVariable = regexp.MustCompile(`\$__[a-z_]+|\$\{__[a-z_]+\}`)

// dashboardMetrics parses every query of the dashboard with Prometheus's
// own PromQL parser and returns the metric names they select, by query.
func dashboardMetrics(t *testing.T) map[string][]string {
	t.Helper()
	raw, err := os.ReadFile(dashboardFile)
	require.NoError(t, err)
	var dash struct {
		Panels []struct {
			Title   string
			Type    string
			Targets []struct{ Expr string }
		}
	}
	require.NoError(t, json.Unmarshal(raw, &dash))
	promql := parser.NewParser(parser.Options{})
	out := map[string][]string{}
	for _, p := range dash.Panels {
		if p.Type == "row" {
			continue
		}
		require.NotEmpty(t, p.Targets, "panel %q has no query", p.Title)
		for _, tg := range p.Targets {
			expr, err := promql.ParseExpr(grafanaVariable.ReplaceAllString(tg.Expr, "5m"))
			require.NoError(t, err, "panel %q: %s", p.Title, tg.Expr)
			var names []string
			parser.Inspect(expr, func(n parser.Node, _ []parser.Node) error {
				if vs, ok := n.(*parser.VectorSelector); ok {
					require.NotEmpty(t, vs.Name, "panel %q: a selector without a metric name: %s", p.Title, tg.Expr)
					names = append(names, vs.Name)
				}
				return nil
			})
			require.NotEmpty(t, names, "panel %q: %s selects no metric", p.Title, tg.Expr)
			out[p.Title+": "+tg.Expr] = names
		}
	}
	return out
}

// seriesNames scrapes url and returns every series name it exposes
// (histograms as their _bucket, _sum and _count series).
func seriesNames(t require.TestingT, url string) map[string]bool {
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	require.NoError(t, err)
	names := map[string]bool{}
	for n, f := range fams {
		if len(f.GetMetric()) == 0 {
			continue
		}
		names[n] = true
		switch f.GetType() {
		case dto.MetricType_HISTOGRAM:
			names[n+"_bucket"], names[n+"_sum"], names[n+"_count"] = true, true, true
		case dto.MetricType_SUMMARY:
			names[n+"_sum"], names[n+"_count"] = true, true
		}
	}
	return names
}

// TestDashboardQueriesExistInPilot runs a real pilot over the two real
// clusters and gives every metric family a series: a remote cluster
// registers and syncs, a ztunnel-like client holds a delta xDS stream on
// the plaintext port and NACKs a push, a client without a certificate is
// refused on the TLS port, and the CA refuses a request with a bad token.
// Then every metric name of every query of the shipped Grafana dashboard
// must be in pilot's /metrics.
func TestDashboardQueriesExistInPilot(t *testing.T) {
	queries := dashboardMetrics(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const cpNS, ip = "isthmus-dashboard", "127.0.64.1"
	require.NoError(t, clusters.Cluster("primary").EnsureNamespace(ctx, cpNS, nil))
	p := runPilot(t, server.Config{
		Namespace: cpNS, ClusterID: "primary", Network: "net1", NoLeaderElection: true,
		DebugAddr: defaults.Disabled, MonitoringAddr: "127.0.0.1:0", GRPCAddr: ip + ":0", XDSPlaintextAddr: "127.0.0.1:0",
		CA: ca.Config{ServingSANs: []string{ip}},
	})
	registerRemote(t, cpNS, "net2")
	require.Eventually(t, func() bool { return p.MonitoringAddr() != "" && p.GRPCAddr() != "" && p.XDSPlaintextAddr() != "" },
		20*time.Second, 10*time.Millisecond)

	// A delta xDS stream, held open, that NACKs its first push.
	plain, err := grpc.NewClient(p.XDSPlaintextAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = plain.Close() })
	stream, err := discovery.NewAggregatedDiscoveryServiceClient(plain).DeltaAggregatedResources(ctx)
	require.NoError(t, err)
	md, err := structpb.NewStruct(map[string]any{xds.MetadataClusterID: "primary", xds.MetadataNodeName: "node-1"})
	require.NoError(t, err)
	require.NoError(t, stream.Send(&discovery.DeltaDiscoveryRequest{Node: &corev3.Node{Id: "ztunnel~node-1", Metadata: md}, TypeUrl: xds.WorkloadType}))
	resp, err := stream.Recv()
	require.NoError(t, err)
	require.NoError(t, stream.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.WorkloadType, ResponseNonce: resp.GetNonce(),
		ErrorDetail: &rpcstatus.Status{Code: 3, Message: "dashboard test NACK"}}))

	// On the TLS port: an xDS stream without a client certificate, and a
	// certificate request with a token no API server issued.
	roots := x509.NewCertPool()
	require.True(t, roots.AppendCertsFromPEM(p.CA.Roots()))
	tlsConn, err := grpc.NewClient(p.GRPCAddr(), grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: roots, ServerName: ip, MinVersion: tls.VersionTLS13})))
	require.NoError(t, err)
	t.Cleanup(func() { _ = tlsConn.Close() })
	refused, err := discovery.NewAggregatedDiscoveryServiceClient(tlsConn).DeltaAggregatedResources(ctx)
	require.NoError(t, err)
	_ = refused.Send(&discovery.DeltaDiscoveryRequest{Node: &corev3.Node{Id: "ztunnel~x"}, TypeUrl: xds.WorkloadType})
	_, err = refused.Recv()
	require.Error(t, err, "no client certificate, no xDS")
	_, err = pb.NewIstioCertificateServiceClient(tlsConn).CreateCertificate(
		metadata.NewOutgoingContext(ctx, metadata.Pairs("authorization", "Bearer not-a-token", "clusterid", "primary")),
		&pb.IstioCertificateRequest{Csr: "not a CSR", ValidityDuration: 3600})
	require.Error(t, err, "the CA refuses")

	metricsURL := "http://" + p.MonitoringAddr() + "/metrics"
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		names := seriesNames(c, metricsURL)
		var missing []string
		for q, ns := range queries {
			for _, n := range ns {
				if !names[n] {
					missing = append(missing, n+" (in "+q+")")
				}
			}
		}
		sort.Strings(missing)
		require.Empty(c, missing, "dashboard metrics pilot does not expose")
	}, 60*time.Second, 100*time.Millisecond)
	require.GreaterOrEqual(t, len(queries), 15, "every panel's queries were read")
}
