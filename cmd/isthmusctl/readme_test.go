package main

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/internal/readme"
	"github.com/isthmus-mesh/isthmus/internal/version"
	"github.com/isthmus-mesh/isthmus/pilot/server"
)

// TestReadmeCommands runs every isthmusctl line of the README's
// installation section, as written, against the two real clusters (the
// README's primary.kubeconfig and remote.kubeconfig) and a real pilot of
// cluster-1 in isthmus-system. --pilot stands in for the port-forward the
// README describes. The remote registers, and pilot reports it synced.
func TestReadmeCommands(t *testing.T) {
	cmds, err := readme.Commands("../../README.md", "## Installing on real clusters")
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	primary, remote := clusters.Cluster("primary"), clusters.Cluster("remote")
	require.NoError(t, primary.EnsureNamespace(ctx, "isthmus-system", nil))
	files := map[string]string{
		"primary.kubeconfig": writeKubeconfig(t, "c1", primary.Config),
		"remote.kubeconfig":  writeKubeconfig(t, "c2", remote.Config),
	}

	p, err := server.New(server.Config{Namespace: "isthmus-system", ClusterID: "cluster-1", Network: "network1", NoLeaderElection: true,
		DebugAddr: "127.0.0.1:0", MonitoringAddr: "-", GRPCAddr: "-", Logger: slog.New(slog.DiscardHandler)}, primary.Config, nil)
	require.NoError(t, err)
	pctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- p.Run(pctx) }()
	t.Cleanup(func() {
		stop()
		require.NoError(t, <-done)
		_ = primary.Client.CoreV1().Secrets("isthmus-system").Delete(context.Background(), "istio-remote-secret-cluster-2", metav1.DeleteOptions{})
	})
	require.Eventually(t, func() bool { return p.DebugAddr() != "" }, 20*time.Second, 10*time.Millisecond)
	pilot := "http://" + p.DebugAddr()

	ran := map[string]string{}
	for _, cmd := range cmds {
		f := strings.Fields(cmd)
		if f[0] != "bin/isthmusctl" {
			continue // make and helm lines: internal/imagebuild, hack/images and manifests run them
		}
		args := f[1:]
		for i, a := range args {
			if path, ok := files[a]; ok {
				args[i] = path
			}
		}
		if args[0] == "version" || args[0] == "remote-clusters" {
			args = append(args, "--pilot", pilot)
		}
		if args[0] == "remote-clusters" {
			// pilot syncs the remote in the background: ask until it has.
			require.EventuallyWithT(t, func(c *assert.CollectT) {
				out, _, err := runCtl(t, args...)
				require.NoError(c, err)
				ran[args[0]] = out
				_, rows := parseTable(t, out)
				states := map[string]string{}
				for _, r := range rows {
					states[r[0]] = r[1]
				}
				require.Equal(c, "synced", states["cluster-2"], out)
			}, 60*time.Second, 100*time.Millisecond)
			continue
		}
		out, stderr, err := runCtl(t, args...)
		require.NoError(t, err, "%s: %s", cmd, stderr)
		ran[args[0]] = out
	}
	require.Equal(t, "secret/istio-remote-secret-cluster-2 created in namespace isthmus-system of the primary cluster ("+primary.Host()+")\n",
		ran["create-remote-secret"])
	require.Equal(t, "client: "+version.String()+"\nserver: "+version.String()+"\n", ran["version"])
	require.Contains(t, ran, "remote-clusters")
}
