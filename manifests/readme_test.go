package manifests_test

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/internal/readme"
)

// TestReadmeInstallCommands runs every helm line of the README's
// installation section as the install would (render with its --set values
// into its namespace, then a server-side dry-run apply with strict field
// validation to a real API server), and checks that its make lines are
// targets of the Makefile.
func TestReadmeInstallCommands(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c := clusters.Clusters[0]
	require.NoError(t, c.InstallCRDs("base/crds"))
	require.NoError(t, c.EnsureNamespace(ctx, namespace, nil))
	a := newApplier(t, c.Config)
	makefile, err := os.ReadFile("../Makefile")
	require.NoError(t, err)

	var helms, makes int
	cmds, err := readme.Commands("../README.md", "## Installing on real clusters")
	require.NoError(t, err)
	for _, cmd := range cmds {
		switch f := strings.Fields(cmd); f[0] {
		case "helm":
			helms++
			h, err := readme.ParseHelm(cmd)
			require.NoError(t, err)
			values, err := h.Values()
			require.NoError(t, err, cmd)
			objs := render(t, strings.TrimPrefix(h.Chart, "manifests/"), h.Namespace, values)
			require.NotEmpty(t, objs, cmd)
			for _, o := range objs {
				require.NoError(t, a.apply(ctx, o, true), cmd)
			}
		case "make":
			makes++
			require.Contains(t, string(makefile), "\n"+f[1]+":", "%s: no such target", cmd)
		case "bin/isthmusctl":
			// run by cmd/isthmusctl's TestReadmeCommands
		default:
			t.Errorf("README command no test runs: %s", cmd)
		}
	}
	require.Equal(t, 10, helms, "the README installs five charts in each of two clusters (the CNI agent included: ztunnel captures in-pod)")
	require.Equal(t, 3, makes)
}
