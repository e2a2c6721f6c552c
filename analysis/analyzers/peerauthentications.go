package analyzers

import (
	"fmt"
	"strings"

	"github.com/isthmus-mesh/isthmus/analysis"
	"github.com/isthmus-mesh/isthmus/analysis/msg"
)

// RootPeerAuthentications reports each PeerAuthentication of the root
// namespace (the control-plane namespace, Mesh.Namespace) whose selector
// has labels (ISM0017): Istio applies it to no workload, and so does pilot
// (pilot/policy.ConvertPeerAuthentication), while it reads as mesh-wide or
// as "these workloads everywhere". An empty selector (`selector: {}`) is
// no selector: mesh-wide, not reported.
type RootPeerAuthentications struct{}

// Name implements analysis.Analyzer.
func (RootPeerAuthentications) Name() string { return "root-peer-authentications" }

// Analyze implements analysis.Analyzer.
func (RootPeerAuthentications) Analyze(s *analysis.Snapshot) []msg.Message {
	var out []msg.Message
	for _, c := range s.Clusters {
		for _, pa := range c.PeerAuthentications {
			ml := pa.Spec.GetSelector().GetMatchLabels()
			if pa.Namespace != s.Mesh.Namespace || len(ml) == 0 {
				continue
			}
			labels := make([]string, 0, len(ml))
			for _, k := range sortedKeys(ml) {
				labels = append(labels, k+"="+ml[k])
			}
			mode := pa.Spec.GetMtls().GetMode().String()
			res := objectResource(string(c.ID), "PeerAuthentication", pa.Namespace, pa.Name)
			out = append(out, msg.NewRootPeerAuthenticationSelector(res, fmt.Sprintf("{%s}", strings.Join(labels, ", ")), mode))
		}
	}
	return out
}
