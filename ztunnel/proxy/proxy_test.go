package proxy

import (
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

func TestSameNetworkEchoThroughSOCKS5(t *testing.T) {
	m := newMesh(t, nil)
	m.echoVia(t, echoHost)                   // domain name
	m.echoVia(t, m.vip.String())             // IPv4 service VIP
	m.echoViaPort(t, m.b1.String(), appPort) // workload address and port

	require.True(t, m.dialer.dialedHost(m.b1))
	require.False(t, m.dialer.dialedHost(m.gwAddr), "same-network traffic must not use the gateway")
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.Equal(c, 3.0, m.mB.OpenedCount(metrics.ReporterDestination))
		require.Equal(c, 3.0, m.mB.ClosedCount(metrics.ReporterDestination))
		require.Equal(c, 3.0, m.mOut.ClosedCount(metrics.ReporterSource))
	}, 5*time.Second, 10*time.Millisecond)
	// All three streams shared one pooled HBONE connection to node B.
	require.Equal(t, 1, len(m.dialer.dialed()))
}

func TestCrossNetworkDoubleHBONE(t *testing.T) {
	m := newMesh(t, func(m *mesh) {})
	// Take b1 out so the only ready endpoint is the synthetic n2 one.
	m.n1.Update(func(tx *state.Tx) { tx.RemoveWorkload("b1") })

	const n = 5
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() { m.echoVia(t, echoHost) })
	}
	wg.Wait()

	require.False(t, m.dialer.dialedHost(m.c1), "client dialled a network-2 pod address: %v", m.dialer.dialed())
	require.True(t, m.dialer.dialedHost(m.gwAddr))
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.GreaterOrEqual(c, m.mGW.OpenedCount(metrics.ReporterGateway), 1.0)
		require.Equal(c, float64(n), m.mC.OpenedCount(metrics.ReporterDestination))
	}, 5*time.Second, 10*time.Millisecond)
	// Inner tunnels are pooled: the n streams rode fewer outer streams.
	require.Less(t, m.mGW.OpenedCount(metrics.ReporterGateway), float64(n))
}

// TestGatewayKnownByHostname: network n1 knows n2's gateway only by DNS
// name (a cloud load balancer); the client ztunnel resolves it (preferring
// IPv4) when it opens an outer connection, and the tunnels that follow ride
// the pooled one without resolving again.
func TestGatewayKnownByHostname(t *testing.T) {
	m := newMesh(t, func(m *mesh) { m.gwHostname = "gw.n2.example" })
	m.n1.Update(func(tx *state.Tx) { tx.RemoveWorkload("b1") })

	for range 3 {
		m.echoVia(t, echoHost)
	}
	require.True(t, m.dialer.dialedHost(m.gwAddr))
	require.False(t, m.dialer.dialedHost(m.c1))
	require.Equal(t, 1, m.resolver.count(), "one outer connection, one lookup")
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.Equal(c, 3.0, m.mC.OpenedCount(metrics.ReporterDestination))
	}, 5*time.Second, 10*time.Millisecond)
}

// TestGatewayHostnameThatDoesNotResolve: the connection is refused (a SOCKS
// failure reply) and counted; nothing is dialled.
func TestGatewayHostnameThatDoesNotResolve(t *testing.T) {
	m := newMesh(t, func(m *mesh) { m.gwHostname = "gone.n2.example" })
	m.n1.Update(func(tx *state.Tx) { tx.RemoveWorkload("b1") })
	m.resolver.mu.Lock()
	clear(m.resolver.names)
	m.resolver.mu.Unlock()

	c, code := socksDial(t, m.socksAddr, m.a1, echoHost, svcPort)
	defer c.Close()
	require.NotEqual(t, byte(0), code)
	require.Equal(t, 1, m.resolver.count())
	require.False(t, m.dialer.dialedHost(m.gwAddr))
	require.Equal(t, 1.0, m.mOut.RefusedCount(metrics.ReporterSource, ReasonUpstreamUnavailble))
}

func TestInnerTunnelsArePooled(t *testing.T) {
	m := newMesh(t, nil)
	m.n1.Update(func(tx *state.Tx) { tx.RemoveWorkload("b1") })
	for range 4 { // sequential: each new stream reuses the idle inner connection
		m.echoVia(t, echoHost)
	}
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.Equal(c, 4.0, m.mC.OpenedCount(metrics.ReporterDestination))
	}, 5*time.Second, 10*time.Millisecond)
	require.Equal(t, 1.0, m.mGW.OpenedCount(metrics.ReporterGateway))
	// One TCP dial: the outer connection to the gateway.
	require.Equal(t, []string{m.gwAddr.String() + ":15008"}, m.dialer.dialed())
}

func TestPreferLocalThenFailOverToGateway(t *testing.T) {
	m := newMesh(t, nil)
	for range 3 {
		m.echoVia(t, echoHost)
	}
	require.Equal(t, 0.0, m.mGW.OpenedCount(metrics.ReporterGateway))
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.Equal(c, 3.0, m.mB.OpenedCount(metrics.ReporterDestination))
	}, 5*time.Second, 10*time.Millisecond)

	m.n1.Update(func(tx *state.Tx) {
		w, _ := m.n1.Load().Workload("b1")
		nw := *w
		nw.Status = state.StatusNotReady
		tx.UpsertWorkload(&nw)
	})
	m.echoVia(t, echoHost)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.Equal(c, 1.0, m.mGW.OpenedCount(metrics.ReporterGateway))
		require.Equal(c, 1.0, m.mC.OpenedCount(metrics.ReporterDestination))
	}, 5*time.Second, 10*time.Millisecond)
	require.Equal(t, 3.0, m.mB.OpenedCount(metrics.ReporterDestination))
	require.False(t, m.dialer.dialedHost(m.c1))
}

func TestSOCKS5Errors(t *testing.T) {
	m := newMesh(t, nil)
	c, code := socksDial(t, m.socksAddr, m.a1, "nope.default.svc.cluster.local", svcPort)
	c.Close()
	require.Equal(t, byte(socksHostUnreachable), code)

	// A client address that is not a workload of this node is refused.
	c, code = socksDial(t, m.socksAddr, m.b1, echoHost, svcPort)
	c.Close()
	require.Equal(t, byte(socksNotAllowed), code)
	require.Equal(t, 1.0, m.mOut.RefusedCount(metrics.ReporterSource, ReasonUnknownSource))
	require.Equal(t, 1.0, m.mOut.RefusedCount(metrics.ReporterSource, ReasonNoRoute))
}

func TestTransparentListenerUsesOriginalDestination(t *testing.T) {
	m := newMesh(t, nil)
	// Without iptables the original destination is the listener's own
	// address: listen on the service VIP and port.
	ln, err := net.Listen("tcp", netip.AddrPortFrom(m.vip, svcPort).String())
	require.NoError(t, err)
	var wg sync.WaitGroup
	wg.Go(func() { _ = m.out.ServeTransparent(ln) })
	t.Cleanup(func() { ln.Close(); wg.Wait() })

	d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(m.a1, 0))}
	c, err := d.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	defer c.Close()
	got, err := echoOnce(c.(*net.TCPConn), "transparent")
	require.NoError(t, err)
	require.Equal(t, "transparent", got)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.Equal(c, 1.0, m.mB.OpenedCount(metrics.ReporterDestination))
	}, 5*time.Second, 10*time.Millisecond)
}

func TestConnectionMetricsLabels(t *testing.T) {
	m := newMesh(t, nil)
	m.echoVia(t, echoHost)
	want := metrics.ConnLabels{
		Reporter:             metrics.ReporterDestination,
		SourcePrincipal:      "spiffe://cluster.local/ns/default/sa/client",
		DestinationPrincipal: "spiffe://cluster.local/ns/default/sa/echo",
		SourceCluster:        "c1", DestinationCluster: "c1",
		SourceNetwork: "n1", DestinationNetwork: "n1",
	}
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		st := m.mB.ConnStats(want)
		require.Equal(c, metrics.ConnStats{Opened: 1, Closed: 1, Sent: float64(len("hello " + echoHost)), Received: float64(len("hello " + echoHost))}, st)
		src := want
		src.Reporter = metrics.ReporterSource
		require.Equal(c, 1.0, m.mOut.ConnStats(src).Closed)
	}, 5*time.Second, 10*time.Millisecond)
}
