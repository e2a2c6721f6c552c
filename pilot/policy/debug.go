package policy

import (
	"encoding/json"
	"net/http"
	"net/netip"

	"google.golang.org/protobuf/encoding/protojson"

	securityv1 "github.com/isthmus-mesh/isthmus/pilot/api/security/v1"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// Summary is what /debug/authorizationz shows.
type Summary struct {
	Synced                bool              `json:"synced"`
	RootNamespace         string            `json:"rootNamespace"`
	AbsentCRDs            []string          `json:"absentCRDs,omitempty"`
	AuthorizationPolicies []PolicySummary   `json:"authorizationPolicies"`
	PeerAuthentications   []PeerAuthSummary `json:"peerAuthentications"`
}

// PolicySummary describes one AuthorizationPolicy.
type PolicySummary struct {
	Namespace string                `json:"namespace"`
	Name      string                `json:"name"`
	Enforced  bool                  `json:"enforced"`
	Scope     string                `json:"scope,omitempty"`
	Action    string                `json:"action,omitempty"`
	Selector  map[string]string     `json:"selector,omitempty"`
	Rules     int                   `json:"rules"`
	Problems  []*securityv1.Problem `json:"problems,omitempty"`
}

// PeerAuthSummary describes one PeerAuthentication.
type PeerAuthSummary struct {
	Namespace string            `json:"namespace"`
	Name      string            `json:"name"`
	Selector  map[string]string `json:"selector,omitempty"`
	// Ignored: the policy applies to no workload (a root-namespace
	// policy with a selector, as in Istio).
	Ignored  bool                  `json:"ignored,omitempty"`
	Mode     string                `json:"mode"`
	Ports    map[uint32]string     `json:"ports,omitempty"`
	Problems []*securityv1.Problem `json:"problems,omitempty"`
}

// Summary describes every policy and its problems.
func (w *Watcher) Summary() Summary {
	s := w.Snapshot()
	out := Summary{Synced: w.HasSynced(), RootNamespace: s.root, AbsentCRDs: w.Absent(),
		AuthorizationPolicies: []PolicySummary{}, PeerAuthentications: []PeerAuthSummary{}}
	for _, p := range s.Policies() {
		ps := PolicySummary{Namespace: p.Namespace, Name: p.Name, Enforced: p.Proto != nil, Selector: p.Selector, Problems: p.Problems}
		if p.Proto != nil {
			ps.Scope, ps.Action, ps.Rules = p.Proto.GetScope().String(), p.Proto.GetAction().String(), len(p.Proto.GetRules())
		}
		out.AuthorizationPolicies = append(out.AuthorizationPolicies, ps)
	}
	for _, pa := range s.PeerAuths() {
		ps := PeerAuthSummary{Namespace: pa.Namespace, Name: pa.Name, Selector: pa.Selector, Ignored: pa.Ignored, Mode: "UNSET", Problems: pa.Problems}
		if pa.ModeSet {
			ps.Mode = pa.Mode.String()
		}
		for port, m := range pa.Ports {
			if ps.Ports == nil {
				ps.Ports = map[uint32]string{}
			}
			ps.Ports[port] = m.String()
		}
		out.PeerAuthentications = append(out.PeerAuthentications, ps)
	}
	return out
}

// WorkloadPolicies is what /debug/authz?workload=<uid> shows: the workload
// and exactly the authorization resources its node's ztunnel holds for it
// (the policies that apply and its binding), as protojson.
type WorkloadPolicies struct {
	Workload  WorkloadInfo      `json:"workload"`
	Resources []json.RawMessage `json:"resources"`
}

// WorkloadInfo identifies a workload.
type WorkloadInfo struct {
	UID       string            `json:"uid"`
	Namespace string            `json:"namespace"`
	Cluster   string            `json:"cluster"`
	Node      string            `json:"node"`
	Addresses []netip.Addr      `json:"addresses"`
	Labels    map[string]string `json:"labels,omitempty"`
	// Enforced is false for workloads no node ztunnel authorizes
	// (hostNetwork pods, addresses of services without a selector).
	Enforced bool `json:"enforced"`
}

// ForWorkload returns what /debug/authz shows for w.
func (s *Snapshot) ForWorkload(w *model.Workload) (WorkloadPolicies, error) {
	out := WorkloadPolicies{Workload: WorkloadInfo{
		UID: w.UID, Namespace: w.Namespace, Cluster: string(w.Cluster), Node: w.Node,
		Addresses: w.Addresses, Labels: w.Labels, Enforced: Enforced(w),
	}, Resources: []json.RawMessage{}}
	var res []*securityv1.Authorization
	for _, p := range s.Applicable(w.Namespace, w.Labels) {
		res = append(res, &securityv1.Authorization{Kind: &securityv1.Authorization_Policy{Policy: p.Proto}})
	}
	res = append(res, &securityv1.Authorization{Kind: &securityv1.Authorization_Workload{Workload: s.Binding(w)}})
	for _, r := range res {
		b, err := protojson.Marshal(r)
		if err != nil {
			return out, err
		}
		out.Resources = append(out.Resources, b)
	}
	return out, nil
}

// DebugHandler serves /debug/authorizationz (every policy, whether ztunnel
// enforces it and what it does not enforce as written) and
// /debug/authz?workload=<uid> (what applies to one workload; lookup finds
// it in the registry).
func (w *Watcher) DebugHandler(lookup func(uid string) *model.Workload) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /debug/authorizationz", func(rw http.ResponseWriter, _ *http.Request) {
		writeJSON(rw, http.StatusOK, w.Summary())
	})
	mux.HandleFunc("GET /debug/authz", func(rw http.ResponseWriter, r *http.Request) {
		uid := r.URL.Query().Get("workload")
		if uid == "" {
			http.Error(rw, "missing ?workload=<cluster>/<namespace>/<name>", http.StatusBadRequest)
			return
		}
		wl := lookup(uid)
		if wl == nil {
			http.Error(rw, "no workload "+uid+" in the registry", http.StatusNotFound)
			return
		}
		if !w.HasSynced() {
			http.Error(rw, "policies not synced yet", http.StatusServiceUnavailable)
			return
		}
		out, err := w.Snapshot().ForWorkload(wl)
		if err != nil {
			http.Error(rw, err.Error(), http.StatusInternalServerError)
			return
		}
		writeJSON(rw, http.StatusOK, out)
	})
	return mux
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}
