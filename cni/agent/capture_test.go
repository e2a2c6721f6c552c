//go:build linux

package agent_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/isthmus-mesh/isthmus/cni/redirect"
	"github.com/isthmus-mesh/isthmus/ztunnel/inpod"
	"github.com/isthmus-mesh/isthmus/ztunnel/inpod/inpodtest"
)

// exemption is what a pod's rules leave uncaptured.
type exemption struct {
	cgroups  []uint64
	markOnly bool
}

func exemptionOf(t require.TestingT, p *pod) exemption {
	cg, mo, err := redirect.Exemption(p.ns)
	require.NoError(t, err)
	return exemption{cg, mo}
}

// seeingHandler records, as each pod reaches ztunnel, what that pod's
// rules exempt at that moment.
type seeingHandler struct {
	*inpodtest.Handler
	mu   sync.Mutex
	seen []exemption
}

func (h *seeingHandler) AddPod(ctx context.Context, p inpod.Pod, ns *os.File) error {
	cg, mo, err := redirect.Exemption(ns)
	if err != nil {
		return err
	}
	h.mu.Lock()
	h.seen = append(h.seen, exemption{cg, mo})
	h.mu.Unlock()
	return h.Handler.AddPod(ctx, p, ns)
}

func (h *seeingHandler) first(t *testing.T) exemption {
	t.Helper()
	var got exemption
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		h.mu.Lock()
		defer h.mu.Unlock()
		if assert.NotEmpty(ct, h.seen) {
			got = h.seen[0]
		}
	}, 20*time.Second, 20*time.Millisecond)
	return got
}

// testCgroup makes a cgroup v2 directory and returns a /proc/self/cgroup
// file naming it, and its id.
func testCgroup(t *testing.T) (string, uint64) {
	t.Helper()
	const root = "/sys/fs/cgroup/unified"
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	rel := "/isthmus-test-" + hex.EncodeToString(b)
	require.NoError(t, os.Mkdir(root+rel, 0o755), "create a test cgroup (needs root and a writable cgroup2 at %s)", root)
	t.Cleanup(func() { require.NoError(t, os.Remove(root+rel)) })
	var st unix.Stat_t
	require.NoError(t, unix.Stat(root+rel, &st))
	return procCgroup(t, "0::"+rel+"\n"), st.Ino
}

func procCgroup(t *testing.T, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "cgroup")
	require.NoError(t, os.WriteFile(p, []byte(content), 0o600))
	return p
}

// startZtunnelIn runs a ztunnel that reports the cgroup procFile names.
func (e *env) startZtunnelIn(procFile string) (*seeingHandler, func()) {
	e.t.Helper()
	h := &seeingHandler{Handler: inpodtest.New(e.t)}
	c, err := inpod.New(inpod.Config{SocketPath: e.zSock, InitialBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond,
		ProcCgroup: procFile, CgroupMounts: []string{"/sys/fs/cgroup/unified"}}, inpod.Deps{Handler: h})
	require.NoError(e.t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			require.NoError(e.t, <-done)
			h.Close()
		})
	}
	e.t.Cleanup(stop)
	require.EventuallyWithT(e.t, func(ct *assert.CollectT) { assert.True(ct, c.Synced()) }, 20*time.Second, 20*time.Millisecond)
	return h, stop
}

// TestCaptureFollowsZtunnels: the enrolled pods' rules exempt exactly the
// marked sockets of the connected ztunnels' cgroups, and a new ztunnel's
// cgroup is in them before it hears of any pod (else its own connections
// from inside the pod would be captured and loop back to it).
func TestCaptureFollowsZtunnels(t *testing.T) {
	e := newEnv(t)
	cfg := e.config()
	// This test runs in the machine's initial cgroup namespace: it plays
	// the node's.
	cfg.NodeCgroupNS = "/proc/self/ns/cgroup"
	e.startAgent(cfg)
	a := e.addPod(1, e.mesh, "a")
	e.create(a, nil, false)
	require.NoError(t, e.cni("ADD", a, a.ip).err)
	require.Equal(t, exemption{}, exemptionOf(t, a), "no ztunnel known: nothing is exempt")

	proc1, id1 := testCgroup(t)
	h1, stop1 := e.startZtunnelIn(proc1)
	require.Equal(t, exemption{cgroups: []uint64{id1}}, h1.first(t), "exempt before the snapshot")
	require.Equal(t, 0.0, metric(t, e.reg, "isthmus_cni_capture_mark_only", nil))

	proc2, id2 := testCgroup(t)
	h2, stop2 := e.startZtunnelIn(proc2)
	both := []uint64{id1, id2}
	slices.Sort(both)
	require.Equal(t, exemption{cgroups: both}, h2.first(t), "two ztunnels during a restart: both exempt")
	require.Equal(t, 2.0, metric(t, e.reg, "isthmus_cni_capture_ztunnel_cgroups", nil))

	stop1()
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		assert.Equal(ct, exemption{cgroups: []uint64{id2}}, exemptionOf(ct, a))
	}, 20*time.Second, 20*time.Millisecond, "the one that left is no longer exempt")

	// A ztunnel that cannot name its cgroup (cgroup v1 only, or Istio's).
	h3, stop3 := e.startZtunnelIn(procCgroup(t, "4:memory:/x\n"))
	require.Equal(t, exemption{markOnly: true}, h3.first(t))
	require.Equal(t, 1.0, metric(t, e.reg, "isthmus_cni_capture_mark_only", nil))
	stop3()
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		assert.Equal(ct, exemption{cgroups: []uint64{id2}}, exemptionOf(ct, a))
	}, 20*time.Second, 20*time.Millisecond)
	require.Equal(t, 0.0, metric(t, e.reg, "isthmus_cni_capture_mark_only", nil))

	// A pod enrolled now gets the current exemption.
	b := e.addPod(2, e.mesh, "b")
	e.create(b, nil, false)
	require.NoError(t, e.cni("ADD", b, b.ip).err)
	require.Equal(t, exemption{cgroups: []uint64{id2}}, exemptionOf(t, b))
	require.NoError(t, e.cni("CHECK", b, b.ip).err, "CHECK counts the exemption's rules")

	// The last ztunnel leaves: the exemption stays (its id exempts
	// nothing once it is gone).
	stop2()
	require.Equal(t, exemption{cgroups: []uint64{id2}}, exemptionOf(t, a))

	// The agent restarts; until a ztunnel says hello to it, the pods it
	// takes back keep their exemption (a ztunnel still serving them
	// reconnects: its own connections must not be captured meanwhile and
	// loop back to it).
	e.running(a)
	e.running(b)
	e.stopAgent()
	e.startAgent(cfg)
	require.Equal(t, 2.0, metric(t, e.reg, "isthmus_cni_enrolled_pods", nil))
	require.Equal(t, 0.0, metric(t, e.reg, "isthmus_cni_ztunnel_connections", nil))
	for _, p := range []*pod{a, b} {
		require.Equal(t, exemption{cgroups: []uint64{id2}}, exemptionOf(t, p), "pod %s keeps its exemption", p.name)
		require.NoError(t, e.cni("CHECK", p, p.ip).err)
	}
	h4, _ := e.startZtunnelIn(proc2)
	require.Equal(t, exemption{cgroups: []uint64{id2}}, h4.first(t))
}
