//go:build linux

package redirect_test

import (
	"bytes"
	"os"
	"os/exec"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/isthmus-mesh/isthmus/cni/redirect"
)

const (
	applyEnv   = "ISTHMUS_REDIRECT_TEST_APPLY"    // the ztunnel cgroup id
	applyNSEnv = "ISTHMUS_REDIRECT_TEST_APPLY_NS" // set: Options.CgroupNS is fd 4
)

// applyHelper applies the pod rules to fd 3 exempting one cgroup, from
// whatever cgroup namespace it was started in.
func applyHelper() int {
	id, err := strconv.ParseUint(os.Getenv(applyEnv), 10, 64)
	opts := redirect.Options{ZtunnelCgroups: []uint64{id}}
	if os.Getenv(applyNSEnv) != "" {
		opts.CgroupNS = os.NewFile(4, "node-cgroupns")
	}
	if err == nil {
		err = redirect.Apply(os.NewFile(3, "pod"), opts)
	}
	if err != nil {
		os.Stderr.WriteString(err.Error() + "\n")
		return 1
	}
	cg, _ := os.ReadFile("/proc/self/cgroup")
	os.Stdout.Write(cg)
	return 0
}

// applyIn runs Apply in a process placed in cg, in a cgroup namespace of
// its own rooted there (as an agent in a container is); with cgroupNS, as
// Options.CgroupNS.
func applyIn(t *testing.T, ns *os.File, cg *cgroup, ztunnel uint64, cgroupNS *os.File) string {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), applyEnv+"="+strconv.FormatUint(ztunnel, 10))
	cmd.ExtraFiles = []*os.File{ns}
	if cgroupNS != nil {
		cmd.Env = append(cmd.Env, applyNSEnv+"=1")
		cmd.ExtraFiles = append(cmd.ExtraFiles, cgroupNS)
	}
	cmd.SysProcAttr = &unix.SysProcAttr{UseCgroupFD: true, CgroupFD: int(cg.dir.Fd()), Cloneflags: unix.CLONE_NEWCGROUP}
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	require.NoError(t, cmd.Run(), "apply helper: %s", errb.String())
	return out.String()
}

// TestRulesWrittenFromACgroupNamespace: the agent runs in a container, in
// a cgroup namespace rooted at its own cgroup, and ztunnel in another pod:
// often shallower than the agent (a Guaranteed pod's cgroup is one level
// above a Burstable one's). The rules it writes must still exempt
// ztunnel's marked sockets.
func TestRulesWrittenFromACgroupNamespace(t *testing.T) {
	tp := newTopo(t)
	root := testCgroupRoot(t)
	burstable := newCgroup(t, root, "burstable")
	agentPod := newCgroup(t, burstable.path, "agent-pod")
	agent := newCgroup(t, agentPod.path, "agent")
	zt := newCgroup(t, root, "ztunnel") // depth 2; the agent's namespace root is at depth 4
	app := newCgroup(t, agentPod.path, "app")

	out := serve(t, tp.p, "[::]:15001", "outbound")
	qApp := serve(t, tp.q, "[::]:80", "q-app")

	t.Run("from the node's cgroup namespace (Options.CgroupNS) the levels are absolute", func(t *testing.T) {
		// This test runs in the machine's initial cgroup namespace: it
		// plays the node's.
		nodeNS, err := os.Open("/proc/self/ns/cgroup")
		require.NoError(t, err)
		defer nodeNS.Close()
		own := applyIn(t, tp.p, agent, zt.id, nodeNS)
		require.Contains(t, own, "0::/\n", "the writer is at its own namespace's root")
		require.Equal(t, "q-app", dialAs(t, tp.p, zt, ap(tp.q4, 80), redirect.Mark, false))
		qApp.next(t)
		require.Equal(t, "outbound", dialAs(t, tp.p, app, ap(tp.q4, 80), redirect.Mark, true))
		out.next(t)
	})
	t.Run("from the agent's own namespace they count from its root: ztunnel is out of reach", func(t *testing.T) {
		applyIn(t, tp.p, agent, zt.id, nil)
		require.Equal(t, "outbound", dialAs(t, tp.p, zt, ap(tp.q4, 80), redirect.Mark, false))
		out.next(t)
	})
}
