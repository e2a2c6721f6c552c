package xds

import (
	"cmp"
	"encoding/json"
	"net/http"
	"slices"

	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
)

// DebugHandler returns the debug HTTP handlers:
//
//   - /debug/syncz: per open stream, the node id, cluster, network, protocol
//     and, per type URL, versions and nonces sent, the last ACK and NACK, and
//     whether a response is pending.
//   - /debug/config_dump?proxy=<node id>: every resource the class of that
//     node's stream holds, per type URL, as JSON.
func (s *Server) DebugHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /debug/syncz", s.syncz)
	mux.HandleFunc("GET /debug/config_dump", s.configDump)
	return mux
}

// Syncz returns the status of every open stream, sorted by protocol and
// stream id (SotW and delta streams are numbered separately).
func (s *Server) Syncz() []ClientStatus {
	out := s.stats.snapshot()
	slices.SortFunc(out, func(a, b ClientStatus) int {
		return cmp.Or(cmp.Compare(a.Protocol, b.Protocol), cmp.Compare(a.StreamID, b.StreamID))
	})
	return out
}

func (s *Server) syncz(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, s.Syncz())
}

func (s *Server) configDump(w http.ResponseWriter, r *http.Request) {
	id := r.URL.Query().Get("proxy")
	if id == "" {
		http.Error(w, "missing ?proxy=<node id>", http.StatusBadRequest)
		return
	}
	var found *ClientStatus
	for _, cs := range s.Syncz() {
		if cs.NodeID == id {
			found = &cs
		}
	}
	if found == nil {
		http.Error(w, "no stream from node "+id, http.StatusNotFound)
		return
	}
	c := s.classOf(found.node)
	if s.view(c) == nil && s.view(s.classFor(found.node, resource.EndpointType)) == nil {
		http.Error(w, errNoView.Error(), http.StatusNotFound)
		return
	}
	dump := struct {
		NodeID    string                                `json:"nodeId"`
		Network   string                                `json:"network"`
		Cluster   string                                `json:"cluster"`
		Resources map[string]map[string]json.RawMessage `json:"resources"`
	}{NodeID: id, Network: string(c.Network), Cluster: string(c.Cluster), Resources: map[string]map[string]json.RawMessage{}}
	for _, t := range allTypes {
		// The Envoy types are served from the view of the node's locality.
		v := s.view(s.classFor(found.node, t))
		if v == nil {
			continue
		}
		res := v.cache(t).GetResources()
		m := make(map[string]json.RawMessage, len(res))
		for name, r := range res {
			b, err := rawJSON(t, r)
			if err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			m[name] = b
		}
		dump.Resources[t] = m
	}
	writeJSON(w, http.StatusOK, dump)
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}
