//go:build linux

package inpod_test

import (
	"bufio"
	"context"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/isthmus-mesh/isthmus/cni/zds"
	"github.com/isthmus-mesh/isthmus/ztunnel/inpod"
	"github.com/isthmus-mesh/isthmus/ztunnel/inpod/inpodtest"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns/netnstest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// agent runs a zds.Server on path until the returned stop is called.
func agent(t *testing.T, path string) (*zds.Server, func()) {
	t.Helper()
	srv, err := zds.New(zds.Config{SocketPath: path}, zds.Deps{})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			cancel()
			require.NoError(t, <-done)
		}
	}
	t.Cleanup(stop)
	return srv, stop
}

// ztunnel runs a Client with handler h until the returned stop is called.
func ztunnel(t *testing.T, path string, h inpod.PodHandler) (*inpod.Client, func()) {
	t.Helper()
	c, err := inpod.New(inpod.Config{SocketPath: path, InitialBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond},
		inpod.Deps{Handler: h})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			cancel()
			require.NoError(t, <-done)
		}
	}
	t.Cleanup(stop)
	return c, stop
}

func pod(uid string) zds.Pod {
	return zds.Pod{UID: uid, Name: uid, Namespace: "app", ServiceAccount: "sa"}
}

// answer dials port on the loopback inside ns and returns the answering
// listener's line, or the dial error.
func answer(ns *os.File, port uint16) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := (&netns.Dialer{NetNS: ns}).DialContext(ctx, "tcp", netip.AddrPortFrom(netip.IPv6Loopback(), port).String())
	if err != nil {
		return "", err
	}
	defer c.Close()
	line, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line), err
}

func TestClientServesPodsInTheirNamespaces(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ztunnel.sock")
	srv, _ := agent(t, path)
	ctx := context.Background()
	nsA, nsB, nsC := netnstest.New(t), netnstest.New(t), netnstest.New(t)
	require.NoError(t, srv.AddPod(ctx, pod("a"), nsA))
	require.NoError(t, srv.AddPod(ctx, pod("b"), nsB))

	h := inpodtest.New(t)
	c, _ := ztunnel(t, path, h)
	require.EventuallyWithT(t, func(ct *assert.CollectT) { assert.True(ct, c.Synced()) }, 10*time.Second, 10*time.Millisecond)
	require.Equal(t, []string{"a", "b"}, h.Pods())
	require.Equal(t, []string{"add a", "add b", "snapshot [a b]"}, h.Calls())

	// Each pod's listeners live in its own namespace.
	got, err := answer(nsA, 15001)
	require.NoError(t, err)
	require.Equal(t, "a 15001", got)
	got, err = answer(nsB, 15008)
	require.NoError(t, err)
	require.Equal(t, "b 15008", got)
	_, err = answer(nsC, 15001)
	require.ErrorIs(t, err, unix.ECONNREFUSED, "nothing listens in a namespace that was not sent")

	// A refusal travels back to the agent as the add's error.
	h.Refuse("c")
	err = srv.AddPod(ctx, pod("c"), nsC)
	var zerr *zds.Error
	require.ErrorAs(t, err, &zerr)
	require.Equal(t, zds.Refused, zerr.Reason)
	require.Contains(t, zerr.Msg, "refused c")

	require.NoError(t, srv.DelPod(ctx, "a"))
	require.Equal(t, []string{"b"}, h.Pods())
	_, err = answer(nsA, 15001)
	require.ErrorIs(t, err, unix.ECONNREFUSED)
}

func TestReconnectAfterAgentOrZtunnelRestart(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ztunnel.sock")
	ctx := context.Background()
	nsA, nsB := netnstest.New(t), netnstest.New(t)
	srv, stopAgent := agent(t, path)
	require.NoError(t, srv.AddPod(ctx, pod("a"), nsA))

	h := inpodtest.New(t)
	c, stopZtunnel := ztunnel(t, path, h)
	require.EventuallyWithT(t, func(ct *assert.CollectT) { assert.True(ct, c.Synced()) }, 10*time.Second, 10*time.Millisecond)

	// The agent restarts with another set: the client reconnects by itself
	// and the snapshot makes the handler drop what is no longer enrolled,
	// while it kept serving in between.
	stopAgent()
	require.EventuallyWithT(t, func(ct *assert.CollectT) { assert.False(ct, c.Synced()) }, 10*time.Second, 10*time.Millisecond)
	got, err := answer(nsA, 15001)
	require.NoError(t, err, "pods are served while the agent is away")
	require.Equal(t, "a 15001", got)
	srv2, _ := agent(t, path)
	require.NoError(t, srv2.AddPod(ctx, pod("b"), nsB))
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		assert.True(ct, c.Synced())
		assert.Equal(ct, []string{"b"}, h.Pods())
	}, 10*time.Second, 10*time.Millisecond)
	require.Contains(t, h.Calls(), "snapshot [b]")

	// ztunnel restarts: a new process (handler) gets the full snapshot.
	stopZtunnel()
	h.Close()
	require.NoError(t, srv2.AddPod(ctx, pod("a"), nsA))
	h2 := inpodtest.New(t)
	c2, _ := ztunnel(t, path, h2)
	require.EventuallyWithT(t, func(ct *assert.CollectT) { assert.True(ct, c2.Synced()) }, 10*time.Second, 10*time.Millisecond)
	require.Equal(t, []string{"add a", "add b", "snapshot [a b]"}, h2.Calls())
	got, err = answer(nsA, 15006)
	require.NoError(t, err)
	require.Equal(t, "a 15006", got)
}

func TestNewValidates(t *testing.T) {
	_, err := inpod.New(inpod.Config{}, inpod.Deps{Handler: inpodtest.New(t)})
	require.ErrorContains(t, err, "SocketPath")
	_, err = inpod.New(inpod.Config{SocketPath: "x"}, inpod.Deps{})
	require.ErrorContains(t, err, "Handler")
}

// TestHandedOffWhenASuccessorHasEveryPod: two ztunnels connected at once
// each serve every pod (in their own listeners); once the second has taken
// them all, the first is told it may drain, the second is not.
func TestHandedOffWhenASuccessorHasEveryPod(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ztunnel.sock")
	srv, _ := agent(t, path)
	ctx := context.Background()
	nsA := netnstest.New(t)
	require.NoError(t, srv.AddPod(ctx, pod("a"), nsA))

	h1 := inpodtest.New(t, 16001)
	c1, _ := ztunnel(t, path, h1)
	require.EventuallyWithT(t, func(ct *assert.CollectT) { assert.True(ct, c1.Synced()) }, 10*time.Second, 10*time.Millisecond)
	select {
	case <-c1.HandedOff():
		t.Fatal("handed off with no successor")
	default:
	}
	h2 := inpodtest.New(t, 17001)
	c2, _ := ztunnel(t, path, h2)
	select {
	case <-c1.HandedOff():
	case <-time.After(10 * time.Second):
		t.Fatal("the first ztunnel was not told of its successor")
	}
	require.True(t, c2.Synced())
	// Through the server's lock: the test sees its snapshots as done.
	require.EventuallyWithT(t, func(ct *assert.CollectT) { assert.Equal(ct, 2, srv.Connected()) }, 10*time.Second, 10*time.Millisecond)
	require.Equal(t, []string{"a"}, h2.Pods())
	select {
	case <-c2.HandedOff():
		t.Fatal("the successor was told to hand off")
	default:
	}
	for port, want := range map[uint16]string{16001: "a 16001", 17001: "a 17001"} {
		got, err := answer(nsA, port)
		require.NoError(t, err)
		require.Equal(t, want, got, "both serve the pod")
	}
}

// TestOlderAgent: an agent of the previous release knows only version 1 of
// the protocol and closes the connection on any other hello. The ztunnel
// says version 1 on its next attempt, takes the agent's snapshot, and
// starts from the newest version again when that connection ends.
func TestOlderAgent(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ztunnel.sock")
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	require.NoError(t, err)
	t.Cleanup(func() { ln.Close() })
	versions := make(chan int, 16)
	served := make(chan struct{})
	go func() {
		defer close(served)
		for synced := 0; synced < 2; {
			c, err := ln.AcceptUnix()
			if err != nil {
				return
			}
			var hello zds.Hello
			if _, err := zds.Read(c, &hello); err != nil {
				c.Close()
				return
			}
			versions <- hello.Version
			if hello.Version == 1 {
				// As the previous agent: an empty snapshot, its ack, then
				// the connection ends (the agent restarts).
				var ack zds.Ack
				if zds.Write(c, zds.Request{SnapshotSent: &zds.SnapshotSent{}}, nil) == nil {
					_, _ = zds.Read(c, &ack)
				}
				synced++
			}
			c.Close()
		}
	}()
	h := inpodtest.New(t)
	_, stop := ztunnel(t, path, h)
	select {
	case <-served:
	case <-time.After(30 * time.Second):
		t.Fatal("the ztunnel never said a version the older agent knows")
	}
	stop()
	close(versions)
	var got []int
	for v := range versions {
		got = append(got, v)
	}
	require.Equal(t, []int{zds.Version, 1, zds.Version, 1}, got, "newest first, then the older agent's, on each connection")
	require.Contains(t, h.Calls(), "snapshot []", "the older agent's snapshot reached the handler")
}
