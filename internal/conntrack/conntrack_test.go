package conntrack

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func listen(t *testing.T) net.Listener {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	return ln
}

func TestServeLimitsAndClose(t *testing.T) {
	tr := New(Limits{MaxConns: 3, MaxPerPeer: 2})
	ln := listen(t)
	var refusedTotal, refusedPeer atomic.Int32
	release := make(chan struct{})
	served := make(chan struct{}, 10)
	done := make(chan error, 1)
	go func() {
		done <- tr.Serve(ln, func(c net.Conn) {
			served <- struct{}{}
			select {
			case <-release:
			case <-time.After(time.Minute):
			}
		}, func(_ net.Conn, err error) {
			switch err {
			case ErrLimit:
				refusedTotal.Add(1)
			case ErrPeerLimit:
				refusedPeer.Add(1)
			}
		})
	}()
	dial := func(src string) net.Conn {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
		c, err := d.Dial("tcp", ln.Addr().String())
		require.NoError(t, err)
		t.Cleanup(func() { c.Close() })
		return c
	}
	dial("127.0.0.1")
	dial("127.0.0.1")
	<-served
	<-served
	// A third connection from the same peer is refused and closed.
	c := dial("127.0.0.1")
	require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
	_, err := c.Read(make([]byte, 1))
	require.Error(t, err)
	require.Equal(t, int32(1), refusedPeer.Load())
	dial("127.0.0.2")
	<-served
	require.Equal(t, 3, tr.Len())
	// The fourth peer connection exceeds the total.
	c = dial("127.0.0.3")
	require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
	_, err = c.Read(make([]byte, 1))
	require.Error(t, err)
	require.Equal(t, int32(1), refusedTotal.Load())

	close(release)
	require.Eventually(t, func() bool { return tr.Len() == 0 }, 10*time.Second, 5*time.Millisecond)
	tr.Close()
	require.NoError(t, <-done)
	require.False(t, tr.Go(func() {}))
	require.ErrorIs(t, tr.Add(c), ErrClosed)
}

func TestCloseEndsHandlersAndTrackedConns(t *testing.T) {
	tr := New(Limits{})
	ln := listen(t)
	go tr.Serve(ln, func(c net.Conn) { _, _ = c.Read(make([]byte, 1)) }, nil)
	c, err := net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	defer c.Close()
	require.Eventually(t, func() bool { return tr.Len() == 1 }, 10*time.Second, 5*time.Millisecond)

	// A dialed connection wrapped by Track is closed by Close too.
	ln2 := listen(t)
	defer ln2.Close()
	d, err := net.Dial("tcp", ln2.Addr().String())
	require.NoError(t, err)
	tc := tr.Track(d)
	require.Equal(t, 2, tr.Len())
	tr.Close()
	_, err = tc.Write([]byte("x"))
	require.Error(t, err, "tracked conn closed by Close")
	_ = tc.Close() // closing again is harmless
	// The handler returned (Close waited for it), so the client sees EOF.
	require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
	_, err = c.Read(make([]byte, 1))
	require.Error(t, err)
}

func TestDialerTracksAndCloseConnsKeepsTheTrackerOpen(t *testing.T) {
	ln := listen(t)
	defer ln.Close()
	tr := New(Limits{})
	d := &Dialer{Tracker: tr}
	first, err := d.DialContext(t.Context(), "tcp", ln.Addr().String())
	require.NoError(t, err)
	require.Equal(t, 1, tr.Len())

	tr.CloseConns()
	_, err = first.Write([]byte("x"))
	require.Error(t, err, "CloseConns closed the dialed connection")
	require.Equal(t, 0, tr.Len())

	second, err := d.DialContext(t.Context(), "tcp", ln.Addr().String())
	require.NoError(t, err, "the tracker is still open")
	require.Equal(t, 1, tr.Len())
	require.NoError(t, second.Close())
	require.Equal(t, 0, tr.Len(), "closing a dialed connection stops tracking it")

	tr.Close()
	_, err = d.DialContext(t.Context(), "tcp", ln.Addr().String())
	require.ErrorIs(t, err, ErrClosed)
	require.Equal(t, 0, tr.Len())
}

// TestWaitIdle: it returns 0 as soon as the count is zero, the count left
// when the grace period ends, and the count when the context ends.
func TestWaitIdle(t *testing.T) {
	var n atomic.Int32
	n.Store(3)
	go n.Store(0) // the connections end
	require.Zero(t, WaitIdle(context.Background(), time.Hour, func() int { return int(n.Load()) }))
	require.Equal(t, 2, WaitIdle(context.Background(), 10*time.Millisecond, func() int { return 2 }), "grace over")
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.Equal(t, 5, WaitIdle(ctx, time.Hour, func() int { return 5 }), "context ended")
}
