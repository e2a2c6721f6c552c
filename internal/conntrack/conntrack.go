// Package conntrack tracks a component's live connections, listeners and
// the goroutines serving them, so that Close ends them all and waits; it
// optionally caps connections in total and per remote address. It is the
// one connection tracker of the project: servers (HBONE, SOCKS5, captured
// traffic) accept through it, and clients wrap what they dial with Track.
package conntrack

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"sync"
	"time"
)

// Errors returned by Add.
var (
	// ErrClosed means the tracker is closing: the connection was not taken.
	ErrClosed = errors.New("conntrack: closed")
	// ErrLimit means the tracker already holds Limits.MaxConns connections.
	ErrLimit = errors.New("conntrack: connection limit reached")
	// ErrPeerLimit means the connection's remote address already has
	// Limits.MaxPerPeer connections.
	ErrPeerLimit = errors.New("conntrack: per-peer connection limit reached")
)

// Limits caps the connections a Tracker takes; zero means no cap.
type Limits struct {
	// MaxConns caps connections in total.
	MaxConns int
	// MaxPerPeer caps connections from one remote IP address.
	MaxPerPeer int
}

// Tracker tracks connections, listeners and goroutines. It is safe for
// concurrent use; Close is idempotent. The zero value is not usable: use New.
type Tracker struct {
	limits Limits

	mu     sync.Mutex
	wg     sync.WaitGroup
	closed bool
	lns    map[net.Listener]struct{}
	conns  map[net.Conn]struct{}
	peers  map[netip.Addr]int
}

// New returns a Tracker with limits.
func New(limits Limits) *Tracker {
	return &Tracker{limits: limits, lns: map[net.Listener]struct{}{}, conns: map[net.Conn]struct{}{}, peers: map[netip.Addr]int{}}
}

func peerOf(c net.Conn) (netip.Addr, bool) {
	if c.RemoteAddr() == nil {
		return netip.Addr{}, false
	}
	ap, err := netip.ParseAddrPort(c.RemoteAddr().String())
	if err != nil {
		return netip.Addr{}, false
	}
	return ap.Addr().Unmap(), true
}

// Add tracks c and counts one goroutine serving it, which must call Done(c)
// when it ends. It fails, taking nothing, once Close has started or when a
// limit is reached.
func (t *Tracker) Add(c net.Conn) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return ErrClosed
	}
	if t.limits.MaxConns > 0 && len(t.conns) >= t.limits.MaxConns {
		return ErrLimit
	}
	if p, ok := peerOf(c); ok {
		if t.limits.MaxPerPeer > 0 && t.peers[p] >= t.limits.MaxPerPeer {
			return ErrPeerLimit
		}
		t.peers[p]++
	}
	t.conns[c] = struct{}{}
	t.wg.Add(1)
	return nil
}

// Done stops tracking c (added with Add) and ends its goroutine's count.
func (t *Tracker) Done(c net.Conn) {
	t.mu.Lock()
	if _, ok := t.conns[c]; ok {
		delete(t.conns, c)
		if p, ok := peerOf(c); ok {
			if t.peers[p]--; t.peers[p] <= 0 {
				delete(t.peers, p)
			}
		}
	}
	t.mu.Unlock()
	t.wg.Done()
}

// Go runs fn in a tracked goroutine unless Close has started; it reports
// whether fn was started.
func (t *Tracker) Go(fn func()) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return false
	}
	t.wg.Go(fn)
	return true
}

// Enter counts work running in the caller's goroutine (a request handler
// that a library calls), unless Close has started; Close then waits for the
// matching Leave. It reports whether the work may run.
func (t *Tracker) Enter() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return false
	}
	t.wg.Add(1)
	return true
}

// Leave ends work counted by a successful Enter.
func (t *Tracker) Leave() { t.wg.Done() }

// Len returns the number of tracked connections.
func (t *Tracker) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.conns)
}

// Closed reports whether Close has started.
func (t *Tracker) Closed() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.closed
}

// Close closes every tracked listener and connection, refuses new ones, and
// waits for every tracked goroutine. It is idempotent.
func (t *Tracker) Close() {
	t.mu.Lock()
	var closers []interface{ Close() error }
	if !t.closed {
		t.closed = true
		for ln := range t.lns {
			closers = append(closers, ln)
		}
		for c := range t.conns {
			closers = append(closers, c)
		}
	}
	t.mu.Unlock()
	for _, c := range closers { // outside mu: a tracked conn's Close takes it
		c.Close()
	}
	t.wg.Wait()
}

// Serve accepts on ln until ln or the tracker is closed, and runs handle for
// each connection in a tracked goroutine; it closes the connection when
// handle returns. A connection over a limit is closed at once and reported
// to refused (which may be nil) with ErrLimit or ErrPeerLimit. Serve owns ln
// and closes it; it returns nil when ln or the tracker was closed, else the
// accept error.
func (t *Tracker) Serve(ln net.Listener, handle func(net.Conn), refused func(net.Conn, error)) error {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		ln.Close()
		return nil
	}
	t.lns[ln] = struct{}{}
	t.wg.Add(1)
	t.mu.Unlock()
	defer func() {
		t.mu.Lock()
		delete(t.lns, ln)
		t.mu.Unlock()
		ln.Close()
		t.wg.Done()
	}()
	for {
		c, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) || t.Closed() {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return err
		}
		if err := t.Add(c); err != nil {
			if !errors.Is(err, ErrClosed) && refused != nil {
				refused(c, err) // before closing: counted by the time the peer sees it
			}
			c.Close()
			if errors.Is(err, ErrClosed) {
				return nil
			}
			continue
		}
		go func() {
			defer t.Done(c)
			defer c.Close()
			handle(c)
		}()
	}
}

// Track wraps a connection this side dialed: Close of the tracker closes it,
// and closing it stops tracking it. No goroutine is counted. After Close of
// the tracker, Track closes c and returns it.
func (t *Tracker) Track(c net.Conn) net.Conn {
	tc, _ := t.track(c)
	return tc
}

// track wraps and tracks c, or closes it and reports false when the tracker
// is closed.
func (t *Tracker) track(c net.Conn) (net.Conn, bool) {
	tc := &trackedConn{Conn: c, t: t}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		c.Close()
		return tc, false
	}
	t.conns[tc] = struct{}{}
	return tc, true
}

// CloseConns closes the connections tracked now and leaves the tracker
// open: later ones are tracked as before (a client whose credentials
// changed drops the connections made with the old ones).
func (t *Tracker) CloseConns() {
	t.mu.Lock()
	conns := make([]net.Conn, 0, len(t.conns))
	for c := range t.conns {
		conns = append(conns, c)
	}
	t.mu.Unlock()
	for _, c := range conns { // outside mu: a tracked conn's Close takes it
		c.Close()
	}
}

// Dialer dials with its net.Dialer and tracks each connection it makes in
// Tracker (see Track). Once the tracker is closed it refuses with ErrClosed.
type Dialer struct {
	net.Dialer
	Tracker *Tracker
}

// DialContext dials and tracks the connection.
func (d *Dialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	c, err := d.Dialer.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	tc, ok := d.Tracker.track(c)
	if !ok {
		return nil, ErrClosed
	}
	return tc, nil
}

type trackedConn struct {
	net.Conn
	t    *Tracker
	once sync.Once
}

// Close closes the connection and stops tracking it.
func (c *trackedConn) Close() error {
	c.once.Do(func() {
		c.t.mu.Lock()
		delete(c.t.conns, c)
		c.t.mu.Unlock()
	})
	return c.Conn.Close()
}

// drainPoll is how often WaitIdle counts.
const drainPoll = 50 * time.Millisecond

// WaitIdle waits until count (the connections of one or more trackers, as
// Len reports them) is zero, grace has passed, or ctx ends, whichever
// comes first, and returns the last count: the connections a drain must
// close. It polls count every 50ms.
func WaitIdle(ctx context.Context, grace time.Duration, count func() int) int {
	timer := time.NewTimer(grace)
	defer timer.Stop()
	tick := time.NewTicker(drainPoll)
	defer tick.Stop()
	for {
		left := count()
		if left == 0 {
			return 0
		}
		select {
		case <-tick.C:
		case <-timer.C:
			return count()
		case <-ctx.Done():
			return count()
		}
	}
}
