package node_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/cni/zds"
	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
	"github.com/isthmus-mesh/isthmus/ztunnel/inpod"
	"github.com/isthmus-mesh/isthmus/ztunnel/inpod/inpodtest"
	"github.com/isthmus-mesh/isthmus/ztunnel/internal/catest"
	"github.com/isthmus-mesh/isthmus/ztunnel/node"
)

// echoOnce writes msg on c and reads it back.
func echoOnce(c net.Conn, msg string) error {
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	defer c.SetDeadline(time.Time{})
	if _, err := io.WriteString(c, msg); err != nil {
		return err
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		return err
	}
	if string(got) != msg {
		return fmt.Errorf("echo %q, sent %q", got, msg)
	}
	return nil
}

// TestNodeHandoff: node mode, listeners in ztunnel's own namespace. A
// second ztunnel for node-b binds the inbound listener on its pod's
// address beside the first one's (SO_REUSEPORT); the first, stopped as
// SIGTERM stops it, waits its HandoffWait, stops accepting and sends its
// HBONE clients away (GOAWAY), keeps its established connections for
// DrainGrace and then closes them and returns. Meanwhile a stream of new
// connections from node-a's client to node-b's pod never fails.
func TestNodeHandoff(t *testing.T) {
	const long = 20
	a1, b1 := nextAddr(), nextAddr()
	startEcho(t, b1)
	ca := catest.Start(t, catest.Options{ConfigCluster: "c1", Listen: netip.AddrPortFrom(nextAddr(), 0).String()})
	ca.AddNode(t, "token-a", "c1", "node-a")
	ca.AddNode(t, "token-b", "c1", "node-b")
	ca.Place("c1", "node-a", "default", "client", true)
	ca.Place("c1", "node-b", "default", "echo", true)
	xc := cache.NewLinearCache(workloadv1.TypeURL, cache.WithInitialResources(map[string]types.Resource{
		"c1/default/a1": pod("c1/default/a1", "client", "node-a", "c1", a1, nil),
		"c1/default/b1": pod("c1/default/b1", "echo", "node-b", "c1", b1, backs(echoKey)),
		echoKey:         service("echo", netip.MustParseAddr("10.96.0.10")),
	}))
	xdsAddr := startXDS(t, xc, nextAddr(), nil)
	drain := func(c *node.Config) { c.HandoffWait, c.DrainGrace = 100*time.Millisecond, 3*time.Second }
	ready := func(z *ztunnel) {
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			code, _ := httpGet(c, z.readyURL)
			require.Equal(c, http.StatusOK, code)
		}, 15*time.Second, 20*time.Millisecond)
	}
	za := startNode(t, "node-a", "c1", "token-a", xdsAddr, ca)
	old := startNode(t, "node-b", "c1", "token-b", xdsAddr, ca, drain)
	ready(za)
	ready(old)

	var lived []net.Conn
	for i := range long {
		c, code, err := socksConnect(za.socks, a1, echoHost, svcPort)
		require.NoError(t, err)
		require.Zero(t, code)
		t.Cleanup(func() { c.Close() })
		require.NoError(t, echoOnce(c, fmt.Sprintf("long %d;", i)))
		lived = append(lived, c)
	}
	alive := func() (n int) {
		for i, c := range lived {
			if echoOnce(c, fmt.Sprintf("still %d;", i)) == nil {
				n++
			}
		}
		return n
	}

	var ok, failed atomic.Int64
	var lastErr atomic.Value
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 3 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				err := func() error {
					c, code, err := socksConnect(za.socks, a1, echoHost, svcPort)
					if err != nil {
						return err
					}
					defer c.Close()
					if code != 0 {
						return fmt.Errorf("socks reply %d", code)
					}
					return echoOnce(c, fmt.Sprintf("new %d/%d;", w, i))
				}()
				if err != nil {
					failed.Add(1)
					lastErr.Store(err.Error())
					continue
				}
				ok.Add(1)
			}
		})
	}
	defer func() { close(stop); wg.Wait() }()
	more := func(n int64) {
		target := ok.Load() + n
		require.EventuallyWithT(t, func(c *assert.CollectT) { assert.GreaterOrEqual(c, ok.Load(), target) }, 30*time.Second, 10*time.Millisecond)
	}
	more(10)
	successor := startNode(t, "node-b", "c1", "token-b", xdsAddr, ca, drain)
	ready(successor)
	more(10)

	stopped := make(chan error, 1)
	go func() { stopped <- old.stop() }()
	more(30) // past the handoff wait: the old ztunnel accepts no more
	require.Equal(t, long, alive(), "established connections survive within the grace period")
	require.NoError(t, <-stopped)
	more(10)
	require.Zero(t, alive(), "closed at the end of the grace period")
	require.Zero(t, failed.Load(), "no new connection failed (last error: %v)", lastErr.Load())
}

// startAgent runs the CNI agent's side of the node protocol on a socket
// of its own until the test ends, and returns it and the socket's path.
func startAgent(t *testing.T) (*zds.Server, string) {
	sock := filepath.Join(t.TempDir(), "ztunnel.sock")
	agent, err := zds.New(zds.Config{SocketPath: sock}, zds.Deps{})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- agent.Run(ctx) }()
	t.Cleanup(func() { cancel(); require.NoError(t, <-done) })
	return agent, sock
}

// TestInPodStopWaitsForTheSuccessor: in-pod mode, a ztunnel stopped as
// SIGTERM stops it drains as soon as the CNI agent says a newer ztunnel
// has every pod, not after its (here one hour long) HandoffWait.
func TestInPodStopWaitsForTheSuccessor(t *testing.T) {
	agent, sock := startAgent(t)

	ca := catest.Start(t, catest.Options{ConfigCluster: "c1", Listen: netip.AddrPortFrom(nextAddr(), 0).String()})
	ca.AddNode(t, "token-b", "c1", "node-b")
	xc := cache.NewLinearCache(workloadv1.TypeURL)
	xdsAddr := startXDS(t, xc, nextAddr(), nil)
	old := startNode(t, "node-b", "c1", "token-b", xdsAddr, ca, func(c *node.Config) {
		c.InPodSocket, c.HandoffWait, c.DrainGrace = sock, time.Hour, time.Second
		c.SOCKS5Listen = node.Disabled
	})
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Equal(c, 1, agent.Connected()) }, 15*time.Second, 10*time.Millisecond)

	stopped := make(chan error, 1)
	go func() { stopped <- old.stop() }()
	select {
	case err := <-stopped:
		t.Fatalf("stopped (%v) with no successor, before its handoff wait", err)
	case <-time.After(500 * time.Millisecond):
	}
	// The successor: another ztunnel's side of the protocol.
	succ, err := inpod.New(inpod.Config{SocketPath: sock}, inpod.Deps{Handler: inpodtest.New(t)})
	require.NoError(t, err)
	sctx, scancel := context.WithCancel(context.Background())
	succDone := make(chan error, 1)
	go func() { succDone <- succ.Run(sctx) }()
	defer func() { scancel(); require.NoError(t, <-succDone) }()
	select {
	case err := <-stopped:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("the old ztunnel did not drain once its successor had the pods")
	}
}

// TestInPodTakesPodsOnceSynced: in in-pod mode a ztunnel connects to the
// CNI agent (and so takes the pods, maybe from the ztunnel it replaces)
// only once it holds pilot's state; with pilot away it takes them after
// InPodSyncWait anyway.
func TestInPodTakesPodsOnceSynced(t *testing.T) {
	for _, tc := range []struct {
		name   string
		wait   time.Duration
		pilots bool // pilot answers once the node has tried twice
	}{
		{"after the first sync", time.Hour, true},
		{"after the wait, pilot away", 300 * time.Millisecond, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			agent, sock := startAgent(t)

			ca := catest.Start(t, catest.Options{ConfigCluster: "c1", Listen: netip.AddrPortFrom(nextAddr(), 0).String()})
			ca.AddNode(t, "token-b", "c1", "node-b")
			var attempts atomic.Int32
			var open atomic.Bool
			cb := serverv3.CallbackFuncs{DeltaStreamOpenFunc: func(context.Context, int64, string) error {
				attempts.Add(1)
				if !open.Load() {
					return errors.New("pilot is not serving yet")
				}
				return nil
			}}
			xdsAddr := startXDS(t, cache.NewLinearCache(workloadv1.TypeURL), nextAddr(), cb)
			startNode(t, "node-b", "c1", "token-b", xdsAddr, ca, func(c *node.Config) {
				c.InPodSocket, c.InPodSyncWait = sock, tc.wait
				c.SOCKS5Listen = node.Disabled
			})
			require.EventuallyWithT(t, func(c *assert.CollectT) { assert.GreaterOrEqual(c, attempts.Load(), int32(2)) },
				15*time.Second, 10*time.Millisecond, "the node tries pilot")
			if tc.pilots {
				require.Zero(t, agent.Connected(), "connected to the CNI agent before pilot's state came")
				open.Store(true)
			}
			require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Equal(c, 1, agent.Connected()) }, 30*time.Second, 10*time.Millisecond)
		})
	}
}
