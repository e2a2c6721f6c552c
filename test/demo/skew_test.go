//go:build linux

package demo_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/test/demo"
)

// TestVersionSkew runs the isolated demo with one component of the
// previous release (make previous builds it from PREVIOUS_COMMIT into
// $ISTHMUS_PREVIOUSBIN) and the rest of today's: every ztunnel (nodes and
// gateways) one release older than pilot, pilot one release older than the
// ztunnels, and the CNI agent one release older than its ztunnel. In each,
// the xDS stream, the CSR of every ztunnel, the node protocol between agent
// and ztunnel and HBONE between old and new proxies carry the demo's story:
// the cross-network request through the gateway, the same-network endpoint
// preferred, and failover when it goes unready.
func TestVersionSkew(t *testing.T) {
	prev := os.Getenv("ISTHMUS_PREVIOUSBIN")
	require.NotEmpty(t, prev, "ISTHMUS_PREVIOUSBIN is not set: make previous builds the previous release's binaries and make test sets it")
	commit, err := os.ReadFile(filepath.Join(prev, "COMMIT"))
	require.NoError(t, err, "ISTHMUS_PREVIOUSBIN=%s holds no build of make previous", prev)
	previous := strings.TrimSpace(string(commit))
	today := binDir(t)

	// The flags each previous component is started with are its release's:
	// today's demo gives the agent --state-dir, which came later.
	args := map[string]func([]string) []string{"isthmus-cni": withoutFlag("--state-dir")}
	for _, old := range []string{"ztunnel", "pilot", "isthmus-cni"} {
		t.Run("previous "+old, func(t *testing.T) {
			bin := skewBinDir(t, today, prev, old)
			out, err := exec.Command(filepath.Join(bin, old), "--version").CombinedOutput()
			require.NoError(t, err, "%s", out)
			require.Contains(t, string(out), previous, "the %s in use is the previous release's", old)
			t.Logf("%s: %s", old, strings.TrimSpace(string(out)))

			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			var narration strings.Builder
			work := t.TempDir()
			defer dumpLogsOnFailure(t, work)
			d, err := demo.Start(ctx, demo.Config{BinDir: bin, Out: &narration, WorkDir: work, AgentArgs: args[old]})
			require.NoError(t, err, narration.String())
			defer d.Stop()

			requestCrossesGateway(ctx, t, d)
			require.NoError(t, d.AddLocalEcho(ctx))
			requireLocal(ctx, t, d)
			failover(ctx, t, d, "the local endpoint went unready", func() error { return d.SetLocalEchoReady(ctx, false) })
		})
	}
}

// skewBinDir is a folder of today's binaries (from today) in which old is
// the previous release's (from prev).
func skewBinDir(t *testing.T, today, prev, old string) string {
	t.Helper()
	dir := t.TempDir()
	require.NoError(t, os.Chmod(dir, 0o755))
	entries, err := os.ReadDir(today)
	require.NoError(t, err)
	for _, e := range entries {
		src := filepath.Join(today, e.Name())
		if e.Name() == old {
			src = filepath.Join(prev, old)
		}
		require.NoError(t, os.Symlink(src, filepath.Join(dir, e.Name())))
	}
	_, err = os.Stat(filepath.Join(dir, old))
	require.NoError(t, err, "%s of the previous release", old)
	return dir
}

// withoutFlag drops flag and its value from a command line.
func withoutFlag(flag string) func([]string) []string {
	return func(args []string) []string {
		out := make([]string, 0, len(args))
		for i := 0; i < len(args); i++ {
			if args[i] == flag {
				i++
				continue
			}
			out = append(out, args[i])
		}
		return out
	}
}
