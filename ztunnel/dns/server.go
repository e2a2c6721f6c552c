package dns

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"time"

	mdns "github.com/miekg/dns"
)

// ErrClosed is returned by Run on a closed Server.
var ErrClosed = errors.New("dns: server closed")

// Server serves DNS on the packet connections and listeners it was given.
// Run serves until its context ends or Close is called; Close is
// idempotent and waits until every goroutine of the server has returned.
type Server struct {
	h       *handler
	servers []*mdns.Server
	conns   []io.Closer
	cancel  context.CancelFunc

	mu      sync.Mutex
	state   int           // guarded by mu: stateNew, stateRunning, stateClosed
	closing chan struct{} // closed by Close
	stopped chan struct{} // closed when the server has stopped
}

const (
	stateNew = iota
	stateRunning
	stateClosed
)

// New makes a Server; it serves nothing until Run.
func New(cfg Config, deps Deps) (*Server, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if err := errors.Join(cfg.validate(), deps.validate()); err != nil {
		return nil, fmt.Errorf("dns: %w", err)
	}
	log := deps.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	m := deps.Metrics
	if m == nil {
		m, _ = NewMetrics(nil) // unregistered: cannot fail
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &Server{
		h: newHandler(ctx, cfg, deps, m, log), cancel: cancel,
		closing: make(chan struct{}), stopped: make(chan struct{}),
	}
	accept := func(dh mdns.Header) mdns.MsgAcceptAction {
		a := mdns.DefaultMsgAcceptFunc(dh)
		if a == mdns.MsgReject || a == mdns.MsgRejectNotImplemented {
			m.count(KindFormErr)
		}
		return a
	}
	invalid := func([]byte, error) { m.count(KindFormErr) }
	decorate := func(r mdns.Reader) mdns.Reader { return &filter{Reader: r, admit: s.h.admit} }
	for _, pc := range deps.PacketConns {
		s.servers = append(s.servers, &mdns.Server{PacketConn: pc, Handler: s.h, UDPSize: int(cfg.UDPSize),
			MsgAcceptFunc: accept, MsgInvalidFunc: invalid, DecorateReader: decorate})
		s.conns = append(s.conns, pc)
	}
	for _, ln := range deps.Listeners {
		s.servers = append(s.servers, &mdns.Server{Listener: ln, Handler: s.h,
			MsgAcceptFunc: accept, MsgInvalidFunc: invalid, DecorateReader: decorate})
		s.conns = append(s.conns, ln)
	}
	return s, nil
}

// errStranger ends a TCP connection from a source that is no client.
var errStranger = errors.New("dns: not a client of this server")

// filter drops what strangers send before miekg's server reads it as DNS:
// they get no answer at all (not even FORMERR), and nothing is forwarded
// for them: the proxy is no open resolver, nor a reflector.
type filter struct {
	mdns.Reader
	admit func(net.Addr) bool
}

// ReadTCP implements mdns.Reader: a stranger's connection is closed unread.
func (f *filter) ReadTCP(conn net.Conn, timeout time.Duration) ([]byte, error) {
	if !f.admit(conn.RemoteAddr()) {
		return nil, errStranger
	}
	return f.Reader.ReadTCP(conn, timeout)
}

// ReadUDP implements mdns.Reader: strangers' datagrams are skipped.
func (f *filter) ReadUDP(conn *net.UDPConn, timeout time.Duration) ([]byte, *mdns.SessionUDP, error) {
	for {
		m, s, err := f.Reader.ReadUDP(conn, timeout)
		if err != nil || f.admit(s.RemoteAddr()) {
			return m, s, err
		}
	}
}

// ReadPacketConn implements mdns.PacketConnReader (packet connections other
// than *net.UDPConn) like ReadUDP.
func (f *filter) ReadPacketConn(conn net.PacketConn, timeout time.Duration) ([]byte, net.Addr, error) {
	pr, ok := f.Reader.(mdns.PacketConnReader)
	if !ok {
		return nil, nil, errors.New("dns: reader cannot read packet connections")
	}
	for {
		m, a, err := pr.ReadPacketConn(conn, timeout)
		if err != nil || f.admit(a) {
			return m, a, err
		}
	}
}

// Run serves until ctx ends or Close is called, then stops every listener
// and waits for in-flight queries (forwarded ones are aborted). It returns
// nil on a requested stop, the first serving error otherwise, and
// ErrClosed when the server was closed before or is already running.
func (s *Server) Run(ctx context.Context) error {
	s.mu.Lock()
	if s.state != stateNew {
		s.mu.Unlock()
		return ErrClosed
	}
	s.state = stateRunning
	s.mu.Unlock()
	defer close(s.stopped)

	var wg sync.WaitGroup
	errc := make(chan error, len(s.servers))
	started := make([]chan struct{}, len(s.servers))
	exited := make([]chan struct{}, len(s.servers))
	for i, srv := range s.servers {
		started[i], exited[i] = make(chan struct{}), make(chan struct{})
		srv.NotifyStartedFunc = func() { close(started[i]) }
		wg.Go(func() {
			defer close(exited[i])
			if err := srv.ActivateAndServe(); err != nil {
				errc <- err
			}
		})
	}
	var err error
	select {
	case <-ctx.Done():
	case <-s.closing:
	case err = <-errc:
	}
	s.cancel() // abort forwarded exchanges
	for i, srv := range s.servers {
		select {
		case <-started[i]: // Shutdown before start would be refused
			_ = srv.Shutdown()
		case <-exited[i]:
		}
	}
	wg.Wait()
	s.h.fwd.close()
	for _, c := range s.conns { // those whose serve loop failed early
		_ = c.Close()
	}
	s.mu.Lock()
	s.state = stateClosed
	s.mu.Unlock()
	return err
}

// Close stops the server and waits until it has stopped. It is idempotent
// and safe to call concurrently with Run and with itself.
func (s *Server) Close() error {
	s.mu.Lock()
	switch s.state {
	case stateNew:
		s.state = stateClosed
		close(s.closing)
		s.cancel()
		for _, c := range s.conns {
			_ = c.Close()
		}
		close(s.stopped)
	case stateRunning:
		select {
		case <-s.closing:
		default:
			close(s.closing)
		}
	}
	s.mu.Unlock()
	<-s.stopped
	return nil
}
