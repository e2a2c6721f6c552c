package manifests_test

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"helm.sh/helm/v3/pkg/strvals"
)

// readmeCommands returns the shell commands of the README's "Installing on
// real clusters" section, continuation lines joined, comments dropped.
func readmeCommands(t *testing.T) []string {
	t.Helper()
	raw, err := os.ReadFile("../README.md")
	require.NoError(t, err)
	_, section, ok := strings.Cut(string(raw), "\n## Installing on real clusters\n")
	require.True(t, ok, "README has the section")
	section, _, _ = strings.Cut(section, "\n## ")
	var cmds []string
	inCode, cur := false, ""
	for _, line := range strings.Split(section, "\n") {
		if strings.HasPrefix(line, "```") {
			inCode = !inCode
			continue
		}
		line = strings.TrimSpace(line)
		if !inCode || line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if c, _, found := strings.Cut(line, " #"); found {
			line = strings.TrimSpace(c)
		}
		if strings.HasSuffix(line, `\`) {
			cur += strings.TrimSuffix(line, `\`) + " "
			continue
		}
		cmds = append(cmds, cur+line)
		cur = ""
	}
	require.NotEmpty(t, cmds)
	return cmds
}

// helmInstall is one `helm install` line of the README.
type helmInstall struct {
	chart, namespace string
	values           map[string]any
}

func parseHelm(t *testing.T, cmd string) helmInstall {
	t.Helper()
	args := strings.Fields(cmd)
	h := helmInstall{values: map[string]any{}}
	var pos []string
	for i := 1; i < len(args); i++ {
		switch a := args[i]; a {
		case "--kube-context":
			i++
		case "-n", "--namespace":
			i++
			h.namespace = args[i]
		case "--set":
			i++
			require.NoError(t, strvals.ParseInto(args[i], h.values), cmd)
		default:
			require.False(t, strings.HasPrefix(a, "-"), "README helm line with a flag the test does not know: %s", cmd)
			pos = append(pos, a)
		}
	}
	require.Len(t, pos, 3, "helm install <release> <chart>: %s", cmd)
	require.Equal(t, "install", pos[0], cmd)
	h.chart = strings.TrimPrefix(pos[2], "manifests/")
	return h
}

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
	for _, cmd := range readmeCommands(t) {
		switch f := strings.Fields(cmd); f[0] {
		case "helm":
			helms++
			h := parseHelm(t, cmd)
			objs := render(t, h.chart, h.namespace, h.values)
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
