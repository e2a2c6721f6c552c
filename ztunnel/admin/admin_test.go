package admin

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/internal/testca"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/proxy"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

func get(t *testing.T, h http.Handler, path string) *httptest.ResponseRecorder {
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	return rec
}

func TestAdminEndpoints(t *testing.T) {
	st := state.NewStore()
	st.Update(func(tx *state.Tx) {
		tx.UpsertService(&state.Service{Name: "echo", Namespace: "default", Ports: []uint16{80}})
		tx.UpsertWorkload(&state.Workload{UID: "a", Name: "a", Namespace: "default",
			Addresses: []netip.Addr{netip.MustParseAddr("127.0.0.9")}, TrustDomain: "cluster.local", ServiceAccount: "sa"})
	})
	ca, err := testca.New("cluster.local")
	require.NoError(t, err)
	cache := identity.NewCache(ca)
	_, err = cache.Certificate(t.Context(), identity.Identity{TrustDomain: "cluster.local", Namespace: "default", ServiceAccount: "sa"})
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	require.NoError(t, err)
	m.Refused(metrics.ReporterDestination, "method_not_connect")
	ready := false
	h := New(Deps{Store: st, Certs: cache.Dump, Gatherer: reg, Ready: func() bool { return ready }})

	require.Equal(t, http.StatusServiceUnavailable, get(t, h, "/healthz/ready").Code)
	ready = true
	require.Equal(t, http.StatusOK, get(t, h, "/healthz/ready").Code)

	rec := get(t, h, "/config_dump")
	require.Equal(t, http.StatusOK, rec.Code)
	body := rec.Body.String()
	require.NotContains(t, body, "PRIVATE KEY")
	var dump ConfigDump
	require.NoError(t, json.Unmarshal([]byte(body), &dump))
	require.Equal(t, uint64(1), dump.Version)
	require.Len(t, dump.Workloads, 1)
	require.Equal(t, "echo.default.svc.cluster.local", dump.Services[0].Hostname)
	require.Len(t, dump.Certificates, 1)
	require.Equal(t, "spiffe://cluster.local/ns/default/sa/sa", dump.Certificates[0].Identity)
	require.True(t, strings.HasPrefix(dump.Certificates[0].ChainPEM, "-----BEGIN CERTIFICATE-----"))

	rec = get(t, h, "/metrics")
	require.Equal(t, http.StatusOK, rec.Code)
	require.Contains(t, rec.Body.String(), `isthmus_hbone_refused_total{reason="method_not_connect",reporter="destination"} 1`)
}

// TestAdminPoliciesAndConnections: /config_dump lists the authorization
// resources held, /connections the open connections of a real access
// log (a connection disappears once closed), and no endpoint ever serves
// private key material although the certificate cache holds keys.
func TestAdminPoliciesAndConnections(t *testing.T) {
	st := state.NewStore()
	ca, err := testca.New("cluster.local")
	require.NoError(t, err)
	cache := identity.NewCache(ca)
	id := identity.Identity{TrustDomain: "cluster.local", Namespace: "default", ServiceAccount: "sa"}
	cert, err := cache.Certificate(t.Context(), id)
	require.NoError(t, err)
	require.NotNil(t, cert.PrivateKey, "the cache holds the key")
	al, err := proxy.NewAccessLog(proxy.AccessLogConfig{})
	require.NoError(t, err)
	open := al.Open(proxy.DirectionInbound)
	open.Source, open.Destination = "127.0.0.2:40000", "127.0.0.9:8080"
	open.Labels.SourcePrincipal, open.Labels.DestinationPrincipal = "spiffe://cluster.local/ns/default/sa/client", id.String()
	open.Established()
	held := map[string]string{"policy/default/deny-client": "v1", "workload/c1/default/pod-a": "v2"}
	h := New(Deps{Store: st, Certs: cache.Dump, Gatherer: prometheus.NewRegistry(),
		Policies: func() map[string]string { return held }, Connections: al.Active})

	var dump ConfigDump
	rec := get(t, h, "/config_dump")
	require.Equal(t, http.StatusOK, rec.Code)
	require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &dump))
	require.Equal(t, []Policy{
		{Kind: KindBinding, Workload: "c1/default/pod-a", Version: "v2"},
		{Kind: KindPolicy, Namespace: "default", Name: "deny-client", Version: "v1"},
	}, dump.Policies)
	require.Len(t, dump.Certificates, 1)
	require.Equal(t, cert.Leaf.SerialNumber.String(), dump.Certificates[0].Serial)

	var conns Connections
	rec = get(t, h, "/connections")
	require.Equal(t, http.StatusOK, rec.Code)
	require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &conns))
	require.Len(t, conns.Connections, 1)
	require.Equal(t, "127.0.0.2:40000", conns.Connections[0].Source)
	require.Equal(t, id.String(), conns.Connections[0].DestinationIdentity)
	open.Close(proxy.CloseOK, 1, 1, nil)
	require.NoError(t, json.Unmarshal(get(t, h, "/connections").Body.Bytes(), &conns))
	require.Empty(t, conns.Connections)

	// Whatever an endpoint serves, never a key.
	for _, path := range []string{"/config_dump", "/connections", "/metrics", "/healthz/ready"} {
		body := get(t, h, path).Body.String()
		require.NotContains(t, body, "PRIVATE KEY", path)
		require.NotContains(t, body, "privateKey", path)
	}
}
