//go:build linux

package zds_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/cni/zds"
)

// captureServer starts a server whose OnCapture reports on got and waits
// for release before it returns (the agent re-writing the pods' rules).
func captureServer(t *testing.T) (*zds.Server, string, chan zds.Capture, chan struct{}) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "ztunnel.sock")
	got, release := make(chan zds.Capture, 16), make(chan struct{}, 16)
	srv, err := zds.New(zds.Config{SocketPath: path}, zds.Deps{OnCapture: func(c zds.Capture) {
		got <- c
		<-release
	}})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		close(release)
		require.NoError(t, <-done)
	})
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		_, err := os.Stat(path)
		assert.NoError(c, err)
	}, 10*time.Second, 10*time.Millisecond)
	return srv, path, got, release
}

func hello(t *testing.T, path string, cgroup uint64) *peer {
	t.Helper()
	p := dial(t, path, -1) // no hello yet
	return p.hello(cgroup)
}

// hello says hello as a version 1 ztunnel: it is sent no HandedOff when a
// newer one connects (TestHandOff covers that).
func (p *peer) hello(cgroup uint64) *peer {
	require.NoError(p.t, zds.Write(p.uc, zds.Hello{Version: 1, CgroupID: cgroup}, nil))
	return p
}

func nextCapture(t *testing.T, got chan zds.Capture) zds.Capture {
	t.Helper()
	select {
	case c := <-got:
		return c
	case <-time.After(10 * time.Second):
		t.Fatal("no OnCapture")
		return zds.Capture{}
	}
}

func TestCaptureFollowsConnectedZtunnels(t *testing.T) {
	ns := nsFile(t)
	srv, path, got, release := captureServer(t)
	require.NoError(t, srv.AddPod(context.Background(), pod("a"), ns))

	// A new ztunnel's cgroup is exempt BEFORE it hears of any pod.
	p1 := hello(t, path, 5000)
	require.Equal(t, zds.Capture{Cgroups: []uint64{5000}}, nextCapture(t, got))
	var req zds.Request
	_ = p1.uc.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	_, err := zds.Read(p1.uc, &req)
	require.Error(t, err, "no snapshot while the pods' rules are being re-written")
	release <- struct{}{}
	req, _ = p1.next()
	require.Equal(t, "a", req.Add.UID)
	p1.ack("")
	req, _ = p1.next()
	require.NotNil(t, req.SnapshotSent)
	p1.ack("")

	// A second one (a restart, make-before-break): both exempt.
	p2 := hello(t, path, 6000)
	require.Equal(t, zds.Capture{Cgroups: []uint64{5000, 6000}}, nextCapture(t, got))
	release <- struct{}{}
	p2.next()
	p2.ack("")
	p2.next()
	p2.ack("")
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Equal(c, 2, srv.Connected()) }, 10*time.Second, 10*time.Millisecond)

	// The first leaves: only the second stays exempt.
	p1.uc.Close()
	require.Equal(t, zds.Capture{Cgroups: []uint64{6000}}, nextCapture(t, got))
	release <- struct{}{}

	// A ztunnel without a cgroup id (Istio's), or in the root cgroup:
	// the mark alone.
	for _, id := range []uint64{0, zds.RootCgroupID} {
		p3 := hello(t, path, id)
		require.Equal(t, zds.Capture{Cgroups: []uint64{6000}, MarkOnly: true}, nextCapture(t, got))
		release <- struct{}{}
		p3.next()
		p3.ack("")
		p3.next()
		p3.ack("")
		p3.uc.Close()
		require.Equal(t, zds.Capture{Cgroups: []uint64{6000}}, nextCapture(t, got))
		release <- struct{}{}
	}

	// A bad hello changes nothing; the last ztunnel leaving neither.
	dial(t, path, 99)
	p2.uc.Close()
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Equal(c, 0, srv.Connected()) }, 10*time.Second, 10*time.Millisecond)
	select {
	case c := <-got:
		t.Fatalf("unexpected OnCapture %+v", c)
	case <-time.After(200 * time.Millisecond):
	}
	require.Equal(t, zds.Capture{Cgroups: []uint64{6000}}, srv.Capture())
}
