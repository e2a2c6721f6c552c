package analyzers

import (
	"slices"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/analysis"
	"github.com/isthmus-mesh/isthmus/analysis/msg"
)

// DataCompleteness reports each kind of object a cluster could not be
// read for (ISM0016), so that a quiet check is not mistaken for a clean one;
// a ReaderOptionalKinds kind that a remote cluster forbids is expected and
// not reported.
type DataCompleteness struct{}

// Name implements analysis.Analyzer.
func (DataCompleteness) Name() string { return "data-completeness" }

// Analyze implements analysis.Analyzer.
func (DataCompleteness) Analyze(s *analysis.Snapshot) []msg.Message {
	var out []msg.Message
	for _, c := range s.Clusters {
		for _, kind := range sortedKeys(c.Unread) {
			if c.Secret != "" && c.Unread[kind] == string(metav1.StatusReasonForbidden) && slices.Contains(analysis.ReaderOptionalKinds, kind) {
				continue
			}
			out = append(out, msg.NewClusterDataIncomplete(msg.Resource{Kind: "Cluster", Name: string(c.ID)}, string(c.ID), kind, c.Unread[kind]))
		}
	}
	return out
}
