// Package admin serves ztunnel's admin endpoints: /healthz/ready,
// /config_dump (the state snapshot and certificates, never private keys, as
// JSON) and /metrics from an injected Prometheus gatherer.
package admin

import (
	"encoding/json"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// Deps are the admin handler's sources. Store and Gatherer are required.
type Deps struct {
	Store *state.Store
	// Certs lists the certificates in use (identity.Cache.Dump).
	Certs func() []identity.CertInfo
	// Gatherer serves /metrics.
	Gatherer prometheus.Gatherer
	// Ready reports readiness; nil means always ready.
	Ready func() bool
}

// ConfigDump is the /config_dump document.
type ConfigDump struct {
	Version      uint64                  `json:"version"`
	Workloads    []*state.Workload       `json:"workloads"`
	Services     []*state.Service        `json:"services"`
	Gateways     []*state.NetworkGateway `json:"gateways"`
	Certificates []identity.CertInfo     `json:"certificates"`
}

// New returns the admin handler. It is safe for concurrent use.
func New(deps Deps) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz/ready", func(w http.ResponseWriter, _ *http.Request) {
		if deps.Ready != nil && !deps.Ready() {
			http.Error(w, "not ready", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /config_dump", func(w http.ResponseWriter, _ *http.Request) {
		snap := deps.Store.Load()
		dump := ConfigDump{
			Version:      snap.Version(),
			Workloads:    snap.Workloads(),
			Services:     snap.Services(),
			Gateways:     snap.Gateways(),
			Certificates: []identity.CertInfo{},
		}
		if deps.Certs != nil {
			dump.Certificates = deps.Certs()
		}
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		_ = enc.Encode(dump)
	})
	mux.Handle("GET /metrics", promhttp.HandlerFor(deps.Gatherer, promhttp.HandlerOpts{}))
	return mux
}
