package proxy

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/isthmus-mesh/isthmus/ztunnel/internal/testnet"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/isthmus-mesh/isthmus/ztunnel/hbone"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/internal/testca"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const (
	trustDomain = "cluster.local"
	svcPort     = 18080
	appPort     = 18081
	echoHost    = "echo.default.svc.cluster.local"
	echoKey     = "default/" + echoHost
)

// nextAddr hands out a distinct loopback address (see testnet).
var nextAddr = testnet.NextAddr

// recordingDialer dials TCP and remembers every address it dialled. Dials
// to a silent address never answer, as to a node gone without a trace (its
// SYNs are dropped): they end with their context, whose error is kept.
type recordingDialer struct {
	d     net.Dialer
	mu    sync.Mutex
	addrs []string
	// silent addresses, and how their dials ended.
	silent     map[netip.Addr]bool
	silentEnds []error
}

func (r *recordingDialer) silence(a netip.Addr) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.silent == nil {
		r.silent = map[netip.Addr]bool{}
	}
	r.silent[a] = true
}

func (r *recordingDialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	r.mu.Lock()
	r.addrs = append(r.addrs, addr)
	ap, err := netip.ParseAddrPort(addr)
	silent := err == nil && r.silent[ap.Addr()]
	r.mu.Unlock()
	if silent {
		<-ctx.Done()
		r.mu.Lock()
		r.silentEnds = append(r.silentEnds, ctx.Err())
		r.mu.Unlock()
		return nil, ctx.Err()
	}
	return r.d.DialContext(ctx, network, addr)
}

// silentDials returns how the dials to silent addresses ended so far.
func (r *recordingDialer) silentDials() []error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.silentEnds)
}

func (r *recordingDialer) dialed() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.addrs)
}

func (r *recordingDialer) dialedHost(a netip.Addr) bool {
	for _, s := range r.dialed() {
		ap, err := netip.ParseAddrPort(s)
		if err == nil && ap.Addr() == a {
			return true
		}
	}
	return false
}

// sinkMagic, sent first on a connection to the echo app, turns it into a
// sink: it reads to EOF, then answers the number of bytes it read after the
// magic as a big-endian uint64 and closes (used by upload benchmarks).
const sinkMagic = "\xffSINK\x00\x00\x01"

// serveEcho echoes c until EOF and half-closes, or acts as a sink when the
// first read starts with sinkMagic.
func serveEcho(c *net.TCPConn) {
	buf := make([]byte, 512) // idle echo connections stay cheap
	n, err := c.Read(buf)
	if n >= len(sinkMagic) && string(buf[:len(sinkMagic)]) == sinkMagic {
		sink(c, uint64(n-len(sinkMagic)))
		return
	}
	if n > 0 {
		if _, werr := c.Write(buf[:n]); werr != nil {
			return
		}
	}
	if err == nil {
		_, _ = io.Copy(c, c)
	}
	_ = c.CloseWrite()
	_, _ = io.Copy(io.Discard, c)
}

// sink reads c to EOF in 64 KiB reads (like iperf; io.Discard would read
// 8 KiB at a time), then answers got plus the bytes read and half-closes.
func sink(c *net.TCPConn, got uint64) {
	buf := make([]byte, 64<<10)
	var err error
	for err == nil {
		var n int
		n, err = c.Read(buf)
		got += uint64(n)
	}
	_, _ = c.Write(binary.BigEndian.AppendUint64(nil, got))
	_ = c.CloseWrite()
}

// startEcho serves an echo app on addr:appPort that half-closes after echoing.
func startEcho(t testing.TB, addr netip.Addr) {
	testnet.Serve(t, netip.AddrPortFrom(addr, appPort).String(), serveEcho)
}

func testLog(t testing.TB) *slog.Logger {
	if _, bench := t.(*testing.B); bench {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
}

func newMetrics(t testing.TB) *metrics.Metrics {
	m, err := metrics.New(prometheus.NewRegistry())
	require.NoError(t, err)
	return m
}

func workloadID(sa string) identity.Identity {
	return identity.Identity{TrustDomain: trustDomain, Namespace: "default", ServiceAccount: sa}
}

// mesh is a two-network test mesh:
//
//	network n1: node A (client pod a1), node B (echo pod b1)
//	network n2: node C (echo pod c1), east-west gateway G
//
// Each network has its own view (store): n1 sees c1 as a synthetic workload
// behind G.
type mesh struct {
	t           testing.TB
	ca          *testca.CA
	certs       *identity.Cache
	n1, n2      *state.Store
	a1, b1, c1  netip.Addr
	vip, gwAddr netip.Addr
	socksAddr   netip.AddrPort
	dialer      *recordingDialer
	gwDialer    *recordingDialer
	// now, if set before the proxies start (tweak), is their clock.
	now          func() time.Time
	out          *Outbound
	inB, inC     *Inbound
	gw           *Gateway
	mOut, mB, mC *metrics.Metrics
	mGW          *metrics.Metrics
	serverConfig hbone.ServerConfig
	clientConfig hbone.ClientConfig
	// outCerts, if set (tweak), is the outbound proxy's certificate
	// source (certs by default).
	outCerts identity.CertSource
	// dialTimeout and attemptDelay, if set (tweak), are the proxies'.
	dialTimeout, attemptDelay time.Duration
	withoutRemote             bool
	// gwHostname, if set, is the DNS name network n1 knows the gateway by
	// (no address); resolver answers it with gwAddr.
	gwHostname string
	resolver   *fakeResolver
	// logs, if set (tweak), are the access logs of the proxies by node
	// (node-a outbound, node-b and node-c inbound, node-g the gateway).
	logs map[string]*AccessLog
	// authzC, if set (tweak), admits node-c's inbound connections.
	authzC Authorizer
}

// fakeResolver answers names from a map and counts lookups.
type fakeResolver struct {
	mu      sync.Mutex
	names   map[string][]netip.Addr
	lookups int
}

func (r *fakeResolver) LookupNetIP(_ context.Context, _, host string) ([]netip.Addr, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.lookups++
	if a, ok := r.names[host]; ok {
		return a, nil
	}
	return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
}

func (r *fakeResolver) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.lookups
}

func pod(uid string, addr netip.Addr, node, network, cluster, sa string) *state.Workload {
	return &state.Workload{
		UID: uid, Name: uid, Namespace: "default", Addresses: []netip.Addr{addr},
		Network: network, Cluster: cluster, Node: node, TrustDomain: trustDomain, ServiceAccount: sa,
		Protocol: state.TunnelHBONE, Status: state.StatusReady,
		Services: map[string]state.PortMap{echoKey: {svcPort: appPort}},
	}
}

func newMesh(t testing.TB, tweak func(*mesh)) *mesh {
	ca, err := testca.New(trustDomain)
	require.NoError(t, err)
	m := &mesh{
		t: t, ca: ca, certs: identity.NewCache(ca), n1: state.NewStore(), n2: state.NewStore(),
		a1: nextAddr(), b1: nextAddr(), c1: nextAddr(), vip: nextAddr(), gwAddr: nextAddr(),
		dialer: &recordingDialer{}, gwDialer: &recordingDialer{},
		mOut: newMetrics(t), mB: newMetrics(t), mC: newMetrics(t), mGW: newMetrics(t),
		serverConfig: hbone.ServerConfig{HandshakeTimeout: 2 * time.Second}, // long enough under load; slow-loris tests wait it out
	}
	m.socksAddr = netip.AddrPortFrom(nextAddr(), 15080)
	if tweak != nil {
		tweak(m)
	}
	svc := &state.Service{Name: "echo", Namespace: "default", VIPs: []netip.Addr{m.vip}, Ports: []uint16{svcPort}}
	gwID := identity.Identity{TrustDomain: trustDomain, Namespace: "istio-system", ServiceAccount: "eastwest"}
	gw := &state.NetworkGateway{Network: "n2", Address: m.gwAddr, HBONEPort: 15008, Identities: []identity.Identity{gwID}}
	seenFromN1 := gw
	m.resolver = &fakeResolver{names: map[string][]netip.Addr{}}
	if m.gwHostname != "" {
		seenFromN1 = &state.NetworkGateway{Network: "n2", Hostname: m.gwHostname, HBONEPort: 15008, Identities: []identity.Identity{gwID}}
		m.resolver.names[m.gwHostname] = []netip.Addr{netip.MustParseAddr("::1"), m.gwAddr} // IPv4 preferred
	}
	m.n1.Update(func(tx *state.Tx) {
		tx.UpsertService(svc)
		client := pod("a1", m.a1, "node-a", "n1", "c1", "client")
		client.Services = nil
		tx.UpsertWorkload(client)
		tx.UpsertWorkload(pod("b1", m.b1, "node-b", "n1", "c1", "echo"))
		if !m.withoutRemote {
			tx.UpsertWorkload(&state.Workload{
				UID: "n2/echo", Name: "echo", Namespace: "default", Network: "n2",
				TrustDomain: trustDomain, Protocol: state.TunnelHBONE, Identities: []identity.Identity{workloadID("echo")},
				Gateways: []*state.NetworkGateway{seenFromN1}, Status: state.StatusReady, Capacity: 1,
				Services: map[string]state.PortMap{echoKey: {svcPort: appPort}},
			})
		}
	})
	m.n2.Update(func(tx *state.Tx) {
		tx.UpsertService(svc)
		tx.UpsertWorkload(pod("c1", m.c1, "node-c", "n2", "c2", "echo"))
	})
	startEcho(t, m.b1)
	startEcho(t, m.c1)

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	cfg := func(node string) Config {
		return Config{Node: node, Server: m.serverConfig, Client: m.clientConfig, DialTimeout: m.dialTimeout, AttemptDelay: m.attemptDelay,
			AccessLog: m.logs[node]}
	}
	m.inB, err = NewInbound(cfg("node-b"), Deps{Store: m.n1, Certs: m.certs, Metrics: m.mB, Log: testLog(t)})
	require.NoError(t, err)
	m.inC, err = NewInbound(cfg("node-c"), Deps{Store: m.n2, Certs: m.certs, Metrics: m.mC, Log: testLog(t), Authorizer: m.authzC})
	require.NoError(t, err)
	for _, in := range []*Inbound{m.inB, m.inC} {
		wg.Go(func() { _ = in.Run(ctx) })
	}
	m.gw, err = NewGateway(GatewayConfig{Config: cfg("node-g"), Network: "n2", Cluster: "c2", Identity: gwID},
		Deps{Store: m.n2, Certs: m.certs, Metrics: m.mGW, Dialer: m.gwDialer, Now: m.now, Log: testLog(t)}, state.Selector{})
	require.NoError(t, err)
	gln, err := net.Listen("tcp", gw.AddrPort().String())
	require.NoError(t, err)
	wg.Go(func() { _ = m.gw.Serve(gln) })
	wg.Go(func() { _ = m.gw.Run(ctx) })
	outCerts := m.outCerts
	if outCerts == nil {
		outCerts = m.certs
	}
	m.out, err = NewOutbound(cfg("node-a"), Deps{Store: m.n1, Certs: outCerts, Metrics: m.mOut, Dialer: m.dialer, Resolver: m.resolver, Now: m.now, Log: testLog(t)}, state.Selector{})
	require.NoError(t, err)
	sln, err := net.Listen("tcp", m.socksAddr.String())
	require.NoError(t, err)
	wg.Go(func() { _ = m.out.ServeSOCKS5(sln) })
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.True(c, m.inB.Ready())
		require.True(c, m.inC.Ready())
	}, 5*time.Second, 10*time.Millisecond)
	t.Cleanup(func() {
		cancel()
		require.NoError(t, m.out.Close())
		require.NoError(t, m.gw.Close())
		wg.Wait()
	})
	return m
}

// socksDial connects from local address src through the SOCKS5 listener to
// host:port (host may be a name or an IPv4 address) and returns the reply code.
func socksDial(t testing.TB, socks netip.AddrPort, src netip.Addr, host string, port uint16) (*net.TCPConn, byte) {
	d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(src, 0)), Timeout: 5 * time.Second}
	c, err := d.Dial("tcp", socks.String())
	require.NoError(t, err)
	tc := c.(*net.TCPConn)
	_ = tc.SetDeadline(time.Now().Add(10 * time.Second))
	_, err = tc.Write([]byte{5, 1, 0})
	require.NoError(t, err)
	var sel [2]byte
	_, err = io.ReadFull(tc, sel[:])
	require.NoError(t, err)
	require.Equal(t, [2]byte{5, 0}, sel)
	req := []byte{5, 1, 0}
	if a, err := netip.ParseAddr(host); err == nil && a.Is4() {
		b := a.As4()
		req = append(append(req, 1), b[:]...)
	} else {
		req = append(append(req, 3, byte(len(host))), host...)
	}
	req = binary.BigEndian.AppendUint16(req, port)
	_, err = tc.Write(req)
	require.NoError(t, err)
	var reply [10]byte
	_, err = io.ReadFull(tc, reply[:])
	require.NoError(t, err)
	_ = tc.SetDeadline(time.Time{})
	return tc, reply[1]
}

// echoOnce writes msg, half-closes, and returns everything read until EOF.
func echoOnce(c *net.TCPConn, msg string) (string, error) {
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte(msg)); err != nil {
		return "", err
	}
	if err := c.CloseWrite(); err != nil {
		return "", err
	}
	b, err := io.ReadAll(c)
	if err != nil && !errors.Is(err, io.EOF) {
		return string(b), err
	}
	return string(b), nil
}

// echoVia opens a SOCKS5 connection from the mesh's client pod to host and
// checks an echo round trip with half-close.
func (m *mesh) echoVia(t testing.TB, host string) { m.echoViaPort(t, host, svcPort) }

// echoViaPort is echoVia to an explicit port.
func (m *mesh) echoViaPort(t testing.TB, host string, port uint16) {
	c, code := socksDial(t, m.socksAddr, m.a1, host, port)
	defer c.Close()
	require.Equal(t, byte(0), code)
	got, err := echoOnce(c, "hello "+host)
	require.NoError(t, err)
	require.Equal(t, "hello "+host, got)
}
