//go:build linux

package redirect_test

import (
	"context"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/cni/redirect"
	"github.com/isthmus-mesh/isthmus/internal/nettopo"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns/netnstest"
)

// spoof connects from ns with the host-probe address of dst's family as its
// source and reports whether the connection was made.
func spoof(t *testing.T, ns *os.File, dst netip.AddrPort) error {
	t.Helper()
	src := redirect.ProbeAddr4
	if dst.Addr().Is6() {
		src = redirect.ProbeAddr6
	}
	d := &netns.Dialer{NetNS: ns, LocalAddr: netip.AddrPortFrom(src, 0), Timeout: 2 * time.Second}
	c, err := d.DialContext(context.Background(), "tcp", dst.String())
	if err == nil {
		c.Close()
	}
	return err
}

// attackerOwnsProbeAddrs gives the attacker's namespace the probe
// addresses and routes them back to it from the node, so that a pod's
// answers to them reach it: the spoofer of issue 31 item 7 at its
// strongest.
func attackerOwnsProbeAddrs(t *testing.T, node, attacker *os.File, link string, via4, via6 netip.Addr) {
	t.Helper()
	h := netnstest.Handle(t, attacker)
	l, err := h.LinkByName(link)
	require.NoError(t, err)
	netnstest.AddAddr(t, h, l, netip.PrefixFrom(redirect.ProbeAddr4, 32))
	netnstest.AddAddr(t, h, l, netip.PrefixFrom(redirect.ProbeAddr6, 128))
	netnstest.Route(t, node, netip.PrefixFrom(redirect.ProbeAddr4, 32), via4)
	netnstest.Route(t, node, netip.PrefixFrom(redirect.ProbeAddr6, 128), via6)
}

// TestProbeAddressCannotBeSpoofed: another pod sends to an enrolled pod
// with the host-probe address as its source, through the node. Without the
// node's anti-spoof rules the pod's rules let it through to the
// application, around ztunnel and its policy.
func TestProbeAddressCannotBeSpoofed(t *testing.T) {
	tp := newTopo(t)
	require.NoError(t, redirect.Apply(tp.p, redirect.Options{}))
	require.NoError(t, redirect.ApplyNode(tp.node, []netip.Addr{tp.p4, tp.p6}))
	attackerOwnsProbeAddrs(t, tp.node, tp.q, "eth0", tp.q4, tp.q6)
	in := serve(t, tp.p, "[::]:15006", "inbound")
	app := serve(t, tp.p, "[::]:8080", "p-app")

	for _, dst := range []netip.AddrPort{ap(tp.p4, 8080), ap(tp.p6, 8080)} {
		require.Error(t, spoof(t, tp.q, dst), "a spoofed probe source to %s is dropped on the node", dst)
	}
	require.Empty(t, app.got, "the application saw no spoofed connection")
	require.Empty(t, in.got)

	// The node's own probes still reach the application.
	fromNode := &netns.Dialer{NetNS: tp.node}
	require.Equal(t, "p-app", who(t, fromNode, ap(tp.p4, 8080)))
	require.Equal(t, redirect.ProbeAddr4, app.next(t).remote.Addr().Unmap())
	require.Equal(t, "p-app", who(t, fromNode, ap(tp.p6, 8080)))
	require.Equal(t, redirect.ProbeAddr6, app.next(t).remote.Addr())

	// RemoveNode takes both node tables, and only them.
	require.NoError(t, redirect.RemoveNode(tp.node))
	c, err := nftables.New(nftables.WithNetNSFd(int(tp.node.Fd())))
	require.NoError(t, err)
	tables, err := c.ListTables()
	require.NoError(t, err)
	require.Empty(t, tables)
}

// TestProbeAddressCannotBeSpoofedAcrossABridge: pods on one Linux bridge
// reach each other at layer 2, never through the node's inet hooks; the
// node's bridge table drops the spoofed frames.
func TestProbeAddressCannotBeSpoofedAcrossABridge(t *testing.T) {
	node, p, q := netnstest.New(t), netnstest.New(t), netnstest.New(t)
	mp, a := netip.MustParsePrefix, netip.MustParseAddr
	require.NoError(t, nettopo.Bridge(node, "br0", mp("10.250.9.1/24")))
	require.NoError(t, nettopo.AddAddrTo(node, "br0", mp("fd00:250:9::1/64")))
	for _, pod := range []struct {
		ns          *os.File
		link        string
		addr, addr6 netip.Prefix
	}{{p, "vp", mp("10.250.9.2/24"), mp("fd00:250:9::2/64")}, {q, "vq", mp("10.250.9.3/24"), mp("fd00:250:9::3/64")}} {
		netnstest.Veth(t, node, pod.link, netip.Prefix{}, pod.ns, "eth0", pod.addr)
		require.NoError(t, nettopo.AddAddrTo(pod.ns, "eth0", pod.addr6))
		require.NoError(t, nettopo.Attach(node, pod.link, "br0"))
		netnstest.Route(t, pod.ns, mp("0.0.0.0/0"), a("10.250.9.1"))
		netnstest.Route(t, pod.ns, mp("::/0"), a("fd00:250:9::1"))
	}
	netnstest.Sysctl(t, node, "net/ipv4/ip_forward", "1")
	netnstest.Sysctl(t, node, "net/ipv6/conf/all/forwarding", "1")
	// As on a node without br_netfilter (this kernel has it built in):
	// bridged frames skip the inet hooks.
	netnstest.Sysctl(t, node, "net/bridge/bridge-nf-call-iptables", "0")
	netnstest.Sysctl(t, node, "net/bridge/bridge-nf-call-ip6tables", "0")
	p4, p6 := a("10.250.9.2"), a("fd00:250:9::2")
	attackerOwnsProbeAddrs(t, node, q, "eth0", a("10.250.9.3"), a("fd00:250:9::3"))

	require.NoError(t, redirect.Apply(p, redirect.Options{}))
	require.NoError(t, redirect.ApplyNode(node, []netip.Addr{p4, p6}))
	app := serve(t, p, "[::]:8080", "p-app")
	in := serve(t, p, "[::]:15006", "inbound")

	for _, dst := range []netip.AddrPort{ap(p4, 8080), ap(p6, 8080)} {
		require.Error(t, spoof(t, q, dst), "a spoofed probe source to %s is dropped on the bridge", dst)
	}
	require.Empty(t, app.got, "the application saw no spoofed connection")
	require.Empty(t, in.got)
	// Q's ordinary traffic crosses the bridge and is captured by P.
	require.Equal(t, "inbound", who(t, &netns.Dialer{NetNS: q}, ap(p4, 8080)))
	require.Equal(t, a("10.250.9.3"), in.next(t).remote.Addr().Unmap())
	// The node's probes, sent through the bridge, reach the application.
	fromNode := &netns.Dialer{NetNS: node}
	require.Equal(t, "p-app", who(t, fromNode, ap(p4, 8080)))
	require.Equal(t, redirect.ProbeAddr4, app.next(t).remote.Addr().Unmap())
	require.Equal(t, "p-app", who(t, fromNode, ap(p6, 8080)))
	require.Equal(t, redirect.ProbeAddr6, app.next(t).remote.Addr())
}
