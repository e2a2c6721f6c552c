package proxy

import (
	"net"
	"net/http"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// TestSelf: what is ztunnel, for Check and for an HBONE hop (CheckTunnel),
// in a node's namespace and in a pod's.
func TestSelf(t *testing.T) {
	node, pod, other := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.1.0.5"), netip.MustParseAddr("10.1.0.9")
	ap := netip.MustParseAddrPort
	nodeSelf := NewSelf(SelfConfig{NodeIPs: []netip.Addr{node}})
	nodeSelf.Add(&net.TCPAddr{IP: net.IPv6zero, Port: 15001})
	nodeSelf.Add(&net.TCPAddr{IP: net.ParseIP("127.0.0.1"), Port: 15000})
	nodeSelf.AddHBONE(&net.TCPAddr{IP: other.AsSlice(), Port: 15008}) // node mode: <pod>:15008
	podSelf := NewSelf(SelfConfig{Local: func(a netip.Addr) bool { return a == pod },
		Ports: []uint16{15001, 15006, 15008, 15053}, HBONEPort: 15008})
	cases := []struct {
		s            *Self
		dst          string
		self, tunnel bool // refused by Check, by CheckTunnel
	}{
		{nodeSelf, "10.0.0.1:8080", true, true},            // a node address, any port
		{nodeSelf, "127.0.0.1:15001", true, true},          // loopback, a wildcard listener's port
		{nodeSelf, "[::ffff:127.0.0.1]:15001", true, true}, // mapped
		{nodeSelf, "0.0.0.0:15001", true, true},
		{nodeSelf, "127.0.0.1:15000", true, true},
		{nodeSelf, "127.0.0.2:15000", false, false}, // a listener on one address only
		{nodeSelf, "10.1.0.9:15008", true, false},   // an HBONE listener: a hop may reach it
		{nodeSelf, "10.1.0.9:8080", false, false},
		{nodeSelf, "10.1.0.5:15001", false, false}, // another namespace's address
		{podSelf, "10.1.0.5:15001", true, true},
		{podSelf, "10.1.0.5:15006", true, true},
		{podSelf, "10.1.0.5:15053", true, true},
		{podSelf, "10.1.0.5:15008", true, false}, // the pod's own HBONE: a hop to itself is fine
		{podSelf, "127.0.0.1:15006", true, true},
		{podSelf, "[::1]:15001", true, true},
		{podSelf, "10.1.0.5:8080", false, false},
		{podSelf, "10.1.0.9:15001", false, false}, // another pod: its inbound checks
	}
	for _, c := range cases {
		require.Equal(t, c.self, c.s.Check(ap(c.dst)) != nil, "Check %s", c.dst)
		require.Equal(t, c.tunnel, c.s.CheckTunnel(ap(c.dst)) != nil, "CheckTunnel %s", c.dst)
		if c.self {
			require.ErrorIs(t, c.s.Check(ap(c.dst)), ErrSelfDestination)
		}
	}
	nodeSelf.Remove(&net.TCPAddr{IP: net.IPv6zero, Port: 15001})
	require.NoError(t, nodeSelf.Check(ap("127.0.0.1:15001")), "a closed listener is forgotten")
}

// TestNodeInboundRefusesItsOwnListener: in node mode, a tenant Service
// whose targetPort is 15008 on a local workload makes CONNECT <pod>:15008
// a port the workload "serves"; the inbound would dial its own listener on
// that address. It answers 403 and counts self_destination instead.
func TestNodeInboundRefusesItsOwnListener(t *testing.T) {
	m := newMesh(t, nil)
	b, ok := m.n1.Load().Workload("b1")
	require.True(t, ok)
	nb := *b
	nb.Services = map[string]state.PortMap{echoKey: {svcPort: appPort}, "default/loop.default.svc.cluster.local": {svcPort: 15008}}
	m.n1.Update(func(tx *state.Tx) {
		tx.UpsertService(&state.Service{Name: "loop", Namespace: "default", Ports: []uint16{svcPort}})
		tx.UpsertWorkload(&nb)
	})
	good, err := m.ca.Certificate(t.Context(), workloadID("client"))
	require.NoError(t, err)
	cc, err := rawHBONE(t, netip.AddrPortFrom(m.b1, 15008), good)
	require.NoError(t, err)
	status, err := roundTrip(cc, http.MethodConnect, netip.AddrPortFrom(m.b1, 15008).String(), nil)
	require.NoError(t, err)
	require.Equal(t, http.StatusForbidden, status)
	require.Equal(t, 1.0, m.mB.RefusedCount(metrics.ReporterDestination, ReasonSelfDestination))
	status, err = roundTrip(cc, http.MethodConnect, netip.AddrPortFrom(m.b1, appPort).String(), nil)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, status, "the app is still reached")
}
