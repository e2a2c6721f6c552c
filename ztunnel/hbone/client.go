package hbone

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
	"sync"
	"time"

	"golang.org/x/net/http2"

	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
)

// ClientConfig configures a Client. Zero fields take the defaults of
// DefaultClientConfig.
type ClientConfig struct {
	// MaxStreamsPerConn caps concurrent CONNECT streams on one pooled
	// HTTP/2 connection; a new connection is opened when all are full.
	MaxStreamsPerConn int
	// IdleTimeout closes pooled connections that carried no stream for
	// this long.
	IdleTimeout time.Duration
	// DialTimeout bounds dialing and the TLS handshake of a new connection.
	DialTimeout time.Duration
	// MaxFrameSize is the largest HTTP/2 frame the client reads.
	MaxFrameSize uint32
	// HealthCheckInterval: a pooled connection that received nothing for
	// this long is pinged, and closed if the ping is not answered within
	// HealthCheckTimeout. A peer that vanished without closing (its node or
	// network namespace gone) then stops taking new streams, each of which
	// would wait for its dial timeout.
	HealthCheckInterval time.Duration
	HealthCheckTimeout  time.Duration
}

// DefaultClientConfig returns the client defaults.
func DefaultClientConfig() ClientConfig {
	return ClientConfig{
		MaxStreamsPerConn:   100,
		IdleTimeout:         90 * time.Second,
		DialTimeout:         10 * time.Second,
		MaxFrameSize:        1 << 20,
		HealthCheckInterval: 10 * time.Second,
		HealthCheckTimeout:  5 * time.Second,
	}
}

func (c ClientConfig) withDefaults() ClientConfig {
	d := DefaultClientConfig()
	if c.MaxStreamsPerConn <= 0 {
		c.MaxStreamsPerConn = d.MaxStreamsPerConn
	}
	if c.IdleTimeout <= 0 {
		c.IdleTimeout = d.IdleTimeout
	}
	if c.DialTimeout <= 0 {
		c.DialTimeout = d.DialTimeout
	}
	if c.MaxFrameSize == 0 {
		c.MaxFrameSize = d.MaxFrameSize
	}
	if c.HealthCheckInterval <= 0 {
		c.HealthCheckInterval = d.HealthCheckInterval
	}
	if c.HealthCheckTimeout <= 0 {
		c.HealthCheckTimeout = d.HealthCheckTimeout
	}
	return c
}

// Dialer opens TCP connections. *net.Dialer implements it; tests inject
// recording dialers.
type Dialer interface {
	DialContext(ctx context.Context, network, address string) (net.Conn, error)
}

// Underlay opens the byte stream a new pooled HTTP/2 connection runs over
// (for double HBONE: an outer HBONE stream) and returns a label kept with
// the connection (for double HBONE: the endpoint the gateway chose).
type Underlay func(ctx context.Context) (conn net.Conn, label string, err error)

// DialRequest describes one CONNECT stream.
type DialRequest struct {
	// Source is the identity whose certificate the client presents.
	Source identity.Identity
	// Peers are the identities the server may present; required (a client
	// that would accept any identity of the trust domain lets any workload
	// certificate terminate its tunnel).
	Peers []identity.Identity
	// Addr is the HBONE address to dial over TCP when Underlay is nil.
	Addr netip.AddrPort
	// Underlay, if set, replaces the TCP dial; UnderlayKey then names the
	// underlay in the pool key.
	Underlay    Underlay
	UnderlayKey string
	// Authority is the CONNECT target. AuthorityFor, if set, computes it
	// from the pooled connection's label instead.
	Authority    string
	AuthorityFor func(label string) string
	// Header is sent with the CONNECT request.
	Header http.Header
}

// ClientDeps are the Client's collaborators. Certs is required; Dialer
// defaults to a net.Dialer.
type ClientDeps struct {
	Certs  identity.CertSource
	Dialer Dialer
	Log    *slog.Logger
}

// StatusError is returned when the server answers CONNECT with a status
// other than 200.
type StatusError struct {
	Code int
}

func (e *StatusError) Error() string {
	return fmt.Sprintf("hbone: CONNECT refused: %d %s", e.Code, http.StatusText(e.Code))
}

// Client opens HBONE streams, pooling HTTP/2 connections per (source
// identity, peer identity, peer address or underlay). It is safe for
// concurrent use; Close is idempotent.
type Client struct {
	cfg    ClientConfig
	certs  identity.CertSource
	dialer Dialer
	log    *slog.Logger
	t      *http2.Transport

	mu     sync.Mutex
	pools  map[poolKey][]*pooledConn
	closed bool
	// stop ends the connections being set up when the client closes;
	// connecting counts them.
	stop       context.Context
	stopAll    context.CancelFunc
	connecting sync.WaitGroup
}

type poolKey struct {
	src   identity.Identity
	peers string // the accepted identities, joined
	addr  netip.AddrPort
	via   string
}

// ErrNoPeerIdentity means a dial named no identity the server must present.
var ErrNoPeerIdentity = errors.New("hbone: no peer identity to verify")

func peersKey(peers []identity.Identity) string {
	if len(peers) == 1 {
		return peers[0].String()
	}
	var b strings.Builder
	for _, p := range peers {
		b.WriteString(p.String())
		b.WriteByte(' ')
	}
	return b.String()
}

type pooledConn struct {
	key   poolKey
	ready chan struct{} // closed once cc or err is set
	err   error
	cc    *http2.ClientConn
	raw   net.Conn
	label string

	// guarded by Client.mu
	active int
	idle   *time.Timer
	gone   bool
}

// NewClient returns a Client.
func NewClient(cfg ClientConfig, deps ClientDeps) (*Client, error) {
	if deps.Certs == nil {
		return nil, errors.New("hbone: client needs Certs")
	}
	cfg = cfg.withDefaults()
	c := &Client{
		cfg: cfg, certs: deps.Certs, dialer: deps.Dialer, log: deps.Log,
		t: &http2.Transport{MaxReadFrameSize: cfg.MaxFrameSize,
			ReadIdleTimeout: cfg.HealthCheckInterval, PingTimeout: cfg.HealthCheckTimeout},
		pools: map[poolKey][]*pooledConn{},
	}
	c.stop, c.stopAll = context.WithCancel(context.Background())
	if c.dialer == nil {
		c.dialer = &net.Dialer{}
	}
	if c.log == nil {
		c.log = slog.New(slog.DiscardHandler)
	}
	return c, nil
}

// Dial opens a CONNECT stream, reusing a pooled connection with a free
// stream slot or opening a new one. ctx bounds only the dial, not the
// stream's lifetime.
func (c *Client) Dial(ctx context.Context, req DialRequest) (*Stream, error) {
	if len(req.Peers) == 0 {
		return nil, ErrNoPeerIdentity
	}
	key := poolKey{src: req.Source, peers: peersKey(req.Peers), addr: req.Addr, via: req.UnderlayKey}
	var lastErr error
	for range 3 {
		pc, err := c.acquire(ctx, key, req)
		if err != nil {
			return nil, err
		}
		s, err := c.open(ctx, pc, req)
		if err == nil {
			return s, nil
		}
		usable := pc.cc.CanTakeNewRequest()
		c.release(pc)
		var se *StatusError
		if errors.As(err, &se) || usable || ctx.Err() != nil {
			return nil, err
		}
		lastErr = err
	}
	return nil, lastErr
}

func (c *Client) acquire(ctx context.Context, key poolKey, req DialRequest) (*pooledConn, error) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil, net.ErrClosed
	}
	var pc *pooledConn
	for _, p := range c.pools[key] {
		if p.gone || p.active >= c.cfg.MaxStreamsPerConn || (p.cc != nil && !p.cc.CanTakeNewRequest()) {
			continue
		}
		pc = p
		break
	}
	if pc == nil {
		pc = &pooledConn{key: key, ready: make(chan struct{}), active: 1}
		c.pools[key] = append(c.pools[key], pc)
		c.connecting.Add(1)
		c.mu.Unlock()
		// Set up on its own: the caller may give up (another endpoint
		// answered first) while other callers wait for pc.
		go c.connect(ctx, pc, req)
	} else {
		pc.active++
		if pc.idle != nil {
			pc.idle.Stop()
		}
		c.mu.Unlock()
	}
	select {
	case <-pc.ready:
	case <-ctx.Done():
		c.release(pc)
		return nil, ctx.Err()
	}
	if pc.err != nil {
		c.release(pc)
		return nil, pc.err
	}
	return pc, nil
}

// connect dials, handshakes and starts HTTP/2 for pc. It is not bound to
// the caller's cancellation, other callers may be waiting for pc, but ends
// when the client closes.
func (c *Client) connect(ctx context.Context, pc *pooledConn, req DialRequest) {
	defer c.connecting.Done()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.DialTimeout)
	defer cancel()
	defer context.AfterFunc(c.stop, cancel)()
	cc, raw, label, err := c.newConn(ctx, req)
	c.mu.Lock()
	if err == nil && (c.closed || pc.gone) {
		// Closed, or expired idle while it was set up (every caller gave
		// up): nobody will use or close it.
		err = net.ErrClosed
		raw.Close()
	}
	if err != nil {
		pc.err = err
		if !pc.gone {
			c.removeLocked(pc)
		}
	} else {
		pc.cc, pc.raw, pc.label = cc, raw, label
	}
	c.mu.Unlock()
	close(pc.ready)
}

func (c *Client) newConn(ctx context.Context, req DialRequest) (*http2.ClientConn, net.Conn, string, error) {
	cert, err := c.certs.Certificate(ctx, req.Source)
	if err != nil {
		return nil, nil, "", err
	}
	var (
		raw   net.Conn
		label string
	)
	if req.Underlay != nil {
		raw, label, err = req.Underlay(ctx)
	} else {
		raw, err = c.dialer.DialContext(ctx, "tcp", req.Addr.String())
	}
	if err != nil {
		return nil, nil, "", fmt.Errorf("hbone dial %s%s: %w", req.Addr, req.UnderlayKey, err)
	}
	tc := newTLSConn(raw, clientTLS(cert, c.certs, req.Peers), true)
	if err := tc.HandshakeContext(ctx); err != nil {
		raw.Close()
		return nil, nil, "", fmt.Errorf("hbone handshake %s%s: %w", req.Addr, req.UnderlayKey, err)
	}
	cc, err := c.t.NewClientConn(tc)
	if err != nil {
		tc.Close()
		return nil, nil, "", err
	}
	return cc, tc, label, nil
}

func (c *Client) open(ctx context.Context, pc *pooledConn, req DialRequest) (*Stream, error) {
	authority := req.Authority
	if req.AuthorityFor != nil {
		authority = req.AuthorityFor(pc.label)
	}
	pr, pw := io.Pipe()
	sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	hreq := (&http.Request{
		Method:        http.MethodConnect,
		URL:           &url.URL{Host: authority},
		Host:          authority,
		Header:        req.Header,
		Body:          pr,
		ContentLength: -1,
		Proto:         "HTTP/2.0",
		ProtoMajor:    2,
	}).WithContext(sctx)
	if hreq.Header == nil {
		hreq.Header = http.Header{}
	}
	// The caller's ctx aborts the request only until the response arrives.
	stop := context.AfterFunc(ctx, cancel)
	resp, err := pc.cc.RoundTrip(hreq)
	stop()
	if err == nil && resp.StatusCode != http.StatusOK {
		resp.Body.Close()
		err = &StatusError{Code: resp.StatusCode}
	}
	if err == nil && ctx.Err() != nil {
		resp.Body.Close()
		err = ctx.Err()
	}
	if err != nil {
		cancel()
		pw.CloseWithError(err)
		return nil, err
	}
	s := &Stream{c: c, pc: pc, pw: pw, body: resp.Body, header: resp.Header, cancel: cancel,
		local: pc.raw.LocalAddr(), remote: pc.raw.RemoteAddr()}
	return s, nil
}

func (c *Client) release(pc *pooledConn) {
	c.mu.Lock()
	defer c.mu.Unlock()
	pc.active--
	if pc.active > 0 || pc.gone {
		return
	}
	if pc.cc != nil && !pc.cc.CanTakeNewRequest() {
		c.removeLocked(pc)
		go pc.cc.Close()
		return
	}
	if pc.idle == nil {
		pc.idle = time.AfterFunc(c.cfg.IdleTimeout, func() { c.expire(pc) })
	} else {
		pc.idle.Reset(c.cfg.IdleTimeout)
	}
}

func (c *Client) expire(pc *pooledConn) {
	c.mu.Lock()
	if pc.active > 0 || pc.gone {
		c.mu.Unlock()
		return
	}
	c.removeLocked(pc)
	c.mu.Unlock()
	c.log.Debug("closing idle hbone connection", "peer", pc.key.addr, "via", pc.key.via)
	if pc.cc != nil {
		pc.cc.Close()
	}
}

func (c *Client) removeLocked(pc *pooledConn) {
	pc.gone = true
	if pc.idle != nil {
		pc.idle.Stop()
	}
	list := c.pools[pc.key]
	for i, p := range list {
		if p == pc {
			list = append(list[:i:i], list[i+1:]...)
			break
		}
	}
	if len(list) == 0 {
		delete(c.pools, pc.key)
	} else {
		c.pools[pc.key] = list
	}
}

// PoolStats counts pooled connections and their open streams.
type PoolStats struct {
	Conns   int
	Streams int
}

// Stats returns the current pool occupancy.
func (c *Client) Stats() PoolStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	var st PoolStats
	for _, list := range c.pools {
		for _, p := range list {
			st.Conns++
			st.Streams += p.active
		}
	}
	return st
}

// Close closes every pooled connection, ending their streams. It is
// idempotent.
func (c *Client) Close() error {
	c.mu.Lock()
	c.closed = true
	var all []*pooledConn
	for _, list := range c.pools {
		all = append(all, list...)
	}
	for _, pc := range all {
		if pc.cc != nil { // pending dials are stopped below, and see closed
			c.removeLocked(pc)
		}
	}
	c.mu.Unlock()
	for _, pc := range all {
		if pc.cc != nil {
			pc.cc.Close()
		}
	}
	c.stopAll()
	c.connecting.Wait()
	return nil
}
