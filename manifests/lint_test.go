package manifests_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	"helm.sh/helm/v3/pkg/action"
)

// charts are every chart of the repository.
var charts = []string{"base", "pilot", "remote", "ztunnel", "eastwest-gateway", "cni"}

// TestChartsLintStrict lints every chart as `helm lint --strict` does, with
// Helm's SDK: a warning is an error.
func TestChartsLintStrict(t *testing.T) {
	for _, c := range charts {
		t.Run(c, func(t *testing.T) {
			l := action.NewLint()
			l.Strict, l.Namespace = true, namespace
			res := l.Run([]string{c}, nil)
			for _, m := range res.Messages {
				t.Log(m.Error())
			}
			require.Equal(t, 1, res.TotalChartsLinted)
			require.Empty(t, res.Errors)
		})
	}
}
