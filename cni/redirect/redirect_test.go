//go:build linux

package redirect_test

import (
	"bufio"
	"context"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/isthmus-mesh/isthmus/cni/redirect"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns/netnstest"
)

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" {
		os.Exit(dialHelper())
	}
	if os.Getenv(applyEnv) != "" {
		os.Exit(applyHelper())
	}
	goleak.VerifyTestMain(m)
}

// topo is a node with two pods, P and Q, each behind a veth, dual-stack:
// P is 10.250.1.2 / fd00:250:1::2, Q is 10.250.2.2 / fd00:250:2::2, and the
// node's ends are .1 / ::1 of each subnet. The node forwards between them.
type topo struct {
	node, p, q   *os.File
	p4, p6, q4   netip.Addr
	q6, nodeP4   netip.Addr
	nodeQ4       netip.Addr
	nodeP6       netip.Addr
	probeAllowed bool
}

func newTopo(t *testing.T) *topo {
	t.Helper()
	tp := &topo{node: netnstest.New(t), p: netnstest.New(t), q: netnstest.New(t)}
	mp := netip.MustParsePrefix
	netnstest.Veth(t, tp.node, "vp", mp("10.250.1.1/24"), tp.p, "eth0", mp("10.250.1.2/24"))
	netnstest.Veth(t, tp.node, "vq", mp("10.250.2.1/24"), tp.q, "eth0", mp("10.250.2.2/24"))
	for _, v := range []struct {
		ns   *os.File
		link string
		addr netip.Prefix
	}{{tp.node, "vp", mp("fd00:250:1::1/64")}, {tp.p, "eth0", mp("fd00:250:1::2/64")},
		{tp.node, "vq", mp("fd00:250:2::1/64")}, {tp.q, "eth0", mp("fd00:250:2::2/64")}} {
		h := netnstest.Handle(t, v.ns)
		l, err := h.LinkByName(v.link)
		require.NoError(t, err)
		netnstest.AddAddr(t, h, l, v.addr)
	}
	netnstest.Route(t, tp.p, mp("0.0.0.0/0"), netip.MustParseAddr("10.250.1.1"))
	netnstest.Route(t, tp.p, mp("::/0"), netip.MustParseAddr("fd00:250:1::1"))
	netnstest.Route(t, tp.q, mp("0.0.0.0/0"), netip.MustParseAddr("10.250.2.1"))
	netnstest.Route(t, tp.q, mp("::/0"), netip.MustParseAddr("fd00:250:2::1"))
	netnstest.Sysctl(t, tp.node, "net/ipv4/ip_forward", "1")
	netnstest.Sysctl(t, tp.node, "net/ipv6/conf/all/forwarding", "1")
	a := netip.MustParseAddr
	tp.p4, tp.p6, tp.q4, tp.q6 = a("10.250.1.2"), a("fd00:250:1::2"), a("10.250.2.2"), a("fd00:250:2::2")
	tp.nodeP4, tp.nodeQ4, tp.nodeP6 = a("10.250.1.1"), a("10.250.2.1"), a("fd00:250:1::1")
	return tp
}

// accepted is what a test server saw of one connection.
type accepted struct {
	remote, origDst netip.AddrPort
	redirected      bool
}

// server is a named TCP listener in a namespace: it answers each
// connection with its name and records what it saw.
type server struct {
	name string
	ln   net.Listener
	got  chan accepted
}

func serve(t *testing.T, ns *os.File, addr, name string) *server {
	t.Helper()
	ln, err := netns.Listen(context.Background(), ns, "tcp", addr, nil)
	require.NoError(t, err, "listen %s on %s", name, addr)
	s := &server{name: name, ln: ln, got: make(chan accepted, 16)}
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			dst, ok, _ := netns.OriginalDst(c)
			s.got <- accepted{remote: c.RemoteAddr().(*net.TCPAddr).AddrPort(), origDst: dst, redirected: ok}
			_, _ = c.Write([]byte(name + "\n"))
			c.Close()
		}
	})
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	return s
}

func (s *server) next(t *testing.T) accepted {
	t.Helper()
	select {
	case a := <-s.got:
		return a
	case <-time.After(10 * time.Second):
		t.Fatalf("server %s accepted nothing", s.name)
		return accepted{}
	}
}

// who connects from ns (no mark unless d says so) to dst and returns the
// name of the server that answered.
func who(t *testing.T, d *netns.Dialer, dst netip.AddrPort) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := d.DialContext(ctx, "tcp", dst.String())
	require.NoError(t, err, "dial %s", dst)
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	require.NoError(t, err, "read from %s", dst)
	return strings.TrimSpace(line)
}

func ap(a netip.Addr, port uint16) netip.AddrPort { return netip.AddrPortFrom(a, port) }

func TestPodRulesCapture(t *testing.T) {
	tp := newTopo(t)
	require.NoError(t, redirect.Apply(tp.p, redirect.Options{
		ExcludeDestinations: []netip.Prefix{netip.PrefixFrom(tp.nodeP4, 32)},
	}))
	out := serve(t, tp.p, "[::]:15001", "outbound")
	in := serve(t, tp.p, "[::]:15006", "inbound")
	hbone := serve(t, tp.p, "[::]:15008", "hbone")
	app := serve(t, tp.p, "[::]:8080", "p-app")
	lo := serve(t, tp.p, "127.0.0.1:9000", "p-loopback")
	qApp := serve(t, tp.q, "[::]:80", "q-app")
	nodeSrv := serve(t, tp.node, "10.250.1.1:81", "node")

	fromP := &netns.Dialer{NetNS: tp.p}
	fromQ := &netns.Dialer{NetNS: tp.q}

	t.Run("outbound IPv4 goes to 15001 with its original destination", func(t *testing.T) {
		require.Equal(t, "outbound", who(t, fromP, ap(tp.q4, 80)))
		a := out.next(t)
		require.True(t, a.redirected)
		require.Equal(t, ap(tp.q4, 80), a.origDst)
		require.Equal(t, tp.p4, a.remote.Addr().Unmap())
	})
	t.Run("outbound IPv6 goes to 15001 with its original destination", func(t *testing.T) {
		require.Equal(t, "outbound", who(t, fromP, ap(tp.q6, 80)))
		a := out.next(t)
		require.True(t, a.redirected)
		require.Equal(t, ap(tp.q6, 80), a.origDst)
	})
	t.Run("with MarkOnly, marked sockets are not captured", func(t *testing.T) {
		require.NoError(t, redirect.Apply(tp.p, redirect.Options{MarkOnly: true,
			ExcludeDestinations: []netip.Prefix{netip.PrefixFrom(tp.nodeP4, 32)}}))
		marked := &netns.Dialer{NetNS: tp.p, Mark: redirect.Mark}
		require.Equal(t, "q-app", who(t, marked, ap(tp.q4, 80)))
		require.Equal(t, tp.p4, qApp.next(t).remote.Addr().Unmap())
		// Only the mark's bits under the mask count.
		otherBits := &netns.Dialer{NetNS: tp.p, Mark: redirect.Mark | 0x10000}
		require.Equal(t, "q-app", who(t, otherBits, ap(tp.q6, 80)))
		qApp.next(t)
	})
	t.Run("loopback and excluded destinations are untouched", func(t *testing.T) {
		require.Equal(t, "p-loopback", who(t, fromP, netip.MustParseAddrPort("127.0.0.1:9000")))
		lo.next(t)
		require.Equal(t, "node", who(t, fromP, ap(tp.nodeP4, 81)))
		require.Equal(t, tp.p4, nodeSrv.next(t).remote.Addr())
		// The pod's own address goes over loopback too.
		require.Equal(t, "p-app", who(t, fromP, ap(tp.p4, 8080)))
		app.next(t)
	})
	t.Run("inbound TCP goes to 15006, HBONE to 15008 as sent", func(t *testing.T) {
		require.Equal(t, "inbound", who(t, fromQ, ap(tp.p4, 8080)))
		a := in.next(t)
		require.Equal(t, ap(tp.p4, 8080), a.origDst)
		require.Equal(t, tp.q4, a.remote.Addr().Unmap())
		require.Equal(t, "inbound", who(t, fromQ, ap(tp.p6, 8080)))
		require.Equal(t, ap(tp.p6, 8080), in.next(t).origDst)
		require.Equal(t, "hbone", who(t, fromQ, ap(tp.p4, 15008)))
		require.Equal(t, tp.q4, hbone.next(t).remote.Addr().Unmap())
	})
	require.Empty(t, out.got)
	require.Empty(t, in.got)
}

func TestProbesAreSNATedOnTheNode(t *testing.T) {
	tp := newTopo(t)
	require.NoError(t, redirect.Apply(tp.p, redirect.Options{}))
	require.NoError(t, redirect.ApplyNode(tp.node, []netip.Addr{tp.p4, tp.p6}))
	got, err := redirect.NodeAddrs(tp.node)
	require.NoError(t, err)
	require.Equal(t, []netip.Addr{tp.p4, tp.p6}, got)

	in := serve(t, tp.p, "[::]:15006", "inbound")
	app := serve(t, tp.p, "[::]:8080", "p-app")
	qApp := serve(t, tp.q, "[::]:8080", "q-app")
	fromNode := &netns.Dialer{NetNS: tp.node}

	require.Equal(t, "p-app", who(t, fromNode, ap(tp.p4, 8080)), "a probe from the node reaches the app")
	require.Equal(t, redirect.ProbeAddr4, app.next(t).remote.Addr().Unmap())
	require.Equal(t, "p-app", who(t, fromNode, ap(tp.p6, 8080)))
	require.Equal(t, redirect.ProbeAddr6, app.next(t).remote.Addr())

	// A pod not in the set is reached with the node's own address.
	require.Equal(t, "q-app", who(t, fromNode, ap(tp.q4, 8080)))
	require.Equal(t, tp.nodeQ4, qApp.next(t).remote.Addr().Unmap())

	// Traffic routed through the node from another pod keeps its source,
	// so it is captured by P's inbound.
	require.Equal(t, "inbound", who(t, &netns.Dialer{NetNS: tp.q}, ap(tp.p4, 8080)))
	require.Equal(t, tp.q4, in.next(t).remote.Addr().Unmap())

	// The set follows the enrolled pods.
	require.NoError(t, redirect.ApplyNode(tp.node, []netip.Addr{tp.p6}))
	require.Equal(t, "inbound", who(t, fromNode, ap(tp.p4, 8080)), "no longer SNAT'd: captured")
	require.Equal(t, tp.nodeP4, in.next(t).remote.Addr().Unmap())
	require.NoError(t, redirect.RemoveNode(tp.node))
	got, err = redirect.NodeAddrs(tp.node)
	require.NoError(t, err)
	require.Empty(t, got)
	require.NoError(t, redirect.RemoveNode(tp.node), "removing an absent table is fine")
}

func TestDNSRedirectIsOptional(t *testing.T) {
	tp := newTopo(t)
	ctx := context.Background()
	dns, err := netns.ListenPacket(ctx, tp.p, "udp", "[::]:15053", nil)
	require.NoError(t, err)
	defer dns.Close()
	qDNS, err := netns.ListenPacket(ctx, tp.q, "udp", "[::]:53", nil)
	require.NoError(t, err)
	defer qDNS.Close()

	send := func() {
		require.NoError(t, netns.Do(tp.p, func() error {
			c, err := net.Dial("udp", ap(tp.q4, 53).String())
			if err != nil {
				return err
			}
			defer c.Close()
			_, err = c.Write([]byte("query"))
			return err
		}))
	}
	recv := func(pc net.PacketConn) string {
		buf := make([]byte, 64)
		_ = pc.SetReadDeadline(time.Now().Add(10 * time.Second))
		n, _, err := pc.ReadFrom(buf)
		require.NoError(t, err)
		return string(buf[:n])
	}

	require.NoError(t, redirect.Apply(tp.p, redirect.Options{}))
	send()
	require.Equal(t, "query", recv(qDNS), "off by default: DNS goes where it was sent")

	require.NoError(t, redirect.Apply(tp.p, redirect.Options{RedirectDNS: true}))
	n, err := redirect.RuleCount(tp.p)
	require.NoError(t, err)
	require.Equal(t, redirect.ExpectedRules(redirect.Options{RedirectDNS: true}), n)
	// A new source port: conntrack keeps NAT decisions per flow.
	send()
	require.Equal(t, "query", recv(dns), "with RedirectDNS, UDP 53 goes to 15053")
	tcpDNS := serve(t, tp.p, "[::]:15053", "tcp-dns")
	require.Equal(t, "tcp-dns", who(t, &netns.Dialer{NetNS: tp.p}, ap(tp.q4, 53)))
	require.Equal(t, ap(tp.q4, 53), tcpDNS.next(t).origDst)
}

func TestApplyConvergesAndRemoveIsExact(t *testing.T) {
	ns := netnstest.New(t)
	// Another component's table must survive everything we do.
	c, err := nftables.New(nftables.WithNetNSFd(int(ns.Fd())))
	require.NoError(t, err)
	c.AddTable(&nftables.Table{Name: "other", Family: nftables.TableFamilyINet})
	require.NoError(t, c.Flush())

	present, err := redirect.Present(ns)
	require.NoError(t, err)
	require.False(t, present)
	require.NoError(t, redirect.Remove(ns), "removing an absent table is fine")

	withDNS := redirect.Options{RedirectDNS: true, ExcludeDestinations: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}}
	for _, opts := range []redirect.Options{{}, {}, withDNS, withDNS, {}} {
		require.NoError(t, redirect.Apply(ns, opts))
		n, err := redirect.RuleCount(ns)
		require.NoError(t, err)
		require.Equal(t, redirect.ExpectedRules(opts), n, "Apply replaces, never appends")
	}
	require.NoError(t, redirect.Remove(ns))
	present, err = redirect.Present(ns)
	require.NoError(t, err)
	require.False(t, present)
	tables, err := c.ListTablesOfFamily(nftables.TableFamilyINet)
	require.NoError(t, err)
	require.Len(t, tables, 1)
	require.Equal(t, "other", tables[0].Name)
}
