// Package hbone implements HBONE, HTTP/2 CONNECT over mutual TLS 1.3 (ALPN
// h2): a Server that terminates HBONE and hands each CONNECT to a Handler,
// and a pooling Client that opens CONNECT streams over shared HTTP/2
// connections, either over TCP or over another stream (double HBONE). The
// HTTP/2 stack is golang.org/x/net/http2.
package hbone

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2"

	"github.com/isthmus-mesh/isthmus/internal/conntrack"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
)

// Refusal reasons counted by the Server in metrics.
const (
	ReasonNotTLS           = "not_tls"
	ReasonHandshakeTimeout = "handshake_timeout"
	ReasonNoClientCert     = "no_client_cert"
	// ReasonUntrustedCert: the client's chain does not verify against the
	// roots of the trust domain it names, or it is no workload X509-SVID.
	ReasonUntrustedCert = "untrusted_cert"
	// ReasonWrongTrustDomain: the client's trust domain is not in the
	// trust bundle (not federated).
	ReasonWrongTrustDomain = "wrong_trust_domain"
	ReasonNoCertificate    = "no_server_certificate"
	ReasonHandshake        = "handshake_failed"
	ReasonMethod           = "method_not_connect"
	ReasonHeadersTooLarge  = "headers_too_large"
	ReasonBadAuthority     = "bad_authority"
	ReasonConnLimit        = "connection_limit"
	ReasonPeerConnLimit    = "peer_connection_limit"
	ReasonInternal         = "internal_error"
)

// Refusal is an error a Handler returns to refuse a CONNECT with an HTTP
// status and a metrics reason.
type Refusal struct {
	Status int
	Reason string
	Err    error
}

func (r *Refusal) Error() string {
	return fmt.Sprintf("refused (%d %s): %v", r.Status, r.Reason, r.Err)
}

func (r *Refusal) Unwrap() error { return r.Err }

// Refuse returns a *Refusal.
func Refuse(status int, reason string, format string, args ...any) *Refusal {
	return &Refusal{Status: status, Reason: reason, Err: fmt.Errorf(format, args...)}
}

// Request is an authenticated CONNECT request.
type Request struct {
	// Local is the address the HBONE connection arrived at.
	Local netip.AddrPort
	// Remote is the address of the HBONE client.
	Remote netip.AddrPort
	// Peer is the verified client identity.
	Peer identity.Identity
	// Authority is the CONNECT target.
	Authority string
	// Header holds the request headers.
	Header http.Header
}

// Upstream is where an accepted CONNECT stream goes.
type Upstream struct {
	// Conn receives the stream's bytes; the Server closes it.
	Conn net.Conn
	// Header is added to the 200 response.
	Header http.Header
	// Labels describe the connection in metrics.
	Labels metrics.ConnLabels
	// Done, if set, is called once when the stream has ended and Conn is
	// closed, with the bytes the stream carried each way (the same counts
	// the metrics get) and the error that ended it (nil for a clean end).
	Done func(StreamResult)
}

// StreamResult is how an accepted CONNECT stream ended.
type StreamResult struct {
	// Received are the bytes from the client (request direction), Sent
	// those back to it (response direction).
	Received, Sent int64
	// Err ended the stream; nil for a clean end.
	Err error
}

// Handler decides what an accepted CONNECT reaches. It must be safe for
// concurrent use. Errors that are not a *Refusal answer 503.
type Handler interface {
	Connect(ctx context.Context, req *Request) (Upstream, error)
}

// HandlerFunc adapts a function to Handler.
type HandlerFunc func(ctx context.Context, req *Request) (Upstream, error)

// Connect calls f.
func (f HandlerFunc) Connect(ctx context.Context, req *Request) (Upstream, error) { return f(ctx, req) }

// ServerConfig configures a Server. Zero fields take the defaults of
// DefaultServerConfig.
type ServerConfig struct {
	// Reporter labels metrics (metrics.ReporterDestination or ReporterGateway).
	Reporter string
	// HandshakeTimeout bounds the TLS handshake (slow-loris protection).
	HandshakeTimeout time.Duration
	// MaxHeaderBytes bounds the CONNECT request headers.
	MaxHeaderBytes int
	// MaxConcurrentStreams bounds streams per HTTP/2 connection.
	MaxConcurrentStreams uint32
	// IdleTimeout closes HTTP/2 connections without streams.
	IdleTimeout time.Duration
	// StreamWindow and ConnWindow are the HTTP/2 receive windows.
	StreamWindow, ConnWindow int32
	// MaxFrameSize is the largest HTTP/2 frame the server reads. It also
	// sizes the buffer the x/net/http2 client holds for every open stream,
	// idle or not (min(MaxFrameSize, 512 KiB)): at 1 MiB an idle tunnel
	// cost 0.5 MB on the client side, at the 16 KiB default 16 KiB, with no
	// measurable throughput change (see ztunnel/BENCHMARKS.md).
	MaxFrameSize uint32
	// MaxConns caps HBONE connections in total, MaxConnsPerPeer those from
	// one remote address; a connection over either is closed at once and
	// counted (connection_limit, peer_connection_limit).
	MaxConns, MaxConnsPerPeer int
	// HalfCloseTimeout is how long a stream stays open, after the upstream
	// side has ended its direction, for request bytes the client still
	// sends; each byte received restarts it. The client sees the end of the
	// response when it half-closes its own side or when this expires.
	HalfCloseTimeout time.Duration
	// HealthCheckInterval: a connection that received nothing for this long
	// is pinged, and closed with its streams if the ping is not answered
	// within HealthCheckTimeout (a client whose node vanished holds no
	// upstream connections open).
	HealthCheckInterval time.Duration
	HealthCheckTimeout  time.Duration
}

// DefaultServerConfig returns the server defaults.
func DefaultServerConfig() ServerConfig {
	return ServerConfig{
		Reporter:             metrics.ReporterDestination,
		HandshakeTimeout:     5 * time.Second,
		MaxHeaderBytes:       8 << 10,
		MaxConcurrentStreams: 1000,
		IdleTimeout:          10 * time.Minute,
		StreamWindow:         4 << 20,
		ConnWindow:           16 << 20,
		MaxFrameSize:         16 << 10,
		MaxConns:             16384,
		MaxConnsPerPeer:      1024,
		HalfCloseTimeout:     5 * time.Second,
		HealthCheckInterval:  30 * time.Second,
		HealthCheckTimeout:   10 * time.Second,
	}
}

func (c ServerConfig) withDefaults() ServerConfig {
	d := DefaultServerConfig()
	if c.Reporter == "" {
		c.Reporter = d.Reporter
	}
	if c.HandshakeTimeout <= 0 {
		c.HandshakeTimeout = d.HandshakeTimeout
	}
	if c.MaxHeaderBytes <= 0 {
		c.MaxHeaderBytes = d.MaxHeaderBytes
	}
	if c.MaxConcurrentStreams == 0 {
		c.MaxConcurrentStreams = d.MaxConcurrentStreams
	}
	if c.IdleTimeout <= 0 {
		c.IdleTimeout = d.IdleTimeout
	}
	if c.StreamWindow <= 0 {
		c.StreamWindow = d.StreamWindow
	}
	if c.ConnWindow <= 0 {
		c.ConnWindow = d.ConnWindow
	}
	if c.MaxFrameSize == 0 {
		c.MaxFrameSize = d.MaxFrameSize
	}
	if c.HalfCloseTimeout <= 0 {
		c.HalfCloseTimeout = d.HalfCloseTimeout
	}
	if c.HealthCheckInterval <= 0 {
		c.HealthCheckInterval = d.HealthCheckInterval
	}
	if c.HealthCheckTimeout <= 0 {
		c.HealthCheckTimeout = d.HealthCheckTimeout
	}
	if c.MaxConns <= 0 {
		c.MaxConns = d.MaxConns
	}
	if c.MaxConnsPerPeer <= 0 {
		c.MaxConnsPerPeer = d.MaxConnsPerPeer
	}
	return c
}

// ServerDeps are the Server's collaborators. Certs, Select and Handler are
// required.
type ServerDeps struct {
	Certs   identity.CertSource
	Select  CertSelector
	Handler Handler
	Metrics *metrics.Metrics
	Log     *slog.Logger
}

// Server terminates HBONE on any number of listeners. It is safe for
// concurrent use; Close is idempotent and waits for all connections and
// streams to end.
type Server struct {
	cfg  ServerConfig
	deps ServerDeps
	log  *slog.Logger
	tls  *tls.Config
	h2   *http2.Server
	h1   *http.Server
	ctx  context.Context
	stop context.CancelFunc
	t    *conntrack.Tracker
	once sync.Once
}

// NewServer returns a Server.
func NewServer(cfg ServerConfig, deps ServerDeps) (*Server, error) {
	if deps.Certs == nil || deps.Select == nil || deps.Handler == nil {
		return nil, errors.New("hbone: server needs Certs, Select and Handler")
	}
	cfg = cfg.withDefaults()
	log := deps.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ctx, stop := context.WithCancel(context.Background())
	s := &Server{
		cfg: cfg, deps: deps, log: log, ctx: ctx, stop: stop,
		tls: serverTLS(deps.Select, deps.Certs),
		h2: &http2.Server{
			MaxConcurrentStreams:         cfg.MaxConcurrentStreams,
			MaxReadFrameSize:             cfg.MaxFrameSize,
			MaxUploadBufferPerStream:     cfg.StreamWindow,
			MaxUploadBufferPerConnection: cfg.ConnWindow,
			IdleTimeout:                  cfg.IdleTimeout,
			ReadIdleTimeout:              cfg.HealthCheckInterval,
			PingTimeout:                  cfg.HealthCheckTimeout,
		},
		// The HTTP/2 layer enforces a hard cap well above MaxHeaderBytes;
		// the handler enforces MaxHeaderBytes itself so refusals are counted.
		h1: &http.Server{MaxHeaderBytes: 4 * cfg.MaxHeaderBytes, ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug)},
		t:  conntrack.New(conntrack.Limits{MaxConns: cfg.MaxConns, MaxPerPeer: cfg.MaxConnsPerPeer}),
	}
	// Registers the HTTP/2 connections with h1, so that Drain (h1's
	// Shutdown) sends each of them a graceful GOAWAY.
	if err := http2.ConfigureServer(s.h1, s.h2); err != nil {
		return nil, fmt.Errorf("hbone: %w", err)
	}
	return s, nil
}

// Drain tells every HBONE connection (with an HTTP/2 GOAWAY) to open no
// new stream on it: clients move their next streams to a new connection,
// while the streams open now run on to their end (or until Close). It does
// not close listeners; the caller stops accepting first. Safe to call more
// than once and together with Close.
func (s *Server) Drain() {
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // h1 serves no connection itself: nothing to wait for
	_ = s.h1.Shutdown(ctx)
}

// Conns returns the number of HBONE connections being served.
func (s *Server) Conns() int { return s.t.Len() }

// Serve accepts HBONE connections on ln until ln fails or the server is
// closed. The server owns ln and closes it.
func (s *Server) Serve(ln net.Listener) error {
	if s.t.Closed() {
		ln.Close()
		return net.ErrClosed
	}
	err := s.t.Serve(ln, s.serveConn, func(c net.Conn, err error) {
		reason := ReasonConnLimit
		if errors.Is(err, conntrack.ErrPeerLimit) {
			reason = ReasonPeerConnLimit
		}
		s.deps.Metrics.Refused(s.cfg.Reporter, reason)
		s.log.Debug("hbone connection refused", "remote", c.RemoteAddr(), "reason", reason)
	})
	if err != nil {
		return fmt.Errorf("hbone accept on %s: %w", ln.Addr(), err)
	}
	return nil
}

// Close stops all listeners and connections and waits for them. It is
// idempotent.
func (s *Server) Close() error {
	s.once.Do(s.stop)
	s.t.Close()
	return nil
}

func (s *Server) serveConn(c net.Conn) {
	tc := newTLSConn(c, s.tls, false)
	_ = c.SetDeadline(time.Now().Add(s.cfg.HandshakeTimeout))
	if err := tc.HandshakeContext(s.ctx); err != nil {
		reason := handshakeReason(err)
		s.deps.Metrics.HandshakeError(s.cfg.Reporter, reason)
		s.log.Debug("hbone handshake failed", "remote", c.RemoteAddr(), "local", c.LocalAddr(), "reason", reason, "err", err)
		return
	}
	_ = c.SetDeadline(time.Time{})
	cs := tc.ConnectionState()
	peer, err := identity.FromCertificate(cs.PeerCertificates[0])
	if err != nil || cs.NegotiatedProtocol != ALPN {
		s.deps.Metrics.HandshakeError(s.cfg.Reporter, ReasonHandshake)
		return
	}
	local, _ := addrOf(c.LocalAddr())
	remote, _ := addrOf(c.RemoteAddr())
	ci := &connInfo{local: local, remote: remote, peer: peer}
	s.h2.ServeConn(tc, &http2.ServeConnOpts{
		Context:    s.ctx,
		BaseConfig: s.h1,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if !s.t.Enter() {
				w.WriteHeader(http.StatusServiceUnavailable)
				return
			}
			defer s.t.Leave()
			s.serveStream(ci, w, r)
		}),
	})
}

func handshakeReason(err error) string {
	var rh tls.RecordHeaderError
	switch {
	case errors.As(err, &rh):
		return ReasonNotTLS
	case errors.Is(err, os.ErrDeadlineExceeded):
		return ReasonHandshakeTimeout
	case errors.Is(err, identity.ErrNoPeerCertificate):
		return ReasonNoClientCert
	case errors.Is(err, identity.ErrWrongTrustDomain):
		return ReasonWrongTrustDomain
	case errors.Is(err, identity.ErrUntrustedPeer), errors.Is(err, identity.ErrNoIdentity):
		return ReasonUntrustedCert
	case errors.Is(err, ErrNoCertificate):
		return ReasonNoCertificate
	default:
		return ReasonHandshake
	}
}

type connInfo struct {
	local, remote netip.AddrPort
	peer          identity.Identity
}

func headerBytes(r *http.Request) int {
	n := len(r.Method) + len(r.Host) + 64
	for k, vs := range r.Header {
		for _, v := range vs {
			n += len(k) + len(v) + 32
		}
	}
	return n
}

func (s *Server) refuse(w http.ResponseWriter, ref *Refusal) {
	s.deps.Metrics.Refused(s.cfg.Reporter, ref.Reason)
	s.log.Debug("hbone request refused", "status", ref.Status, "reason", ref.Reason, "err", ref.Err)
	w.WriteHeader(ref.Status)
}

func (s *Server) serveStream(ci *connInfo, w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodConnect {
		s.refuse(w, Refuse(http.StatusMethodNotAllowed, ReasonMethod, "method %s", r.Method))
		return
	}
	if n := headerBytes(r); n > s.cfg.MaxHeaderBytes {
		s.refuse(w, Refuse(http.StatusRequestHeaderFieldsTooLarge, ReasonHeadersTooLarge, "%d header bytes", n))
		return
	}
	req := &Request{Local: ci.local, Remote: ci.remote, Peer: ci.peer, Authority: r.Host, Header: r.Header}
	up, err := s.deps.Handler.Connect(r.Context(), req)
	if err != nil {
		var ref *Refusal
		if !errors.As(err, &ref) {
			ref = &Refusal{Status: http.StatusServiceUnavailable, Reason: "upstream_unavailable", Err: err}
		}
		s.refuse(w, ref)
		return
	}
	// Done, last, sees the counts and the end however the stream ends (a
	// panic, such as the reset below, is recovered only to be passed on).
	res := &streamCounts{}
	if up.Done != nil {
		defer func() {
			if p := recover(); p != nil {
				res.err.CompareAndSwap(nil, &errBox{fmt.Errorf("stream aborted: %v", p)})
				defer panic(p)
			}
			up.Done(res.result())
		}()
	}
	// Whatever happens from here on (a reset, a panic), the upstream the
	// handler dialled is closed with the stream.
	defer up.Conn.Close()
	// Counted before the client hears of it.
	mc := s.deps.Metrics.Open(up.Labels)
	defer mc.Close()
	for k, v := range up.Header {
		w.Header()[k] = v
	}
	w.WriteHeader(http.StatusOK)
	fl := w.(http.Flusher)
	fl.Flush()
	s.relayStream(r, w, fl, up.Conn, mc, res)
}

// streamCounts are a stream's byte counts and first error, for
// Upstream.Done; safe for concurrent use (each direction runs on its own
// goroutine).
type streamCounts struct {
	received, sent atomic.Int64
	err            atomic.Pointer[errBox]
}

type errBox struct{ err error }

func (c *streamCounts) fail(err error) {
	if err != nil {
		c.err.CompareAndSwap(nil, &errBox{err})
	}
}

func (c *streamCounts) result() StreamResult {
	r := StreamResult{Received: c.received.Load(), Sent: c.sent.Load()}
	if b := c.err.Load(); b != nil {
		r.Err = b.err
	}
	return r
}

// relayStream copies the request body to upstream and upstream to the
// response.
//
// The request direction half-closes upstream on END_STREAM. x/net/http2
// ends a response (END_STREAM) only when the handler returns, and then
// resets the stream if the request is still open, dropping the rest of the
// client's upload. So when upstream reaches EOF first, the handler flushes
// what it wrote and keeps the stream open, still carrying the request body
// to upstream, until the client half-closes too or no request byte has
// arrived for HalfCloseTimeout; only then does it return and end the
// response.
func (s *Server) relayStream(r *http.Request, w http.ResponseWriter, fl http.Flusher, up net.Conn, mc *metrics.Conn, res *streamCounts) {
	stopAfter := context.AfterFunc(r.Context(), func() { up.Close() })
	defer stopAfter()
	var lastRecv atomic.Int64
	lastRecv.Store(time.Now().UnixNano())
	reqDone := make(chan error, 1)
	started := s.t.Go(func() {
		_, err := copyHalf(up, bodyConn{r.Body}, func(n int) {
			lastRecv.Store(time.Now().UnixNano())
			mc.AddReceived(n)
			res.received.Add(int64(n))
		})
		if err != nil {
			res.fail(fmt.Errorf("request direction: %w", err))
			up.Close()
		}
		reqDone <- err
	})
	if !started { // the server is closing
		up.Close()
		reqDone <- net.ErrClosed
	}
	_, rerr := pump(up, func(b []byte) error {
		if _, err := w.Write(b); err != nil {
			return err
		}
		fl.Flush()
		mc.AddSent(len(b))
		res.sent.Add(int64(len(b)))
		return nil
	})
	if rerr != nil {
		res.fail(fmt.Errorf("response direction: %w", rerr))
	} else {
		rerr = s.awaitRequest(reqDone, &lastRecv)
	}
	if rerr != nil {
		up.Close()
		// Reset the stream rather than ending it cleanly.
		panic(http.ErrAbortHandler)
	}
	up.Close()
}

// awaitRequest waits, once upstream has ended the response direction, for
// the request direction to end. It returns the request direction's error,
// or nil when the client stayed silent for HalfCloseTimeout (the response
// then ends and the rest of the request is refused by a NO_ERROR reset).
func (s *Server) awaitRequest(reqDone <-chan error, lastRecv *atomic.Int64) error {
	t := time.NewTimer(s.cfg.HalfCloseTimeout)
	defer t.Stop()
	for {
		select {
		case err := <-reqDone:
			return err
		case <-t.C:
			idle := time.Since(time.Unix(0, lastRecv.Load()))
			if idle >= s.cfg.HalfCloseTimeout {
				return nil
			}
			t.Reset(s.cfg.HalfCloseTimeout - idle)
		}
	}
}

// bodyConn adapts a request body to the net.Conn reader side of copyHalf.
type bodyConn struct{ io.ReadCloser }

func (bodyConn) Write([]byte) (int, error)        { return 0, errors.ErrUnsupported }
func (bodyConn) LocalAddr() net.Addr              { return nil }
func (bodyConn) RemoteAddr() net.Addr             { return nil }
func (bodyConn) SetDeadline(time.Time) error      { return os.ErrNoDeadline }
func (bodyConn) SetReadDeadline(time.Time) error  { return os.ErrNoDeadline }
func (bodyConn) SetWriteDeadline(time.Time) error { return os.ErrNoDeadline }
