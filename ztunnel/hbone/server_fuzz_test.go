package hbone

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"

	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/internal/testca"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
)

// fuzzServerMaxHeaderBytes is the header limit of the fuzzed server.
const fuzzServerMaxHeaderBytes = 1 << 10

// serverFuzzer runs, for each input, a fresh HBONE server on loopback whose
// handler accepts CONNECTs to "echo:<port>" (a counting TCP echo app) and
// refuses the rest, and records any request that breaks the server's
// promises to handlers.
type serverFuzzer struct {
	certs     *identity.Cache
	metrics   *metrics.Metrics
	echo      string
	clientTLS *tls.Config
	mu        sync.Mutex
	echoOpen  map[string]bool // remote addresses of open echo app connections
	violation string
}

// upstreams are the local addresses of the upstream connections the
// handler of one server dialled.
type upstreams struct {
	mu    sync.Mutex
	addrs []string
}

func (u *upstreams) add(a string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.addrs = append(u.addrs, a)
}

// open returns how many of us are still open at the echo app.
func (fz *serverFuzzer) open(us *upstreams) int {
	us.mu.Lock()
	defer us.mu.Unlock()
	fz.mu.Lock()
	defer fz.mu.Unlock()
	n := 0
	for _, a := range us.addrs {
		if fz.echoOpen[a] {
			n++
		}
	}
	return n
}

func (fz *serverFuzzer) violate(format string, args ...any) {
	fz.mu.Lock()
	defer fz.mu.Unlock()
	if fz.violation == "" {
		fz.violation = fmt.Sprintf(format, args...)
	}
}

func (fz *serverFuzzer) takeViolation() string {
	fz.mu.Lock()
	defer fz.mu.Unlock()
	v := fz.violation
	fz.violation = ""
	return v
}

// connect is the handler: it checks what the server hands it, and notes in
// us the upstreams it dials.
func (fz *serverFuzzer) connect(ctx context.Context, req *Request, us *upstreams) (Upstream, error) {
	r := &http.Request{Method: http.MethodConnect, Host: req.Authority, Header: req.Header}
	if n := headerBytes(r); n > fuzzServerMaxHeaderBytes {
		fz.violate("handler got %d header bytes, over the limit %d", n, fuzzServerMaxHeaderBytes)
	}
	if req.Peer != clientID || !req.Local.IsValid() || !req.Remote.IsValid() {
		fz.violate("handler got peer %s local %s remote %s", req.Peer, req.Local, req.Remote)
	}
	if !strings.HasPrefix(req.Authority, "echo:") {
		return Upstream{}, Refuse(http.StatusForbidden, "fuzz_refused", "authority %q", req.Authority)
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", fz.echo)
	if err != nil {
		return Upstream{}, err
	}
	us.add(c.LocalAddr().String())
	return Upstream{Conn: c}, nil
}

func (fz *serverFuzzer) serveEcho(t testing.TB) {
	ln, err := net.Listen("tcp", netip.AddrPortFrom(loopback, 0).String())
	if err != nil {
		t.Fatal(err)
	}
	fz.echo = ln.Addr().String()
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			remote := c.RemoteAddr().String()
			fz.mu.Lock()
			fz.echoOpen[remote] = true
			fz.mu.Unlock()
			wg.Go(func() {
				defer func() {
					c.Close()
					fz.mu.Lock()
					delete(fz.echoOpen, remote)
					fz.mu.Unlock()
				}()
				_, _ = io.Copy(c, c)
				_ = c.(*net.TCPConn).CloseWrite()
				_, _ = io.Copy(io.Discard, c)
			})
		}
	})
	t.Cleanup(func() { ln.Close(); wg.Wait() })
}

func newServerFuzzer(t testing.TB) *serverFuzzer {
	ca, err := testca.New("cluster.local")
	if err != nil {
		t.Fatal(err)
	}
	fz := &serverFuzzer{certs: identity.NewCache(ca), echoOpen: map[string]bool{}}
	if fz.metrics, err = metrics.New(prometheus.NewRegistry()); err != nil {
		t.Fatal(err)
	}
	fz.serveEcho(t)
	cert, err := fz.certs.Certificate(context.Background(), clientID)
	if err != nil {
		t.Fatal(err)
	}
	fz.clientTLS = clientTLS(cert, fz.certs, []identity.Identity{serverID})
	return fz
}

// start serves HBONE on a new loopback listener; stop closes the server
// and waits for it; us collects the upstreams its handler dials.
func (fz *serverFuzzer) start(t *testing.T) (srv *Server, addr string, us *upstreams, stop func()) {
	us = &upstreams{}
	handler := func(ctx context.Context, req *Request) (Upstream, error) { return fz.connect(ctx, req, us) }
	srv, err := NewServer(ServerConfig{MaxHeaderBytes: fuzzServerMaxHeaderBytes, HalfCloseTimeout: 100 * time.Millisecond},
		ServerDeps{Certs: fz.certs, Metrics: fz.metrics, Handler: HandlerFunc(handler),
			Select: func(ctx context.Context, _ netip.Addr) (*tls.Certificate, error) {
				return fz.certs.Certificate(ctx, serverID)
			}})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", netip.AddrPortFrom(loopback, 0).String())
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Go(func() { _ = srv.Serve(ln) })
	return srv, ln.Addr().String(), us, func() { srv.Close(); wg.Wait() }
}

// exchange opens an HBONE connection to addr, sends the HTTP/2 preface, an
// empty SETTINGS frame and frames, half-closes, and reads the server's
// frames until it ends the connection. It reports whether the server did so
// with an error (a GOAWAY with a code other than NO_ERROR).
func (fz *serverFuzzer) exchange(t *testing.T, addr string, frames []byte) (goAwayErr bool) {
	raw, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	_ = raw.SetDeadline(time.Now().Add(10 * time.Second))
	c := tls.Client(raw, fz.clientTLS)
	if err := c.Handshake(); err != nil {
		t.Fatalf("handshake: %v", err)
	}
	msg := append([]byte(http2.ClientPreface+"\x00\x00\x00\x04\x00\x00\x00\x00\x00"), frames...)
	// The server may close first (GOAWAY on a protocol error): write errors
	// are expected then; what matters is that it ends the connection.
	if _, err := c.Write(msg); err == nil {
		_ = c.CloseWrite()
	}
	// Read until the server closes, or sends GOAWAY (a client then closes).
	fr := http2.NewFramer(nil, c)
	for {
		f, err := fr.ReadFrame()
		if ga, ok := f.(*http2.GoAwayFrame); ok {
			return ga.ErrCode != http2.ErrCodeNo
		}
		if errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) {
			return false
		}
		if err != nil {
			t.Fatalf("the server neither answered nor closed the connection: %v", err)
		}
	}
}

// FuzzServerRequest sends arbitrary HTTP/2 frames (after a valid preface)
// over a real mutual-TLS HBONE connection on loopback, to a server of its
// own. The server must not crash; the handler only gets requests within the
// header limit, from the verified peer; once the client is done the server
// ends the connection by itself, Close returns at once, and no upstream
// outlives its stream. After a connection error (a GOAWAY with an error
// code) x/net/http2 stops reading and holds the connection and its streams
// for a second (goAwayTimeout) before closing them: such a server is closed
// in the background and its upstreams are checked then.
func FuzzServerRequest(f *testing.F) {
	fz := newServerFuzzer(f)
	var held sync.WaitGroup
	f.Cleanup(held.Wait)
	f.Fuzz(func(t *testing.T, frames []byte) {
		srv, addr, us, stop := fz.start(t)
		if fz.exchange(t, addr, frames) {
			held.Go(func() {
				stop()
				if fz.eventually(func() bool { return fz.open(us) == 0 }) {
					return
				}
				fz.violate("%d upstreams outlived the streams of a connection closed after an error (input %q)", fz.open(us), frames)
			})
		} else {
			require.True(t, fz.eventually(func() bool { return srv.t.Len() == 0 }), "the client is gone, yet the server keeps its connection")
			stopped := make(chan struct{})
			go func() { stop(); close(stopped) }()
			require.True(t, fz.eventually(func() bool {
				select {
				case <-stopped:
					return true
				default:
					return false
				}
			}), "Close did not return: a stream hangs")
			require.True(t, fz.eventually(func() bool { return fz.open(us) == 0 }), "an upstream outlived its stream")
		}
		if v := fz.takeViolation(); v != "" {
			t.Fatal(v)
		}
	})
}

// eventually polls cond for up to ten seconds (generous: the machine may be
// loaded) and reports whether it became true.
func (fz *serverFuzzer) eventually(cond func() bool) bool {
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(time.Millisecond)
	}
	return true
}
