package analysis_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/analysis"
	"github.com/isthmus-mesh/isthmus/analysis/msg"
)

type fixed struct {
	name string
	msgs []msg.Message
}

func (f fixed) Name() string                             { return f.name }
func (f fixed) Analyze(*analysis.Snapshot) []msg.Message { return f.msgs }

type panicking struct{}

func (panicking) Name() string                             { return "broken" }
func (panicking) Analyze(*analysis.Snapshot) []msg.Message { panic("nil map") }

// TestRun: messages come out the most serious first, duplicates dropped,
// suppressed ones removed; a panicking analyzer is an error naming it and
// the others still report.
func TestRun(t *testing.T) {
	ns := msg.NewAmbientEnrollmentMismatch(msg.Resource{Kind: "Namespace", Name: "shop"}, "a", "b")
	port := msg.NewServicePortConflict(msg.Resource{Cluster: "c2", Kind: "Service", Namespace: "demo", Name: "web"}, "http", "8080/TCP", "c2", "80/TCP", "c1")
	info := msg.NewClusterDataIncomplete(msg.Resource{Kind: "Cluster", Name: "c2"}, "c2", "pods", "Forbidden")
	as := []analysis.Analyzer{fixed{"a", []msg.Message{info, ns}}, panicking{}, fixed{"b", []msg.Message{port, ns}}}

	got, err := analysis.Run(&analysis.Snapshot{}, as, nil)
	require.ErrorContains(t, err, "analyzer broken failed: nil map")
	require.Equal(t, []msg.Message{port, ns, info}, got)
	require.True(t, analysis.Fails(got, msg.Error))

	sup, err := analysis.ParseSuppression("ISM0008=Service/*/web")
	require.NoError(t, err)
	got, _ = analysis.Run(&analysis.Snapshot{}, as, []analysis.Suppression{sup})
	require.Equal(t, []msg.Message{ns, info}, got)
	require.False(t, analysis.Fails(got, msg.Error))
	require.True(t, analysis.Fails(got, msg.Warning))
}

func TestSuppressionMatches(t *testing.T) {
	port := msg.NewServicePortConflict(msg.Resource{Cluster: "c2", Kind: "Service", Namespace: "demo", Name: "web"}, "http", "8080/TCP", "c2", "80/TCP", "c1")
	for pattern, want := range map[string]bool{
		"ISM0008=Service/demo/web": true, "ISM0008=*": true, "ISM0008=Service/*/*": true, "ISM0008=*/demo/web": true,
		"ISM0008=Service/demo": false, "ISM0008=Service/*": false, "ISM0009=Service/demo/web": false, "ISM0008=Service/demo/web2": false,
	} {
		s, err := analysis.ParseSuppression(pattern)
		require.NoError(t, err, pattern)
		require.Equal(t, want, s.Matches(port), pattern)
	}
}
