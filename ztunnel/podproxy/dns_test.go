//go:build linux

package podproxy

import (
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	mdns "github.com/miekg/dns"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/ztunnel/dns"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
)

// askIn sends one A query for name from inside ns to server over proto and
// waits at most timeout for the answer.
func askIn(ns *os.File, proto string, server netip.AddrPort, name string, timeout time.Duration) (*mdns.Msg, error) {
	var conn net.Conn
	err := netns.Do(ns, func() (err error) {
		conn, err = net.DialTimeout(proto, server.String(), timeout)
		return err
	})
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	c := &mdns.Client{Net: proto, Timeout: timeout}
	q := new(mdns.Msg)
	q.SetQuestion(name, mdns.TypeA)
	q.SetEdns0(4096, false)
	r, _, err := c.ExchangeWithConn(q, &mdns.Conn{Conn: conn})
	return r, err
}

// TestPodDNSAnswersOnlyThePod: the in-pod DNS proxy is no open resolver.
// From another namespace (the node's, as any host that can reach a pod's
// address), a query to <pod IP>:15053 gets no answer: not a mesh answer,
// not a forwarded one (UDP inbound is not captured, so only where the
// listener is bound protects it). The pod's own queries are answered: to
// 127.0.0.1:15053 and [::1]:15053 directly, and to its nameserver's
// address on port 53, redirected by the pod rules (cni/redirect with
// RedirectDNS, applied in the pod's namespace by newEnv) to loopback.
func TestPodDNSAnswersOnlyThePod(t *testing.T) {
	e := newEnv(t)
	upstream, asked := startUpstream(t, map[string]netip.Addr{"example.org.": netip.MustParseAddr("192.0.2.7")})
	e.upstream = upstream
	e.start(t)
	port := uint16(defaults.DNSPort)
	for _, proto := range []string{"udp", "tcp"} {
		for _, name := range []string{"b.app.svc.cluster.local.", "example.org."} {
			_, err := askIn(e.node, proto, netip.AddrPortFrom(b4, port), name, 500*time.Millisecond)
			require.Error(t, err, "a stranger asked pod B's DNS proxy for %s over %s", name, proto)
		}
	}
	require.Empty(t, asked(), "nothing forwarded for a stranger")

	answer := func(r *mdns.Msg, err error) string {
		t.Helper()
		require.NoError(t, err)
		require.Len(t, r.Answer, 1)
		return r.Answer[0].(*mdns.A).A.String()
	}
	servers := []netip.AddrPort{
		netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), port),
		netip.AddrPortFrom(netip.IPv6Loopback(), port),
		netip.AddrPortFrom(dnsVIP, 53), // redirected to 127.0.0.1:15053
	}
	for _, server := range servers {
		for _, proto := range []string{"udp", "tcp"} {
			require.Equal(t, vip.String(), answer(askIn(e.b, proto, server, "b.app.svc.cluster.local.", 5*time.Second)), "%s over %s", server, proto)
			require.Equal(t, "192.0.2.7", answer(askIn(e.b, proto, server, "example.org.", 5*time.Second)), "%s over %s", server, proto)
		}
	}
	require.Len(t, asked(), len(servers)*2, "the pod's own external queries were forwarded")
	// The stranger's queries never reached the handler as DNS: UDP ones
	// find no socket; TCP ones are redirected to 15006 and refused there.
	require.Equal(t, 0.0, counter(t, e.reg, "isthmus_dns_refused_total", map[string]string{"reason": dns.RefusedUnknownClient}))

	// The second line: a query that reaches the loopback listener from a
	// source that is neither loopback nor the pod's (sent here with a
	// forged source from inside the pod, as a listener bound too widely
	// would let a stranger) is dropped unanswered and counted.
	q := new(mdns.Msg)
	q.SetQuestion("example.org.", mdns.TypeA)
	raw, err := q.Pack()
	require.NoError(t, err)
	require.NoError(t, netns.Do(e.b, func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		if err := unix.SetsockoptInt(fd, unix.SOL_IP, unix.IP_TRANSPARENT, 1); err != nil {
			return err
		}
		if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{192, 0, 2, 99}, Port: 5353}); err != nil {
			return err
		}
		return unix.Sendto(fd, raw, 0, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}, Port: int(port)})
	}))
	require.Eventually(t, func() bool {
		return counter(t, e.reg, "isthmus_dns_refused_total", map[string]string{"reason": dns.RefusedUnknownClient}) == 1
	}, 5*time.Second, 10*time.Millisecond)
	require.Len(t, asked(), len(servers)*2, "nothing forwarded for the forged source")
}
