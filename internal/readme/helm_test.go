package readme

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParseHelm(t *testing.T) {
	h, err := ParseHelm("helm --kube-context c1 install isthmus-pilot manifests/pilot -n isthmus-system --create-namespace --set clusterID=cluster-1 --set=image.registry=r:5000,network=n1 --set servingSANs={a,b}")
	require.NoError(t, err)
	require.Equal(t, "c1", h.KubeContext)
	require.Equal(t, "isthmus-pilot", h.Release)
	require.Equal(t, "manifests/pilot", h.Chart)
	require.Equal(t, "isthmus-system", h.Namespace)
	require.True(t, h.CreateNamespace)
	require.Equal(t, []string{"clusterID=cluster-1", "image.registry=r:5000,network=n1", "servingSANs={a,b}"}, h.Sets)
	vals, err := h.Values()
	require.NoError(t, err)
	require.Equal(t, map[string]any{
		"clusterID": "cluster-1", "network": "n1", "image": map[string]any{"registry": "r:5000"},
		"servingSANs": []any{"a", "b"},
	}, vals)
	v, ok := h.Set("image.registry")
	require.True(t, ok)
	require.Equal(t, "r:5000", v)
	_, ok = h.Set("xdsAddress")
	require.False(t, ok)

	for line, want := range map[string]string{
		"make images":                              "not a helm command",
		"helm upgrade a manifests/base":            "want helm install",
		"helm install a":                           "want helm install",
		"helm install a b c":                       "want helm install",
		"helm install a b --wait":                  "helm flag --wait not understood",
		"helm install a b -n":                      "-n without a value",
		"helm install a b --set a.b[=1":            "--set a.b[=1",
		"helm install a b --create-namespace=true": "takes no value",
	} {
		_, err := ParseHelm(line)
		require.ErrorContains(t, err, want, line)
	}
}
