//go:build linux

package zds_test

import (
	"context"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/isthmus-mesh/isthmus/cni/zds"
)

func TestMain(m *testing.M) {
	if os.Getenv(peerEnv) != "" {
		os.Exit(peerHelper())
	}
	goleak.VerifyTestMain(m)
}

type fixture struct {
	srv      *zds.Server
	path     string
	failures sync.Map // reason -> *atomic.Int32
}

func (f *fixture) failed(r zds.FailureReason) int32 {
	v, ok := f.failures.Load(r)
	if !ok {
		return 0
	}
	return v.(*atomic.Int32).Load()
}

func start(t *testing.T, cfg zds.Config) *fixture {
	t.Helper()
	f := &fixture{path: filepath.Join(t.TempDir(), "ztunnel.sock")}
	cfg.SocketPath = f.path
	srv, err := zds.New(cfg, zds.Deps{OnFailure: func(r zds.FailureReason) {
		v, _ := f.failures.LoadOrStore(r, new(atomic.Int32))
		v.(*atomic.Int32).Add(1)
	}})
	require.NoError(t, err)
	f.srv = srv
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
		_, err := os.Stat(f.path)
		require.ErrorIs(t, err, os.ErrNotExist, "the socket file is removed")
	})
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		_, err := os.Stat(f.path)
		assert.NoError(c, err)
	}, 10*time.Second, 10*time.Millisecond)
	return f
}

// peer is a hand-driven ztunnel.
type peer struct {
	t  *testing.T
	uc *net.UnixConn
}

func dial(t *testing.T, path string, version int) *peer {
	t.Helper()
	// The socket file appears at bind, a moment before listen.
	var c net.Conn
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		var err error
		c, err = net.Dial("unixpacket", path)
		assert.NoError(ct, err)
	}, 10*time.Second, 5*time.Millisecond)
	p := &peer{t: t, uc: c.(*net.UnixConn)}
	t.Cleanup(func() { p.uc.Close() })
	if version >= 0 {
		require.NoError(t, zds.Write(p.uc, zds.Hello{Version: version}, nil))
	}
	return p
}

func (p *peer) next() (zds.Request, *os.File) {
	p.t.Helper()
	_ = p.uc.SetReadDeadline(time.Now().Add(10 * time.Second))
	var req zds.Request
	fd, err := zds.Read(p.uc, &req)
	require.NoError(p.t, err)
	require.NoError(p.t, req.Validate(fd != nil))
	if fd != nil {
		p.t.Cleanup(func() { fd.Close() })
	}
	return req, fd
}

func (p *peer) ack(msg string) {
	p.t.Helper()
	require.NoError(p.t, zds.Write(p.uc, zds.Ack{Error: msg}, nil))
}

func nsFile(t *testing.T) *os.File {
	t.Helper()
	f, err := os.Open("/proc/self/ns/net")
	require.NoError(t, err)
	t.Cleanup(func() { f.Close() })
	return f
}

func pod(uid string) zds.Pod {
	return zds.Pod{UID: uid, Name: "pod-" + uid, Namespace: "app", ServiceAccount: "sa",
		IPs: []netip.Addr{netip.MustParseAddr("10.250.1.2")}}
}

func TestSnapshotThenUpdates(t *testing.T) {
	ns := nsFile(t) // closed after the server stops (cleanups run last-first)
	f := start(t, zds.Config{})
	ctx := context.Background()
	require.NoError(t, f.srv.AddPod(ctx, pod("b"), ns), "no ztunnel yet: recorded for the snapshot")
	require.NoError(t, f.srv.AddPod(ctx, pod("a"), ns))
	require.Equal(t, []string{"a", "b"}, f.srv.Pods())

	p := dial(t, f.path, zds.Version)
	for _, uid := range []string{"a", "b"} {
		req, fd := p.next()
		require.NotNil(t, req.Add)
		require.Equal(t, pod(uid), *req.Add)
		require.NotNil(t, fd, "the pod's namespace comes with the add")
		p.ack("")
	}
	req, _ := p.next()
	require.NotNil(t, req.SnapshotSent)
	p.ack("")
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Equal(c, 1, f.srv.Connected()) }, 10*time.Second, 10*time.Millisecond)

	// Live updates wait for the ack; a refusal comes back as an *Error.
	errc := make(chan error, 1)
	go func() { errc <- f.srv.AddPod(ctx, pod("c"), ns) }()
	req, _ = p.next()
	require.Equal(t, "c", req.Add.UID)
	p.ack("no workload for this uid")
	err := <-errc
	var zerr *zds.Error
	require.ErrorAs(t, err, &zerr)
	require.Equal(t, zds.Refused, zerr.Reason)
	require.Equal(t, "no workload for this uid", zerr.Msg)
	require.EqualValues(t, 1, f.failed(zds.Refused))
	require.Equal(t, 1, f.srv.Connected(), "a refusal keeps the connection")

	go func() { errc <- f.srv.DelPod(ctx, "a") }()
	req, fd := p.next()
	require.Nil(t, fd)
	require.Equal(t, "a", req.Del.UID)
	p.ack("")
	require.NoError(t, <-errc)
	require.Equal(t, []string{"b", "c"}, f.srv.Pods())
}

func TestReconnectGetsFullSnapshot(t *testing.T) {
	ns := nsFile(t) // closed after the server stops (cleanups run last-first)
	f := start(t, zds.Config{})
	ctx := context.Background()
	require.NoError(t, f.srv.AddPod(ctx, pod("a"), ns))
	p := dial(t, f.path, zds.Version)
	p.next()
	p.ack("")
	p.next()
	p.ack("")
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Equal(c, 1, f.srv.Connected()) }, 10*time.Second, 10*time.Millisecond)
	p.uc.Close()
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Equal(c, 0, f.srv.Connected()) }, 10*time.Second, 10*time.Millisecond)

	// While ztunnel is away the set changes.
	require.NoError(t, f.srv.AddPod(ctx, pod("b"), ns))
	require.NoError(t, f.srv.DelPod(ctx, "a"))

	p2 := dial(t, f.path, zds.Version)
	req, fd := p2.next()
	require.Equal(t, "b", req.Add.UID)
	require.NotNil(t, fd)
	p2.ack("")
	req, _ = p2.next()
	require.NotNil(t, req.SnapshotSent, "the snapshot has exactly the current pods")
	p2.ack("")
}

func TestUnresponsiveZtunnelIsDropped(t *testing.T) {
	ns := nsFile(t)
	f := start(t, zds.Config{AckTimeout: 200 * time.Millisecond})
	ctx := context.Background()
	p := dial(t, f.path, zds.Version)
	p.next() // the empty snapshot
	p.ack("")
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Equal(c, 1, f.srv.Connected()) }, 10*time.Second, 10*time.Millisecond)

	// Never acked: the ztunnel is dropped, which is not the caller's
	// error (the pod goes in the snapshot of its next connection).
	require.NoError(t, f.srv.AddPod(ctx, pod("a"), ns))
	require.Equal(t, 0, f.srv.Connected())
	require.EqualValues(t, 1, f.failed(zds.Timeout))
	require.Equal(t, []string{"a"}, f.srv.Pods(), "the pod stays enrolled for the next ztunnel")

	p2 := dial(t, f.path, zds.Version)
	req, fd := p2.next()
	require.Equal(t, "a", req.Add.UID)
	require.NotNil(t, fd)
}

func TestBadHelloIsRefused(t *testing.T) {
	f := start(t, zds.Config{})
	p := dial(t, f.path, 99)
	_ = p.uc.SetReadDeadline(time.Now().Add(10 * time.Second))
	var req zds.Request
	_, err := zds.Read(p.uc, &req)
	require.Error(t, err, "the agent closes a connection of another version")
	require.Equal(t, 0, f.srv.Connected())
}

func TestValidate(t *testing.T) {
	cases := []struct {
		name  string
		req   zds.Request
		hasFD bool
		err   string
	}{
		{"add", zds.Request{Add: &zds.Pod{UID: "u"}}, true, ""},
		{"add without fd", zds.Request{Add: &zds.Pod{UID: "u"}}, false, "without its network namespace"},
		{"add without uid", zds.Request{Add: &zds.Pod{}}, true, "without a pod uid"},
		{"del with fd", zds.Request{Del: &zds.DelPod{UID: "u"}}, true, "other than add"},
		{"del without uid", zds.Request{Del: &zds.DelPod{}}, false, "del without a pod uid"},
		{"empty", zds.Request{}, false, "exactly one"},
		{"two", zds.Request{Del: &zds.DelPod{UID: "u"}, SnapshotSent: &zds.SnapshotSent{}}, false, "exactly one"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.req.Validate(tc.hasFD)
			if tc.err == "" {
				require.NoError(t, err)
			} else {
				require.ErrorContains(t, err, tc.err)
			}
		})
	}
	_, err := zds.New(zds.Config{}, zds.Deps{})
	require.ErrorContains(t, err, "SocketPath is required")
}

// snapshotAcked reads and acks a snapshot of n adds, refusing those named.
func (p *peer) snapshotAcked(n int, refuse ...string) {
	p.t.Helper()
	for range n {
		req, _ := p.next()
		require.NotNil(p.t, req.Add)
		msg := ""
		for _, uid := range refuse {
			if req.Add.UID == uid {
				msg = "refused " + uid
			}
		}
		p.ack(msg)
	}
	req, _ := p.next()
	require.NotNil(p.t, req.SnapshotSent)
	p.ack("")
}

// quiet checks that p is sent nothing for a moment.
func (p *peer) quiet() {
	p.t.Helper()
	_ = p.uc.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	var req zds.Request
	_, err := zds.Read(p.uc, &req)
	require.ErrorIs(p.t, err, os.ErrDeadlineExceeded, "nothing sent, got %+v", req)
}

// TestHandOff: several ztunnels are served at once, each with every pod;
// when a newer one has taken every pod, those of version 2 connected before
// it are told HandedOff (a version 1 peer, which would not understand it,
// is not), and a newer one that refused a pod hands nothing off.
func TestHandOff(t *testing.T) {
	ns := nsFile(t)
	f := start(t, zds.Config{})
	ctx := context.Background()
	require.NoError(t, f.srv.AddPod(ctx, pod("a"), ns))
	require.NoError(t, f.srv.AddPod(ctx, pod("b"), ns))

	v1 := dial(t, f.path, 1)
	v1.snapshotAcked(2)
	old := dial(t, f.path, zds.Version)
	old.snapshotAcked(2)
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Equal(c, 2, f.srv.Connected()) }, 10*time.Second, 10*time.Millisecond)
	v1.quiet() // a version 1 ztunnel is never sent HandedOff

	// A successor that refuses a pod does not take them all.
	partial := dial(t, f.path, zds.Version)
	partial.snapshotAcked(2, "b")
	old.quiet()

	newer := dial(t, f.path, zds.Version)
	done := make(chan struct{})
	go func() {
		defer close(done)
		newer.snapshotAcked(2)
	}()
	// Both version 2 ztunnels connected before it are told.
	for _, got := range ackAll(old, partial) {
		require.NotNil(t, got.HandedOff, "%+v", got)
	}
	<-done
	v1.quiet()
	newer.quiet()
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Equal(c, 4, f.srv.Connected()) }, 10*time.Second, 10*time.Millisecond)

	// Every ztunnel still gets every update.
	errc := make(chan error, 1)
	go func() { errc <- f.srv.DelPod(ctx, "a") }()
	for _, got := range ackAll(old, v1, partial, newer) {
		require.NotNil(t, got.Del, "%+v", got)
		require.Equal(t, "a", got.Del.UID)
	}
	require.NoError(t, <-errc)
	require.Equal(t, 4, f.srv.Connected())
}

// ackAll reads one request on each peer and acks it, all at once (the
// server sends to one peer after another, in no set order); a peer that
// reads nothing valid yields an empty Request.
func ackAll(peers ...*peer) []zds.Request {
	out := make([]zds.Request, len(peers))
	var wg sync.WaitGroup
	for i, p := range peers {
		wg.Go(func() {
			_ = p.uc.SetReadDeadline(time.Now().Add(10 * time.Second))
			fd, err := zds.Read(p.uc, &out[i])
			if fd != nil {
				fd.Close()
			}
			if err != nil {
				out[i] = zds.Request{}
				return
			}
			_ = zds.Write(p.uc, zds.Ack{}, nil)
		})
	}
	wg.Wait()
	return out
}

// TestSnapshotWaitsForSync: with WaitForSync a ztunnel that connects to an
// agent still recording its pods gets no snapshot (it would release the
// pods it serves) until MarkSynced, then one with every pod recorded
// meanwhile.
func TestSnapshotWaitsForSync(t *testing.T) {
	ns := nsFile(t)
	var captured atomic.Int32
	f := &fixture{path: filepath.Join(t.TempDir(), "ztunnel.sock")}
	srv, err := zds.New(zds.Config{SocketPath: f.path, WaitForSync: true}, zds.Deps{OnCapture: func(zds.Capture) { captured.Add(1) }})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	t.Cleanup(func() { cancel(); require.NoError(t, <-done) })

	p := dial(t, f.path, zds.Version)
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Positive(c, captured.Load()) }, 10*time.Second, 5*time.Millisecond,
		"the hello is taken (the capture follows it) before the snapshot")
	require.NoError(t, srv.AddPod(context.Background(), pod("a"), ns), "recorded while the agent syncs")
	require.Zero(t, srv.Connected(), "no snapshot before MarkSynced")

	srv.MarkSynced()
	req, fd := p.next()
	require.Equal(t, "a", req.Add.UID)
	require.NotNil(t, fd)
	p.ack("")
	req, _ = p.next()
	require.NotNil(t, req.SnapshotSent)
	p.ack("")
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Equal(c, 1, srv.Connected()) }, 10*time.Second, 10*time.Millisecond)
}
