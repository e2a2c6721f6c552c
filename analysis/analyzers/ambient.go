package analyzers

import (
	"github.com/isthmus-mesh/isthmus/analysis"
	"github.com/isthmus-mesh/isthmus/analysis/msg"
	"github.com/isthmus-mesh/isthmus/cni/selection"
)

// AmbientEnrollment reports a namespace enrolled in ambient mode in some
// clusters and not in others where it exists (ISM0010). kube-system and
// the control-plane namespace, never enrolled, are left out.
type AmbientEnrollment struct{}

// Name implements analysis.Analyzer.
func (AmbientEnrollment) Name() string { return "ambient-enrollment" }

// Analyze implements analysis.Analyzer.
func (AmbientEnrollment) Analyze(s *analysis.Snapshot) []msg.Message {
	type where struct{ enrolled, not []string }
	byName := map[string]*where{}
	for _, c := range s.Clusters {
		for _, ns := range c.Namespaces {
			if ns.Name == "kube-system" || ns.Name == s.Mesh.Namespace {
				continue
			}
			w := byName[ns.Name]
			if w == nil {
				w = &where{}
				byName[ns.Name] = w
			}
			if ns.Labels[selection.LabelDataplaneMode] == selection.ModeAmbient || ns.Labels[selection.LabelIsthmusDataplaneMode] == selection.ModeAmbient {
				w.enrolled = append(w.enrolled, string(c.ID))
			} else {
				w.not = append(w.not, string(c.ID))
			}
		}
	}
	var out []msg.Message
	for _, name := range sortedKeys(byName) {
		if w := byName[name]; len(w.enrolled) > 0 && len(w.not) > 0 {
			out = append(out, msg.NewAmbientEnrollmentMismatch(msg.Resource{Kind: "Namespace", Name: name}, list(w.enrolled), list(w.not)))
		}
	}
	return out
}
