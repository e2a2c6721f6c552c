//go:build linux

package demo_test

import (
	"bytes"
	"log/slog"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/test/demo/realnodes"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// TestRealNodesStory runs `isthmus-demo --real-nodes --once` in-process:
// two real-node clusters, the README's install, echo only in cluster-2 and
// sleep in cluster-1. The reply must come from the echo pod (the server
// answers with its pod's hostname), across network-2's gateway (its
// counters moved), and the narration must say so.
func TestRealNodesStory(t *testing.T) {
	var out bytes.Buffer
	st, err := realnodes.Run(t.Context(), realnodes.Config{
		ModuleDir: filepath.Join("..", ".."), WorkDir: t.TempDir(), Once: true, Out: &out,
		Log: slog.New(slog.NewTextHandler(framework.TestWriter(t), nil)),
	})
	t.Logf("narration:\n%s", out.String())
	require.NoError(t, err)

	assert.Equal(t, "isthmus realnode server "+realnodes.EchoPod+"\n", st.Reply, "the reply comes from the echo pod")
	assert.Equal(t, realnodes.EchoPod, st.Echo.Name)
	assert.Equal(t, "cluster-2", st.Echo.Cluster)
	assert.Equal(t, "network2", st.Echo.Network)
	assert.Equal(t, "cluster-1", st.Sleep.Cluster)
	assert.NotEqual(t, st.Sleep.Node, st.Echo.Node)
	assert.Positive(t, st.Path.ClientZtunnel, "sleep's ztunnel carried the connection")
	assert.Positive(t, st.Path.GatewayBytes, "network-2's gateway carried the request")
	assert.Positive(t, st.Path.ServerZtunnel, "echo's ztunnel delivered it")
	assert.Positive(t, st.RSSBytes)

	narration := out.String()
	assert.Contains(t, narration, "reply: isthmus realnode server "+realnodes.EchoPod+"\n")
	assert.Contains(t, narration, "from:  "+realnodes.EchoPod+" (cluster-2, network2, node "+st.Echo.Node+", "+st.Echo.IP.String()+")")
	assert.Contains(t, narration, "east-west gateway network2 "+st.Gateway.String())
	assert.Contains(t, narration, "xDS and CA at "+st.XDS.String())
	assert.Contains(t, narration, "==> stopping everything")
}

// TestRealNodesNeedRoot: without root, --real-nodes says so in one line
// before it starts anything.
func TestRealNodesNeedRoot(t *testing.T) {
	bin := binDir(t)
	cmd := exec.Command(filepath.Join(bin, "isthmus-demo"), "--real-nodes", "--once")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit, "stderr: %s", stderr.String())
	assert.Equal(t, 1, exit.ExitCode())
	assert.Empty(t, stdout.String(), "nothing started")
	msg := strings.TrimSuffix(stderr.String(), "\n")
	assert.NotContains(t, msg, "\n", "one line")
	assert.Contains(t, msg, "needs root")
}
