package proxy

import (
	"io"
	"net/http"
	"net/netip"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/internal/promread"
	"github.com/isthmus-mesh/isthmus/ztunnel/hbone"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// istioSeries returns the label sets of metric name in g.
func istioSeries(t *testing.T, g prometheus.Gatherer, name string) []map[string]string {
	t.Helper()
	mfs, err := g.Gather()
	require.NoError(t, err)
	var out []map[string]string
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			out = append(out, labelMap(m))
		}
	}
	return out
}

func labelMap(m *dto.Metric) map[string]string {
	l := map[string]string{}
	for _, p := range m.GetLabel() {
		l[p.GetName()] = p.GetValue()
	}
	return l
}

// TestIstioTelemetry: a connection from a1 to echo (b1) is reported with
// Istio's metric and label names, by the source and the destination
// ztunnel, every value from the store; a request naming another workload's
// address as its source (Forwarded) does not borrow that workload's labels.
func TestIstioTelemetry(t *testing.T) {
	regOut, regB := prometheus.NewRegistry(), prometheus.NewRegistry()
	mOut, err := metrics.New(regOut)
	require.NoError(t, err)
	mB, err := metrics.New(regB)
	require.NoError(t, err)
	m := newMesh(t, func(m *mesh) { m.mOut, m.mB = mOut, mB })
	m.n1.Update(func(tx *state.Tx) {
		a := pod("a1", m.a1, "node-a", "n1", "c1", "client")
		a.Services, a.WorkloadName, a.CanonicalName, a.CanonicalRevision = nil, "sleep", "sleep", "v1"
		tx.UpsertWorkload(a)
		b := pod("b1", m.b1, "node-b", "n1", "c1", "echo")
		b.WorkloadName, b.CanonicalName, b.CanonicalRevision = "echo-v2", "echo", "v2"
		tx.UpsertWorkload(b)
		tx.RemoveWorkload("n2/echo")
	})
	m.echoVia(t, echoHost)
	want := map[string]string{
		"source_workload": "sleep", "source_canonical_service": "sleep", "source_canonical_revision": "v1",
		"source_workload_namespace": "default", "source_principal": "spiffe://cluster.local/ns/default/sa/client",
		"source_app": "sleep", "source_version": "v1", "source_cluster": "c1",
		"destination_service": echoHost, "destination_service_name": "echo", "destination_service_namespace": "default",
		"destination_workload": "echo-v2", "destination_canonical_service": "echo", "destination_canonical_revision": "v2",
		"destination_workload_namespace": "default", "destination_principal": "spiffe://cluster.local/ns/default/sa/echo",
		"destination_app": "echo", "destination_version": "v2", "destination_cluster": "c1",
		"request_protocol": "tcp", "response_flags": "-", "connection_security_policy": "mutual_tls",
	}
	for _, tc := range []struct {
		reporter string
		g        prometheus.Gatherer
	}{{"source", regOut}, {"destination", regB}} {
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			for _, name := range []string{"istio_tcp_connections_opened_total", "istio_tcp_connections_closed_total",
				"istio_tcp_sent_bytes_total", "istio_tcp_received_bytes_total"} {
				series := istioSeries(t, tc.g, name)
				require.Len(c, series, 1, "%s by %s", name, tc.reporter)
				w := map[string]string{"reporter": tc.reporter}
				for k, v := range want {
					w[k] = v
				}
				require.Equal(c, w, series[0], name)
			}
		}, 5*time.Second, 10*time.Millisecond)
	}

	// A client that claims a1's address as its source but runs as another
	// identity gets only what its verified identity says.
	client, err := hbone.NewClient(hbone.ClientConfig{}, hbone.ClientDeps{Certs: m.certs})
	require.NoError(t, err)
	defer client.Close()
	s, err := client.Dial(t.Context(), hbone.DialRequest{
		Source: identity.Identity{TrustDomain: trustDomain, Namespace: "tenant", ServiceAccount: "evil"},
		Peers:  []identity.Identity{workloadID("echo")}, Addr: netip.AddrPortFrom(m.b1, 15008),
		Authority: netip.AddrPortFrom(m.b1, appPort).String(),
		Header:    http.Header{HeaderForwarded: {forwarded(m.a1.String(), "x")}, HeaderBaggage: {"k8s.cluster.name=c1"}},
	})
	require.NoError(t, err)
	require.NoError(t, s.Close())
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		var got map[string]string
		for _, l := range istioSeries(t, regB, "istio_tcp_connections_opened_total") {
			if l["source_principal"] == "spiffe://cluster.local/ns/tenant/sa/evil" {
				got = l
			}
		}
		require.NotNil(c, got)
		require.Equal(c, "unknown", got["source_workload"], "not a1's")
		require.Equal(c, "tenant", got["source_workload_namespace"], "from the verified identity")
		require.Equal(c, "c1", got["source_cluster"], "a cluster the store knows")
	}, 5*time.Second, 10*time.Millisecond)
}

// TestIstioSocketsOpen: istio_tcp_sockets_open counts a connection open at
// the source and the destination ztunnel while it lasts, and drops when
// it closes; a gateway hop is not counted (as for istio_tcp_*).
func TestIstioSocketsOpen(t *testing.T) {
	regOut, regB := prometheus.NewRegistry(), prometheus.NewRegistry()
	mOut, err := metrics.New(regOut)
	require.NoError(t, err)
	mB, err := metrics.New(regB)
	require.NoError(t, err)
	m := newMesh(t, func(m *mesh) { m.mOut, m.mB = mOut, mB })
	m.n1.Update(func(tx *state.Tx) {
		tx.UpsertWorkload(pod("b1", m.b1, "node-b", "n1", "c1", "echo"))
		tx.RemoveWorkload("n2/echo")
	})
	open := func(g prometheus.Gatherer, reporter string) float64 {
		v, err := promread.Value(g, "istio_tcp_sockets_open", map[string]string{"reporter": reporter})
		require.NoError(t, err)
		return v
	}
	c, code := socksDial(t, m.socksAddr, m.a1, echoHost, svcPort)
	require.Equal(t, byte(0), code)
	// One echo without a half-close: the connection stays open.
	_, err = c.Write([]byte("hold"))
	require.NoError(t, err)
	got := make([]byte, 4)
	_, err = io.ReadFull(c, got)
	require.NoError(t, err)
	require.Equal(t, "hold", string(got))
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		require.Equal(ct, 1.0, open(regOut, metrics.ReporterSource))
		require.Equal(ct, 1.0, open(regB, metrics.ReporterDestination))
	}, 5*time.Second, 10*time.Millisecond)
	require.Zero(t, open(regOut, metrics.ReporterGateway))
	require.NoError(t, c.Close())
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		require.Equal(ct, 0.0, open(regOut, metrics.ReporterSource))
		require.Equal(ct, 0.0, open(regB, metrics.ReporterDestination))
	}, 5*time.Second, 10*time.Millisecond)
}
