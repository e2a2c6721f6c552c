package main

import (
	"context"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/internal/readme"
	"github.com/isthmus-mesh/isthmus/internal/version"
)

// TestReadmeCommands runs every isthmusctl line of the README's
// installation section as written (bin/isthmusctl, built and stamped as
// make build does, in a directory holding the README's primary.kubeconfig
// and remote.kubeconfig for the two real clusters) against a real pilot of
// cluster-1 in isthmus-system; --pilot stands in for the port-forward the
// README describes. The remote registers, and pilot reports it synced.
func TestReadmeCommands(t *testing.T) {
	cmds, err := readme.Commands("../../README.md", "## Installing on real clusters")
	require.NoError(t, err)
	primary, remote := clusters.Cluster("primary"), clusters.Cluster("remote")
	dir := t.TempDir()
	for name, cfg := range map[string]string{
		"primary.kubeconfig": writeKubeconfig(t, "c1", primary.Config),
		"remote.kubeconfig":  writeKubeconfig(t, "c2", remote.Config),
	} {
		b, err := os.ReadFile(cfg)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), b, 0o600))
	}
	pilot := runPilot(t, "isthmus-system", "cluster-1", "network1")
	t.Cleanup(func() {
		_ = primary.Client.CoreV1().Secrets("isthmus-system").Delete(context.Background(), "istio-remote-secret-cluster-2", metav1.DeleteOptions{})
	})

	ran := map[string]string{}
	for _, cmd := range cmds {
		f := strings.Fields(cmd)
		if f[0] != "bin/isthmusctl" {
			continue // make and helm lines: internal/imagebuild, hack/images and manifests run them
		}
		args := f[1:]
		if args[0] == "version" || args[0] == "remote-clusters" {
			args = append(args, "--pilot", pilot)
		}
		if args[0] == "remote-clusters" {
			// pilot syncs the remote in the background: ask until it has.
			require.EventuallyWithT(t, func(c *assert.CollectT) {
				out, stderr, err := runBinary(t, dir, args...)
				require.NoError(c, err, stderr)
				ran[args[0]] = out
				_, rows := parseTable(t, out)
				states := map[string]string{}
				for _, r := range rows {
					states[r[0]] = r[1]
				}
				require.Equal(c, "synced", states["cluster-2"], out)
			}, 60*time.Second, 200*time.Millisecond)
			continue
		}
		out, stderr, err := runBinary(t, dir, args...)
		require.NoError(t, err, "%s: %s", cmd, stderr)
		ran[args[0]] = out
	}
	require.Equal(t, "secret/istio-remote-secret-cluster-2 created in namespace isthmus-system of the primary cluster ("+primary.Host()+")\n",
		ran["create-remote-secret"])
	client := version.Info{Version: binVersion, Commit: binCommit, GoVersion: runtime.Version()}
	require.Equal(t, "client: "+client.String()+"\nserver: "+version.String()+"\n", ran["version"])
	require.Contains(t, ran, "remote-clusters")
}
