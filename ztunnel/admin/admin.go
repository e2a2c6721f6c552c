// Package admin serves ztunnel's admin endpoints: /healthz/ready,
// /config_dump (the state snapshot, the authorization resources held and
// the certificates, never private keys, as JSON), /connections (the
// connections open now) and /metrics from an injected Prometheus gatherer.
// Everything served is read-only and non-secret; isthmusctl ztunnel-config
// reads it.
package admin

import (
	"encoding/json"
	"net/http"
	"slices"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	securityv1 "github.com/isthmus-mesh/isthmus/pilot/api/security/v1"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/proxy"
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
	// Policies returns the authorization resources held, name -> version
	// (authz.Store.Versions); nil: none.
	Policies func() map[string]string
	// Connections lists the open connections (proxy.AccessLog.Active);
	// nil: none.
	Connections func() []proxy.ConnectionInfo
}

// Policy is an authorization resource held: a policy (Namespace, Name) or
// a workload's binding to its policies (Workload, the uid).
type Policy struct {
	Kind      string `json:"kind"`
	Namespace string `json:"namespace,omitempty"`
	Name      string `json:"name,omitempty"`
	Workload  string `json:"workload,omitempty"`
	Version   string `json:"version"`
}

// Kinds of Policy.
const (
	KindPolicy  = "policy"
	KindBinding = "binding"
)

// Connections is the /connections document.
type Connections struct {
	Connections []proxy.ConnectionInfo `json:"connections"`
}

// policies lists held resources by kind and name.
func policies(held map[string]string) []Policy {
	out := make([]Policy, 0, len(held))
	for name, v := range held {
		switch {
		case strings.HasPrefix(name, securityv1.PolicyPrefix):
			ns, n, _ := strings.Cut(strings.TrimPrefix(name, securityv1.PolicyPrefix), "/")
			out = append(out, Policy{Kind: KindPolicy, Namespace: ns, Name: n, Version: v})
		case strings.HasPrefix(name, securityv1.WorkloadPrefix):
			out = append(out, Policy{Kind: KindBinding, Workload: strings.TrimPrefix(name, securityv1.WorkloadPrefix), Version: v})
		}
	}
	slices.SortFunc(out, func(a, b Policy) int {
		return strings.Compare(a.Kind+"/"+a.Namespace+"/"+a.Name+"/"+a.Workload, b.Kind+"/"+b.Namespace+"/"+b.Name+"/"+b.Workload)
	})
	return out
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

// ConfigDump is the /config_dump document.
type ConfigDump struct {
	Version      uint64                  `json:"version"`
	Workloads    []*state.Workload       `json:"workloads"`
	Services     []*state.Service        `json:"services"`
	Gateways     []*state.NetworkGateway `json:"gateways"`
	Certificates []identity.CertInfo     `json:"certificates"`
	Policies     []Policy                `json:"policies"`
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
		dump.Policies = []Policy{}
		if deps.Policies != nil {
			dump.Policies = policies(deps.Policies())
		}
		writeJSON(w, dump)
	})
	mux.HandleFunc("GET /connections", func(w http.ResponseWriter, _ *http.Request) {
		doc := Connections{Connections: []proxy.ConnectionInfo{}}
		if deps.Connections != nil {
			doc.Connections = deps.Connections()
		}
		writeJSON(w, doc)
	})
	mux.Handle("GET /metrics", promhttp.HandlerFor(deps.Gatherer, promhttp.HandlerOpts{}))
	return mux
}
