package proxy

// Tests written as an attacker would try: a tenant holding a valid mesh
// certificate standing in for a gateway or a destination, request data aimed
// at metric labels, connections aimed back at ztunnel itself, and tunnels
// through a gateway to services that must stay inside their cluster.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/isthmus-mesh/isthmus/ztunnel/hbone"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

var (
	realGatewayID = identity.Identity{TrustDomain: trustDomain, Namespace: "istio-system", ServiceAccount: "eastwest"}
	tenantID      = identity.Identity{TrustDomain: trustDomain, Namespace: "tenant", ServiceAccount: "evil"}
)

// rogueGateway runs a gateway of network n2 with a tenant's (valid) mesh
// identity on its own address: what a tenant who got clients to dial it
// (a forged gateway Service, a hijacked address) would run.
func (m *mesh) rogueGateway(t *testing.T) (*state.NetworkGateway, *metrics.Metrics) {
	mm := newMetrics(t)
	g, err := NewGateway(GatewayConfig{Config: Config{Node: "node-evil"}, Network: "n2", Cluster: "c2", Identity: tenantID},
		Deps{Store: m.n2, Certs: m.certs, Metrics: mm, Log: testLog(t)}, state.Selector{})
	require.NoError(t, err)
	ln, err := net.Listen("tcp", netip.AddrPortFrom(nextAddr(), 15008).String())
	require.NoError(t, err)
	var wg sync.WaitGroup
	wg.Go(func() { _ = g.Serve(ln) })
	t.Cleanup(func() { g.Close(); wg.Wait() })
	ap := netip.MustParseAddrPort(ln.Addr().String())
	// Clients are told to expect the real gateway's identity at this address.
	return &state.NetworkGateway{Network: "n2", Address: ap.Addr(), HBONEPort: ap.Port(), Identities: []identity.Identity{realGatewayID}}, mm
}

// setRemote replaces network 1's split-horizon workload for echo.
func (m *mesh) setRemote(gws []*state.NetworkGateway, ids ...identity.Identity) {
	m.n1.Update(func(tx *state.Tx) {
		tx.UpsertWorkload(&state.Workload{
			UID: "n2/echo", Name: "echo", Namespace: "default", Network: "n2", TrustDomain: trustDomain,
			Protocol: state.TunnelHBONE, Identities: ids, Gateways: gws, Status: state.StatusReady, Capacity: 1,
			Services: map[string]state.PortMap{echoKey: {svcPort: appPort}},
		})
	})
}

func (m *mesh) realGateway() *state.NetworkGateway {
	return &state.NetworkGateway{Network: "n2", Address: m.gwAddr, HBONEPort: 15008, Identities: []identity.Identity{realGatewayID}}
}

// onlyRemote makes echo reachable from network 1 only through a gateway.
func (m *mesh) onlyRemote() {
	m.n1.Update(func(tx *state.Tx) { tx.RemoveWorkload("b1") })
}

// TestGatewayPresentingAnotherIdentityIsRefused: a tenant with a valid
// workload certificate answering as network 2's gateway is refused (outer
// hop) with its own reason, and never sees the tunnel; with the real
// gateway listed too, the connection falls over to it and works.
func TestGatewayPresentingAnotherIdentityIsRefused(t *testing.T) {
	m := newMesh(t, nil)
	m.onlyRemote()
	rogue, mRogue := m.rogueGateway(t)

	m.setRemote([]*state.NetworkGateway{rogue}, workloadID("echo"))
	c, code := socksDial(t, m.socksAddr, m.a1, echoHost, svcPort)
	c.Close()
	require.NotEqual(t, byte(0), code, "a gateway with a tenant's identity must not carry the tunnel")
	require.Equal(t, 1.0, m.mOut.RefusedCount(metrics.ReporterSource, ReasonGatewayIdentity))
	require.Zero(t, mRogue.OpenedCount(metrics.ReporterGateway), "the rogue gateway forwarded nothing")

	// Both listed: whichever is tried first, the connection goes through
	// the real gateway; a rogue tried first is counted once more.
	m.setRemote([]*state.NetworkGateway{rogue, m.realGateway()}, workloadID("echo"))
	for range 4 {
		m.echoVia(t, echoHost)
	}
	require.Zero(t, mRogue.OpenedCount(metrics.ReporterGateway))
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		// Inner tunnels are pooled: four connections share outer streams.
		require.GreaterOrEqual(c, m.mGW.OpenedCount(metrics.ReporterGateway), 1.0)
	}, 5*time.Second, 10*time.Millisecond)
}

// TestInnerPeerPresentingAnotherIdentityIsRefused: behind the real gateway,
// the endpoint that answers end to end runs as a tenant's identity (the
// gateway picked an endpoint the client's view does not vouch for): the
// inner TLS session is refused with its own reason.
func TestInnerPeerPresentingAnotherIdentityIsRefused(t *testing.T) {
	m := newMesh(t, nil)
	m.onlyRemote()
	m.n2.Update(func(tx *state.Tx) {
		tx.UpsertWorkload(pod("c1", m.c1, "node-c", "n2", "c2", "evil")) // c1's inbound now presents default/evil
	})
	c, code := socksDial(t, m.socksAddr, m.a1, echoHost, svcPort)
	c.Close()
	require.NotEqual(t, byte(0), code)
	require.Equal(t, 1.0, m.mOut.RefusedCount(metrics.ReporterSource, ReasonPeerIdentity))
	require.Zero(t, m.mC.OpenedCount(metrics.ReporterDestination), "nothing reached the app")

	// The real identity works.
	m.n2.Update(func(tx *state.Tx) { tx.UpsertWorkload(pod("c1", m.c1, "node-c", "n2", "c2", "echo")) })
	m.echoVia(t, echoHost)
}

// TestSameNetworkPeerIdentityIsExact: on the same network the destination
// must present exactly the identity xDS gives it.
func TestSameNetworkPeerIdentityIsExact(t *testing.T) {
	m := newMesh(t, nil)
	// node-d's own view places d1 as "evil"; network 1's clients expect "echo".
	d1 := nextAddr()
	startEcho(t, d1)
	view := state.NewStore()
	view.Update(func(tx *state.Tx) { tx.UpsertWorkload(pod("d1", d1, "node-d", "n1", "c1", "evil")) })
	in, err := NewInbound(Config{Node: "node-d"}, Deps{Store: view, Certs: m.certs, Log: testLog(t)})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { _ = in.Run(ctx) })
	t.Cleanup(func() { cancel(); wg.Wait() })
	require.Eventually(t, in.Ready, 5*time.Second, 10*time.Millisecond)
	m.n1.Update(func(tx *state.Tx) {
		tx.RemoveWorkload("b1")
		tx.UpsertWorkload(pod("d1", d1, "node-d", "n1", "c1", "echo"))
	})
	// The impostor is refused; the connection goes on to the next endpoint
	// (network 2's, through the gateway).
	m.echoVia(t, echoHost)
	require.Equal(t, 1.0, m.mOut.RefusedCount(metrics.ReporterSource, ReasonPeerIdentity))
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.Equal(c, 1.0, m.mGW.OpenedCount(metrics.ReporterGateway))
	}, 5*time.Second, 10*time.Millisecond)
	// With no other endpoint, the connection fails.
	m.n1.Update(func(tx *state.Tx) { tx.RemoveWorkload("n2/echo") })
	c, code := socksDial(t, m.socksAddr, m.a1, echoHost, svcPort)
	c.Close()
	require.NotEqual(t, byte(0), code)
	require.Equal(t, 2.0, m.mOut.RefusedCount(metrics.ReporterSource, ReasonPeerIdentity))
}

// seriesCount returns the number of label sets of a metric family.
func seriesCount(t *testing.T, g prometheus.Gatherer, name string) int {
	mfs, err := g.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name {
			return len(mf.GetMetric())
		}
	}
	return 0
}

func heapInUse() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapInuse
}

// countingListener counts the connections open on it.
type countingListener struct {
	net.Listener
	open atomic.Int64
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	l.open.Add(1)
	return &countedConn{Conn: c, l: l}, nil
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

// TestBaggageNeverBecomesALabel: 3,000 CONNECTs with unique baggage values
// (cluster and network names a client made up) leave the series count and
// the heap flat, and a value that is not valid UTF-8 neither panics nor
// leaks the upstream connection ztunnel dialled.
func TestBaggageNeverBecomesALabel(t *testing.T) {
	reg := prometheus.NewRegistry()
	mB, err := metrics.New(reg)
	require.NoError(t, err)
	var m *mesh
	m = newMesh(t, func(mm *mesh) { mm.mB = mB })
	app := netip.AddrPortFrom(nextAddr(), appPort)
	ln, err := net.Listen("tcp", app.String())
	require.NoError(t, err)
	cl := &countingListener{Listener: ln}
	go func() {
		for {
			c, err := cl.Accept()
			if err != nil {
				return
			}
			go func() { defer c.Close(); _, _ = c.Read(make([]byte, 1)) }()
		}
	}()
	t.Cleanup(func() { ln.Close() })
	m.n1.Update(func(tx *state.Tx) {
		w := pod("b2", app.Addr(), "node-b", "n1", "c1", "echo")
		tx.UpsertWorkload(w)
	})
	require.Eventually(t, func() bool {
		c, err := net.Dial("tcp", netip.AddrPortFrom(app.Addr(), 15008).String())
		if err == nil {
			c.Close()
		}
		return err == nil
	}, 5*time.Second, 10*time.Millisecond)

	client, err := hbone.NewClient(hbone.ClientConfig{}, hbone.ClientDeps{Certs: m.certs})
	require.NoError(t, err)
	defer client.Close()
	dial := func(bg string) error {
		s, err := client.Dial(t.Context(), hbone.DialRequest{
			Source: workloadID("client"), Peers: []identity.Identity{workloadID("echo")},
			Addr: netip.AddrPortFrom(app.Addr(), 15008), Authority: app.String(),
			Header: http.Header{HeaderBaggage: {bg}},
		})
		if err != nil {
			return err
		}
		return s.Close()
	}
	require.NoError(t, dial("k8s.cluster.name=c1,isthmus.network=n1"))
	const name = "isthmus_tcp_connections_opened_total"
	before, heapBefore := seriesCount(t, reg, name), heapInUse()
	for i := range 3000 {
		require.NoError(t, dial(fmt.Sprintf("k8s.cluster.name=made-up-%d,isthmus.network=net-%d", i, i)))
	}
	after, heapAfter := seriesCount(t, reg, name), heapInUse()
	require.LessOrEqual(t, after-before, 1, "made-up names share the one 'unknown' series")
	require.Less(t, int64(heapAfter)-int64(heapBefore), int64(4<<20), "heap grew by %d bytes", int64(heapAfter)-int64(heapBefore))

	require.NoError(t, dial("k8s.cluster.name=\xff\xfe,isthmus.network=\xc3"))
	require.Eventually(t, func() bool { return cl.open.Load() == 0 }, 10*time.Second, 10*time.Millisecond,
		"every upstream connection closed")
}

// TestNodeAddressIsNeitherSourceNorDestination: a connection to
// <node IP>:15001 does not make ztunnel dial itself, a service whose
// endpoint is the node's own address (a hostNetwork pod) is refused, and a
// connection from the node address is nobody's.
func TestNodeAddressIsNeitherSourceNorDestination(t *testing.T) {
	nodeIP := nextAddr()
	m := newMesh(t, nil)
	out, err := NewOutbound(Config{Node: "node-a", NodeIPs: []netip.Addr{nodeIP}},
		Deps{Store: m.n1, Certs: m.certs, Metrics: m.mOut, Log: testLog(t)}, state.Selector{})
	require.NoError(t, err)
	raw, err := net.Listen("tcp", netip.AddrPortFrom(nodeIP, 15001).String())
	require.NoError(t, err)
	ln := &countingListener{Listener: raw}
	var accepted atomic.Int64
	counting := acceptCounter{Listener: ln, n: &accepted}
	sraw, err := net.Listen("tcp", netip.AddrPortFrom(nodeIP, 15080).String())
	require.NoError(t, err)
	var wg sync.WaitGroup
	wg.Go(func() { _ = out.ServeTransparent(counting) })
	wg.Go(func() { _ = out.ServeSOCKS5(sraw) })
	t.Cleanup(func() { out.Close(); wg.Wait() })

	// The ztunnel pod itself: hostNetwork on the node address, backing a
	// service on 15001 (as a careless chart might).
	m.n1.Update(func(tx *state.Tx) {
		zt := pod("ztunnel", nodeIP, "node-a", "n1", "c1", "ztunnel")
		zt.HostNetwork, zt.Protocol = true, state.TunnelNone
		zt.Services = map[string]state.PortMap{"default/loop.default.svc.cluster.local": {15001: 15001}}
		tx.UpsertWorkload(zt)
		tx.UpsertService(&state.Service{Name: "loop", Namespace: "default", Ports: []uint16{15001}})
	})

	// a1 connects straight to <node IP>:15001: not redirected, so the
	// original destination is the listener itself.
	d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(m.a1, 0))}
	c, err := d.Dial("tcp", netip.AddrPortFrom(nodeIP, 15001).String())
	require.NoError(t, err)
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err = c.Read(make([]byte, 1))
	require.Error(t, err, "closed, not proxied")
	c.Close()

	// Through SOCKS5, to the service backed by the node address.
	sc, code := socksDial(t, netip.MustParseAddrPort(sraw.Addr().String()), m.a1, "loop.default.svc.cluster.local", 15001)
	sc.Close()
	require.Equal(t, byte(socksGeneralFailure), code)
	require.Equal(t, 1.0, m.mOut.RefusedCount(metrics.ReporterSource, ReasonSelfDestination))
	require.Eventually(t, func() bool { return ln.open.Load() == 0 }, 5*time.Second, 10*time.Millisecond)
	require.Equal(t, int64(1), accepted.Load(), "ztunnel never connected to its own listener")

	// From the node address, nobody is the source (not the hostNetwork pod).
	sc2, code := socksDial(t, netip.MustParseAddrPort(sraw.Addr().String()), nodeIP, echoHost, svcPort)
	sc2.Close()
	require.Equal(t, byte(socksNotAllowed), code)
}

type acceptCounter struct {
	net.Listener
	n *atomic.Int64
}

func (a acceptCounter) Accept() (net.Conn, error) {
	c, err := a.Listener.Accept()
	if err == nil {
		a.n.Add(1)
	}
	return c, err
}

// hiddenFromOtherClusters are the ways a service of cluster c2 becomes
// invisible to other clusters.
var hiddenFromOtherClusters = []struct {
	name string
	mut  func(*state.Service)
}{
	{"cluster-local", func(s *state.Service) { s.ClusterLocal = true }},
	{"not exported by its cluster", func(s *state.Service) { s.LocalClusters = []string{"c2"} }},
}

// TestGatewayEnforcesVisibility: the gateway refuses to forward a tunnel to
// a cluster-local service, or to a service its cluster does not export.
func TestGatewayEnforcesVisibility(t *testing.T) {
	m := newMesh(t, nil)
	m.onlyRemote()
	for _, tc := range hiddenFromOtherClusters {
		t.Run(tc.name, func(t *testing.T) {
			svc := &state.Service{Name: "echo", Namespace: "default", VIPs: []netip.Addr{m.vip}, Ports: []uint16{svcPort}}
			tc.mut(svc)
			m.n2.Update(func(tx *state.Tx) { tx.UpsertService(svc) })
			before := m.mGW.RefusedCount(metrics.ReporterGateway, ReasonNotVisible)
			c, code := socksDial(t, m.socksAddr, m.a1, echoHost, svcPort)
			c.Close()
			require.NotEqual(t, byte(0), code)
			require.Equal(t, before+1, m.mGW.RefusedCount(metrics.ReporterGateway, ReasonNotVisible))
		})
	}
	m.n2.Update(func(tx *state.Tx) {
		tx.UpsertService(&state.Service{Name: "echo", Namespace: "default", VIPs: []netip.Addr{m.vip}, Ports: []uint16{svcPort}})
	})
	m.echoVia(t, echoHost)
}

// TestGatewayClosesTunnelsNoLongerVisible: an open connection through the
// gateway (a pooled inner tunnel the gateway cannot see into) is closed
// when its service becomes invisible to other clusters, and counted; an
// unrelated state change closes nothing; the next connection is refused.
func TestGatewayClosesTunnelsNoLongerVisible(t *testing.T) {
	for _, tc := range hiddenFromOtherClusters {
		t.Run(tc.name, func(t *testing.T) {
			m := newMesh(t, nil)
			m.onlyRemote()
			c, code := socksDial(t, m.socksAddr, m.a1, echoHost, svcPort)
			defer c.Close()
			require.Equal(t, byte(0), code)
			_, err := c.Write([]byte("ping"))
			require.NoError(t, err)
			buf := make([]byte, 4)
			_, err = io.ReadFull(c, buf)
			require.NoError(t, err)
			require.Equal(t, 1, m.gw.Open())

			// A change of another service keeps the tunnel.
			m.n2.Update(func(tx *state.Tx) {
				tx.UpsertService(&state.Service{Name: "other", Namespace: "default", Ports: []uint16{svcPort}, ClusterLocal: true})
			})
			_, err = c.Write([]byte("pong"))
			require.NoError(t, err)
			_, err = io.ReadFull(c, buf)
			require.NoError(t, err)
			require.Equal(t, "pong", string(buf))
			require.Zero(t, m.mGW.RefusedCount(metrics.ReporterGateway, ReasonNoLongerVisible))

			svc := &state.Service{Name: "echo", Namespace: "default", VIPs: []netip.Addr{m.vip}, Ports: []uint16{svcPort}}
			tc.mut(svc)
			m.n2.Update(func(tx *state.Tx) { tx.UpsertService(svc) })
			_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
			_, err = io.ReadAll(c)
			var ne net.Error
			require.False(t, errors.As(err, &ne) && ne.Timeout(), "the connection was closed, not left open: %v", err)
			require.Equal(t, 1.0, m.mGW.RefusedCount(metrics.ReporterGateway, ReasonNoLongerVisible))
			require.Eventually(t, func() bool { return m.gw.Open() == 0 }, 5*time.Second, 10*time.Millisecond)

			c2, code := socksDial(t, m.socksAddr, m.a1, echoHost, svcPort)
			c2.Close()
			require.NotEqual(t, byte(0), code)
		})
	}
}

// TestConnectionCaps: over the per-peer cap, the HBONE server closes a new
// connection at once and counts it; the outbound listener likewise per
// client address.
func TestConnectionCaps(t *testing.T) {
	m := newMesh(t, func(m *mesh) { m.serverConfig.MaxConnsPerPeer = 1 })
	cert, err := m.certs.Certificate(t.Context(), workloadID("client"))
	require.NoError(t, err)
	first, err := rawHBONE(t, netip.AddrPortFrom(m.b1, 15008), cert)
	require.NoError(t, err)
	code, err := roundTrip(first, http.MethodConnect, netip.AddrPortFrom(m.b1, appPort).String(), nil)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, code)
	_, err = rawHBONE(t, netip.AddrPortFrom(m.b1, 15008), cert)
	require.Error(t, err, "a second connection from the same address is closed")
	require.Equal(t, 1.0, m.mB.RefusedCount(metrics.ReporterDestination, hbone.ReasonPeerConnLimit))
	first.Close()
	require.Eventually(t, func() bool {
		c, err := rawHBONE(t, netip.AddrPortFrom(m.b1, 15008), cert)
		if err == nil {
			c.Close()
		}
		return err == nil
	}, 5*time.Second, 10*time.Millisecond, "the peer's slot is free again once its connection closed")

	out, err := NewOutbound(Config{Node: "node-a", MaxClientConnsPerSource: 1},
		Deps{Store: m.n1, Certs: m.certs, Metrics: m.mOut, Log: testLog(t),
			Dialer: &net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(nextAddr(), 0))}}, state.Selector{})
	require.NoError(t, err)
	sln, err := net.Listen("tcp", netip.AddrPortFrom(nextAddr(), 15080).String())
	require.NoError(t, err)
	var wg sync.WaitGroup
	wg.Go(func() { _ = out.ServeSOCKS5(sln) })
	t.Cleanup(func() { out.Close(); wg.Wait() })
	keep, code2 := socksDial(t, netip.MustParseAddrPort(sln.Addr().String()), m.a1, echoHost, svcPort)
	defer keep.Close()
	require.Equal(t, byte(0), code2)
	d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(m.a1, 0))}
	c, err := d.Dial("tcp", sln.Addr().String())
	require.NoError(t, err)
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err = c.Read(make([]byte, 1))
	require.Error(t, err)
	require.Equal(t, 1.0, m.mOut.RefusedCount(metrics.ReporterSource, ReasonSourceConnLimit))
}

// TestConnectFailureFailover: the preferred endpoint (same cluster) is
// still marked ready but refuses connections (its node is gone); within
// the one client connection, ztunnel tries the next endpoint in preference
// order, and counts the failed attempt. New connections then try it last
// until its ejection ends, and first again after.
func TestConnectFailureFailover(t *testing.T) {
	clock := clocktesting.NewFakeClock(time.Now())
	m := newMesh(t, func(m *mesh) { m.now = clock.Now })
	dead := nextAddr() // nothing listens there, not even an inbound
	m.n1.Update(func(tx *state.Tx) {
		w := pod("b0", dead, "node-gone", "n1", "c1", "echo")
		tx.UpsertWorkload(w)
		// b1 moves to another cluster of the same network: b0 (same
		// cluster as the client) is preferred.
		b1 := pod("b1", m.b1, "node-b", "n1", "c9", "echo")
		tx.UpsertWorkload(b1)
	})
	deadDials := func() int {
		n := 0
		for _, a := range m.dialer.dialed() {
			if ap, err := netip.ParseAddrPort(a); err == nil && ap.Addr() == dead {
				n++
			}
		}
		return n
	}
	for range 3 {
		m.echoVia(t, echoHost)
	}
	require.Equal(t, 1, deadDials(), "only the first connection tried b0: it is ejected after failing")
	require.Equal(t, 1.0, m.mOut.RefusedCount(metrics.ReporterSource, ReasonUpstreamUnavailble))

	clock.Step(DefaultConfig().EjectionTime + time.Second)
	m.echoVia(t, echoHost)
	require.Equal(t, 2, deadDials(), "once its ejection ended, b0 is preferred again")
	m.echoVia(t, echoHost)
	require.Equal(t, 2, deadDials(), "and ejected again by that failure")
}
