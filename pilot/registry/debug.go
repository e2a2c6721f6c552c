package registry

import (
	"encoding/json"
	"net/http"
	"slices"
	"strings"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// ServiceSummary is the debug view of one federated service.
type ServiceSummary struct {
	Hostname      string                       `json:"hostname"`
	Scope         string                       `json:"scope"`
	Clusters      []model.ClusterID            `json:"clusters"`
	LocalClusters []model.ClusterID            `json:"localClusters,omitempty"`
	Ports         []model.Port                 `json:"ports"`
	VIPs          map[model.ClusterID][]string `json:"vips,omitempty"`
	Endpoints     map[model.ClusterID]int      `json:"endpoints"`
	PortConflicts []string                     `json:"portConflicts,omitempty"`
}

// EndpointView is the debug view of one endpoint.
type EndpointView struct {
	Address     string              `json:"address"`
	Workload    string              `json:"workload,omitempty"`
	Cluster     model.ClusterID     `json:"cluster"`
	Network     model.Network       `json:"network"`
	Locality    string              `json:"locality,omitempty"`
	Identity    string              `json:"serviceAccount"`
	Node        string              `json:"node,omitempty"`
	Ready       bool                `json:"ready"`
	Terminating bool                `json:"terminating,omitempty"`
	Ports       []model.PortMapping `json:"ports"`
}

// Summaries returns the debug view of every service.
func (r *Registry) Summaries() []ServiceSummary {
	var out []ServiceSummary
	for _, s := range r.Services() {
		sum := ServiceSummary{Hostname: s.Hostname, Scope: s.Scope.String(), Clusters: s.Clusters, Ports: s.Ports,
			Endpoints: map[model.ClusterID]int{}, PortConflicts: s.PortConflicts}
		for c, vips := range s.VIPs {
			if sum.VIPs == nil {
				sum.VIPs = map[model.ClusterID][]string{}
			}
			for _, v := range vips {
				sum.VIPs[c] = append(sum.VIPs[c], v.String())
			}
		}
		for c := range s.LocalClusters {
			sum.LocalClusters = append(sum.LocalClusters, c)
		}
		slices.Sort(sum.LocalClusters)
		for c, sh := range s.Shards {
			sum.Endpoints[c] = len(sh)
		}
		out = append(out, sum)
	}
	return out
}

// EndpointsOf returns the debug view of host's endpoints.
func (r *Registry) EndpointsOf(host string) ([]EndpointView, bool) {
	s := r.Service(host)
	if s == nil {
		return nil, false
	}
	out := []EndpointView{}
	for _, c := range s.Clusters {
		for _, e := range s.Shards[c] {
			out = append(out, EndpointView{Address: e.Address().String(), Workload: e.WorkloadUID(), Cluster: e.Cluster(), Network: e.Network(),
				Locality: e.Locality().String(), Identity: e.Namespace() + "/" + e.ServiceAccount(), Node: e.Node(), Ready: e.Ready(),
				Terminating: e.Terminating(), Ports: e.Ports})
		}
	}
	return out, true
}

// RegistryzHandler serves /debug/registryz: every service with its
// per-cluster endpoint counts, the gateways, stale clusters, and the
// number of losing address claims by reason (see /debug/addressz).
func (r *Registry) RegistryzHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, map[string]any{
			"services": r.Summaries(), "gateways": r.Gateways(), "clusters": r.Clusters(), "staleClusters": r.StaleClusters(),
			"addressConflicts": r.ConflictCounts(),
		})
	})
}

// AddresszHandler serves /debug/addressz: every address that workloads of
// one network claim in conflict, with the owner served for it and each
// losing claim with its reason.
func (r *Registry) AddresszHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, map[string]any{"conflicts": r.AddressConflicts(), "counts": r.ConflictCounts()})
	})
}

// EndpointzHandler serves /debug/endpointz?host=<hostname>.
func (r *Registry) EndpointzHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		host := req.URL.Query().Get("host")
		if host == "" {
			http.Error(w, "missing ?host=<service hostname>", http.StatusBadRequest)
			return
		}
		eps, ok := r.EndpointsOf(host)
		if !ok {
			http.Error(w, "no service "+host, http.StatusNotFound)
			return
		}
		writeJSON(w, eps)
	})
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

// WorkloadzHandler serves /debug/workloadz[?cluster=<id>]: the workloads
// (immutable values) as JSON, sorted by uid.
func (r *Registry) WorkloadzHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		cluster := model.ClusterID(req.URL.Query().Get("cluster"))
		out := []*model.Workload{}
		for _, wl := range r.Workloads() {
			if cluster == "" || wl.Cluster == cluster {
				out = append(out, wl)
			}
		}
		slices.SortFunc(out, func(a, b *model.Workload) int { return strings.Compare(a.UID, b.UID) })
		writeJSON(w, out)
	})
}
