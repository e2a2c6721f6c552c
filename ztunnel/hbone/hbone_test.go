package hbone

import (
	"context"
	"crypto/tls"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/internal/testca"
	"github.com/isthmus-mesh/isthmus/ztunnel/internal/testnet"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var (
	serverID = identity.Identity{TrustDomain: "cluster.local", Namespace: "default", ServiceAccount: "server"}
	clientID = identity.Identity{TrustDomain: "cluster.local", Namespace: "default", ServiceAccount: "client"}
	loopback = netip.AddrFrom4([4]byte{127, byte(64 + rand.IntN(180)), byte(rand.IntN(250)), byte(1 + rand.IntN(250))})
)

// countingListener counts accepted connections and tracks which are open.
type countingListener struct {
	net.Listener
	accepted atomic.Int64
	open     atomic.Int64
}

type countedConn struct {
	net.Conn
	l    *countingListener
	once sync.Once
}

func (c *countedConn) Close() error {
	c.once.Do(func() { c.l.open.Add(-1) })
	return c.Conn.Close()
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	l.accepted.Add(1)
	l.open.Add(1)
	return &countedConn{Conn: c, l: l}, nil
}

// env is an HBONE server in front of a TCP echo service.
type env struct {
	ca     *testca.CA
	certs  *identity.Cache
	srv    *Server
	ln     *countingListener
	addr   netip.AddrPort
	echo   netip.AddrPort
	client *Client
}

func startEchoTCP(t *testing.T) netip.AddrPort {
	return testnet.Serve(t, netip.AddrPortFrom(loopback, 0).String(), testnet.Echo)
}

func newEnv(t *testing.T, ccfg ClientConfig) *env {
	return newEnvConfig(t, ServerConfig{}, ccfg)
}

// newEnvConfig is newEnv with a server configuration. The server's handler
// dials the CONNECT authority.
func newEnvConfig(t *testing.T, scfg ServerConfig, ccfg ClientConfig) *env {
	ca, err := testca.New("cluster.local")
	require.NoError(t, err)
	certs := identity.NewCache(ca)
	e := &env{ca: ca, certs: certs, echo: startEchoTCP(t)}
	m, err := metrics.New(prometheus.NewRegistry())
	require.NoError(t, err)
	e.srv, err = NewServer(scfg, ServerDeps{
		Certs:   certs,
		Metrics: m,
		Select: func(ctx context.Context, _ netip.Addr) (*tls.Certificate, error) {
			return certs.Certificate(ctx, serverID)
		},
		Handler: HandlerFunc(func(ctx context.Context, req *Request) (Upstream, error) {
			var d net.Dialer
			c, err := d.DialContext(ctx, "tcp", req.Authority)
			return Upstream{Conn: c}, err
		}),
	})
	require.NoError(t, err)
	ln, err := net.Listen("tcp", netip.AddrPortFrom(loopback, 0).String())
	require.NoError(t, err)
	e.ln = &countingListener{Listener: ln}
	e.addr, _ = AddrPortOf(ln.Addr())
	var wg sync.WaitGroup
	wg.Go(func() { _ = e.srv.Serve(e.ln) })
	e.client, err = NewClient(ccfg, ClientDeps{Certs: certs})
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, e.client.Close())
		require.NoError(t, e.srv.Close())
		require.NoError(t, e.srv.Close()) // idempotent
		wg.Wait()
	})
	return e
}

func (e *env) dial(t *testing.T) *Stream {
	s, err := e.client.Dial(t.Context(), DialRequest{Source: clientID, Peers: []identity.Identity{serverID}, Addr: e.addr, Authority: e.echo.String()})
	require.NoError(t, err)
	return s
}

func roundTrip(t *testing.T, s *Stream, msg string) {
	_, err := s.Write([]byte(msg))
	require.NoError(t, err)
	b := make([]byte, len(msg))
	_, err = io.ReadFull(s, b)
	require.NoError(t, err)
	require.Equal(t, msg, string(b))
}

func TestHalfCloseBothWays(t *testing.T) {
	e := newEnv(t, ClientConfig{})
	s := e.dial(t)
	defer s.Close()
	_, err := s.Write([]byte("request"))
	require.NoError(t, err)
	require.NoError(t, s.CloseWrite()) // the echo sees EOF, answers and closes
	got, err := io.ReadAll(s)
	require.NoError(t, err)
	require.Equal(t, "request", string(got))
}

func TestPoolReusesOneConnection(t *testing.T) {
	e := newEnv(t, ClientConfig{})
	const n = 8
	streams := make([]*Stream, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { streams[i] = e.dial(t) })
	}
	wg.Wait()
	for i, s := range streams {
		roundTrip(t, s, "stream "+string(rune('a'+i)))
	}
	require.Equal(t, PoolStats{Conns: 1, Streams: n}, e.client.Stats())
	require.Equal(t, int64(1), e.ln.accepted.Load())
	for _, s := range streams {
		require.NoError(t, s.Close())
	}
	require.Equal(t, PoolStats{Conns: 1, Streams: 0}, e.client.Stats())
}

func TestStreamCapOpensAnotherConnection(t *testing.T) {
	e := newEnv(t, ClientConfig{MaxStreamsPerConn: 3})
	var streams []*Stream
	for range 7 {
		s := e.dial(t)
		roundTrip(t, s, "x")
		streams = append(streams, s)
	}
	require.Equal(t, PoolStats{Conns: 3, Streams: 7}, e.client.Stats())
	require.Equal(t, int64(3), e.ln.accepted.Load())
	for _, s := range streams {
		s.Close()
	}
	// Freed slots are reused before any new connection is dialled.
	s := e.dial(t)
	defer s.Close()
	require.Equal(t, int64(3), e.ln.accepted.Load())
}

func TestIdleConnectionsAreClosed(t *testing.T) {
	e := newEnv(t, ClientConfig{IdleTimeout: 100 * time.Millisecond})
	s := e.dial(t)
	roundTrip(t, s, "hi")
	require.NoError(t, s.Close())
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.Equal(c, PoolStats{}, e.client.Stats())
		require.Equal(c, int64(0), e.ln.open.Load())
	}, 5*time.Second, 10*time.Millisecond)
	// The next dial opens a fresh connection.
	s = e.dial(t)
	defer s.Close()
	roundTrip(t, s, "again")
	require.Equal(t, int64(2), e.ln.accepted.Load())
}

func TestClientVerifiesServerIdentity(t *testing.T) {
	e := newEnv(t, ClientConfig{})
	other := identity.Identity{TrustDomain: "cluster.local", Namespace: "default", ServiceAccount: "someone-else"}
	_, err := e.client.Dial(t.Context(), DialRequest{Source: clientID, Peers: []identity.Identity{other}, Addr: e.addr, Authority: e.echo.String()})
	require.ErrorIs(t, err, identity.ErrUnexpectedIdentity)
	require.Equal(t, PoolStats{}, e.client.Stats())
}

func TestIdentityParse(t *testing.T) {
	id, err := identity.Parse("spiffe://cluster.local/ns/default/sa/client")
	require.NoError(t, err)
	require.Equal(t, clientID, id)
	for _, bad := range []string{"http://x/ns/a/sa/b", "spiffe://td/ns/a", "spiffe://td/ns//sa/b", "spiffe:///ns/a/sa/b"} {
		_, err := identity.Parse(bad)
		require.Error(t, err, bad)
	}
}

// freezingDialer dials TCP and can freeze every connection it made so far:
// their writes vanish and their reads wait until closed, as when the peer's
// node or network namespace disappears without a FIN or RST.
type freezingDialer struct {
	mu    sync.Mutex
	conns []*freezableConn
}

type freezableConn struct {
	net.Conn
	frozen atomic.Bool
	closed chan struct{}
	once   sync.Once
}

func (c *freezableConn) Read(b []byte) (int, error) {
	if c.frozen.Load() {
		<-c.closed
		return 0, net.ErrClosed
	}
	return c.Conn.Read(b)
}

func (c *freezableConn) Write(b []byte) (int, error) {
	if c.frozen.Load() {
		return len(b), nil
	}
	return c.Conn.Write(b)
}

func (c *freezableConn) Close() error {
	c.once.Do(func() { close(c.closed) })
	return c.Conn.Close()
}

func (d *freezingDialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	var nd net.Dialer
	c, err := nd.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	fc := &freezableConn{Conn: c, closed: make(chan struct{})}
	d.mu.Lock()
	d.conns = append(d.conns, fc)
	d.mu.Unlock()
	return fc, nil
}

func (d *freezingDialer) freeze() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, c := range d.conns {
		c.frozen.Store(true)
	}
}

// TestSilentPeerConnectionIsDropped: the pooled connection's peer goes
// silent. The health check's unanswered ping closes it, so a new stream
// gets a fresh connection instead of waiting on the dead one until its
// deadline, again and again.
func TestSilentPeerConnectionIsDropped(t *testing.T) {
	d := &freezingDialer{}
	e := newEnv(t, ClientConfig{HealthCheckInterval: 100 * time.Millisecond, HealthCheckTimeout: 100 * time.Millisecond})
	e.client.dialer = d
	s := e.dial(t)
	roundTrip(t, s, "before")
	require.NoError(t, s.Close())
	d.freeze()

	require.EventuallyWithT(t, func(c *assert.CollectT) {
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		s, err := e.client.Dial(ctx, DialRequest{Source: clientID, Peers: []identity.Identity{serverID}, Addr: e.addr, Authority: e.echo.String()})
		require.NoError(c, err)
		defer s.Close()
		_, err = s.Write([]byte("after"))
		require.NoError(c, err)
		b := make([]byte, 5)
		_, err = io.ReadFull(s, b)
		require.NoError(c, err)
	}, 10*time.Second, 50*time.Millisecond)
	require.Equal(t, int64(2), e.ln.accepted.Load(), "a second connection replaced the silent one")
}

// TestSilentClientConnectionIsClosed: a client goes silent with a stream
// open (its node vanished). The server's unanswered ping closes the
// connection instead of holding it, and the stream, until the idle timeout.
func TestSilentClientConnectionIsClosed(t *testing.T) {
	d := &freezingDialer{}
	e := newEnvConfig(t, ServerConfig{HealthCheckInterval: 100 * time.Millisecond, HealthCheckTimeout: 100 * time.Millisecond},
		ClientConfig{HealthCheckInterval: time.Hour})
	e.client.dialer = d
	s := e.dial(t)
	defer s.Close()
	roundTrip(t, s, "before")
	require.Equal(t, int64(1), e.ln.open.Load())
	d.freeze()
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.Equal(c, int64(0), e.ln.open.Load())
	}, 10*time.Second, 20*time.Millisecond)
}
