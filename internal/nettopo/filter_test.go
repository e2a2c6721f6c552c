//go:build linux

package nettopo

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
)

// TestPassFilter joins two namespaces through a third that runs a pass
// filter: nothing crosses until passed, an address passes every port, an
// address and port only that port, and each refusal is an immediate "no
// route to host" that the counter counts.
func TestPassFilter(t *testing.T) {
	a, wan, b := newNS(t, ""), newNS(t, ""), newNS(t, "")
	mp, ma := netip.MustParsePrefix, netip.MustParseAddr
	require.NoError(t, Veth(wan, "a", mp("10.8.1.1/24"), a, "eth0", mp("10.8.1.2/24")))
	require.NoError(t, Veth(wan, "b", mp("10.8.2.1/24"), b, "eth0", mp("10.8.2.2/24")))
	require.NoError(t, AddAddrTo(b, "lo", mp("10.8.2.3/32")))
	require.NoError(t, Route(a, mp("0.0.0.0/0"), ma("10.8.1.1")))
	require.NoError(t, Route(b, mp("0.0.0.0/0"), ma("10.8.2.1")))
	require.NoError(t, Route(wan, mp("10.8.2.3/32"), ma("10.8.2.2")))
	require.NoError(t, Sysctl(wan, "net/ipv4/ip_forward", "1"))
	const table = "isthmus-test-pass"
	require.NoError(t, NewPassFilter(wan, table))

	ctx := context.Background()
	for _, addr := range []string{"10.8.2.2:80", "10.8.2.2:81", "10.8.2.3:80"} {
		ln, err := netns.Listen(ctx, b, "tcp", addr, nil)
		require.NoError(t, err)
		t.Cleanup(func() { ln.Close() })
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				c.Close()
			}
		}()
	}
	dial := func(to string) error {
		c, err := (&netns.Dialer{NetNS: a, Timeout: 5 * time.Second}).DialContext(ctx, "tcp", to)
		if err == nil {
			c.Close()
		}
		return err
	}
	rejected := func() uint64 {
		n, err := Rejected(wan, table)
		require.NoError(t, err)
		return n
	}
	require.Zero(t, rejected())
	require.ErrorIs(t, dial("10.8.2.2:80"), unix.EHOSTUNREACH, "nothing passed yet")
	require.NotZero(t, rejected())

	require.NoError(t, PassAddrPort(wan, table, netip.MustParseAddrPort("10.8.2.2:80")))
	require.NoError(t, dial("10.8.2.2:80"), "a passed address and port")
	before := rejected()
	require.ErrorIs(t, dial("10.8.2.2:81"), unix.EHOSTUNREACH, "another port of that address")
	require.Greater(t, rejected(), before)
	require.ErrorIs(t, dial("10.8.2.3:80"), unix.EHOSTUNREACH, "another address")

	require.NoError(t, PassAddr(wan, table, ma("10.8.2.3")))
	require.NoError(t, dial("10.8.2.3:80"), "a passed address")

	require.Error(t, PassAddr(wan, table, ma("fd00::1")), "IPv6 is refused, not ignored")
	require.Error(t, PassAddrPort(wan, table, netip.MustParseAddrPort("10.8.2.2:0")))
	require.Error(t, PassAddr(wan, "no-such-table", ma("10.8.2.3")))
	_, err := Rejected(wan, "no-such-table")
	require.Error(t, err)
}
