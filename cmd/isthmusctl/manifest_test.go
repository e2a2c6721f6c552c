package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart/loader"
)

// renderChart renders a chart of manifests/ with values as `helm template`
// would (client only) into namespace isthmus-system, and writes the
// manifest to a file.
func renderChart(t *testing.T, chart string, values map[string]any) string {
	t.Helper()
	ch, err := loader.Load(filepath.Join("..", "..", "manifests", chart))
	require.NoError(t, err)
	inst := action.NewInstall(&action.Configuration{Log: func(string, ...any) {}})
	inst.DryRun, inst.ClientOnly, inst.Replace = true, true, true
	inst.ReleaseName, inst.Namespace = "isthmus-"+chart, "isthmus-system"
	rel, err := inst.Run(ch, values)
	require.NoError(t, err)
	path := filepath.Join(t.TempDir(), chart+".yaml")
	require.NoError(t, os.WriteFile(path, []byte(rel.Manifest), 0o644))
	return path
}

// diffExit runs manifest diff and returns its output and exit code.
func diffExit(t *testing.T, args ...string) (string, int) {
	t.Helper()
	stdout, stderr, err := runCtl(t, append([]string{"manifest", "diff"}, args...)...)
	if err == nil {
		return stdout, 0
	}
	exit, ok := err.(*exitError)
	require.True(t, ok, "unexpected error: %v\n%s", err, stderr)
	if exit.code == exitDiffError {
		return err.Error(), exit.code
	}
	return stdout, exit.code
}

// TestManifestDiffOfChartValues renders the pilot chart at its defaults
// and with one changed value: the diff names exactly that change.
func TestManifestDiffOfChartValues(t *testing.T) {
	base := renderChart(t, "pilot", nil)
	scaled := renderChart(t, "pilot", map[string]any{"replicaCount": 2})

	out, code := diffExit(t, base, base)
	require.Equal(t, 0, code, out)
	require.Regexp(t, `^No differences \(\d+ objects compared\)\.\n$`, out)

	out, code = diffExit(t, base, scaled)
	require.Equal(t, exitDiffers, code)
	require.Regexp(t, `^~ Deployment\.apps:isthmus-system:isthmusd
    spec\.replicas: 1 -> 2
1 changed, 0 added, 0 removed \(\d+ objects in both sets\)\.
$`, out)

	// Select and ignore on the rendered charts.
	out, code = diffExit(t, "--select", "Service:*:isthmusd", base, scaled)
	require.Equal(t, 0, code, out)
	require.Equal(t, "No differences (1 objects compared).\n", out)
	out, code = diffExit(t, "--ignore", "Deployment:*:*", base, scaled)
	require.Equal(t, 0, code, out)

	// A renamed Service is mapped onto its new name.
	renamed := filepath.Join(t.TempDir(), "renamed.yaml")
	raw, err := os.ReadFile(base)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(renamed, []byte(replaceServiceName(t, string(raw))), 0o644))
	out, code = diffExit(t, "--select", "Service:*:*", base, renamed)
	require.Equal(t, exitDiffers, code)
	require.Contains(t, out, "+ Service:isthmus-system:isthmusd-v2 (only in the second set)\n- Service:isthmus-system:isthmusd (only in the first set)\n")
	out, code = diffExit(t, "--select", "Service:*:*", "--rename", "Service:isthmus-system:isthmusd->*:*:isthmusd-v2", base, renamed)
	require.Equal(t, exitDiffers, code)
	require.Equal(t, `~ Service:isthmus-system:isthmusd-v2 (renamed from Service:isthmus-system:isthmusd)
    metadata.name: "isthmusd" -> "isthmusd-v2"
1 changed, 0 added, 0 removed (1 objects in both sets).
`, out)
}

// TestManifestDiffErrors: bad input exits 2 with the reason.
func TestManifestDiffErrors(t *testing.T) {
	base := renderChart(t, "pilot", nil)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{base}, "takes two paths, got 1"},
		{[]string{base, "testdata/none.yaml"}, "none.yaml"},
		{[]string{"--select", "Service", base, base}, "--select: pattern \"Service\""},
		{[]string{"--rename", "Service:a:b", base, base}, "--rename"},
		{[]string{"--no-such-flag", base, base}, "unknown flag"},
		{[]string{base, "testdata/analyze/primary/mesh.yaml", "testdata/analyze/primary/mesh.yaml"}, "takes two paths, got 3"},
	} {
		out, code := diffExit(t, tc.args...)
		require.Equal(t, exitDiffError, code, "%v", tc.args)
		require.Contains(t, out, tc.want)
	}
}

// replaceServiceName renames the isthmusd Service (only its metadata
// name) in a rendered manifest.
func replaceServiceName(t *testing.T, manifest string) string {
	t.Helper()
	const from = "kind: Service\nmetadata:\n  name: isthmusd\n"
	require.Contains(t, manifest, from)
	return strings.Replace(manifest, from, "kind: Service\nmetadata:\n  name: isthmusd-v2\n", 1)
}
