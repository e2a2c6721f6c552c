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
