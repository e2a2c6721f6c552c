//go:build linux

package podproxy

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/ztunnel/inpod"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns/netnstest"
)

// stream makes new connections from A to B's application, workers at a
// time, until stop is called; each must connect and get its answer.
type stream struct {
	ok, failed atomic.Int64
	lastErr    atomic.Value
	stop       func()
}

func startStream(e *env, workers int) *stream {
	s := &stream{}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := 0; ctx.Err() == nil; i++ {
				msg := fmt.Sprintf("new %d/%d", w, i)
				got, err := request(e.a, netip.AddrPortFrom(b4, appPort), msg)
				if err == nil && got != fmt.Sprintf("b saw %s: %s\n", b4, msg) {
					err = fmt.Errorf("answer %q", got)
				}
				if err != nil {
					s.failed.Add(1)
					s.lastErr.Store(err.Error())
					continue
				}
				s.ok.Add(1)
			}
		})
	}
	s.stop = func() { cancel(); wg.Wait() }
	return s
}

// waitMore waits until the stream has made n more good connections.
func (s *stream) waitMore(t *testing.T, n int64) {
	t.Helper()
	target := s.ok.Load() + n
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.GreaterOrEqual(c, s.ok.Load(), target)
	}, 30*time.Second, 10*time.Millisecond)
}

// TestHandoff: a ztunnel serving pods A and B carries 100 long-lived
// connections from A to B's application; a second ztunnel opens its
// listeners in both pods beside the first one's (SO_REUSEPORT) while a
// stream of new connections runs, and the first drains with a grace
// period. No new connection fails at any point (none refused, none reset:
// the first ztunnel's accept queues move to the second's listeners when
// it closes them, and its HBONE clients are sent to the second's); the
// long-lived connections keep working during the grace period and are
// closed at its end, counted as forced.
func TestHandoff(t *testing.T) {
	const long, grace = 100, 8 * time.Second
	e := newEnv(t)
	old := e.start(t)

	var lived []net.Conn
	for i := range long {
		c, err := dialFrom(e.a, netip.AddrPortFrom(b4, appPort))
		require.NoError(t, err)
		t.Cleanup(func() { c.Close() })
		got, err := exchange(c, fmt.Sprintf("long %d", i))
		require.NoError(t, err)
		require.Equal(t, fmt.Sprintf("b saw %s: long %d\n", b4, i), got)
		lived = append(lived, c)
	}
	alive := func() (n int) {
		for i, c := range lived {
			if got, err := exchange(c, fmt.Sprintf("still %d", i)); err == nil && got == fmt.Sprintf("b saw %s: still %d\n", b4, i) {
				n++
			}
		}
		return n
	}

	s := startStream(e, 16)
	defer s.stop()
	s.waitMore(t, 20)
	e.start(t) // the successor: binds beside the first ztunnel
	s.waitMore(t, 50)

	done := make(chan DrainResult, 1)
	go func() { done <- old.Drain(context.Background(), grace) }()
	require.Equal(t, long, alive(), "established connections survive within the grace period")
	s.waitMore(t, 20) // through the closing of the first ztunnel's listeners
	// A pod enrolled meanwhile is acked (a refusal would fail its
	// enrolment), not served: the successor serves it.
	c := netnstest.New(t)
	require.NoError(t, old.AddPod(context.Background(), inpod.Pod{UID: "uid-c", Name: "c", Namespace: "app"}, dup(t, c)))
	require.NotContains(t, old.Pods(), "app/c")

	res := <-done
	s.waitMore(t, 50) // and new connections go on through the successor
	s.stop()
	t.Logf("new connections: %d good, %d failed; drain: %+v", s.ok.Load(), s.failed.Load(), res)
	require.Zero(t, s.failed.Load(), "no new connection refused or reset (last error: %v)", s.lastErr.Load())
	require.Zero(t, alive(), "the long-lived connections are closed at the end of the grace period")
	require.GreaterOrEqual(t, res.Forced, long, "each long-lived connection closed at the end of the grace period: %+v", res)
	require.Equal(t, res.Open, res.Drained+res.Forced)
	require.Equal(t, float64(res.Forced), e.m.DrainCount(metrics.DrainForced))
	require.Equal(t, float64(res.Drained), e.m.DrainCount(metrics.DrainDrained))
}
