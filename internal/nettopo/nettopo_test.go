//go:build linux

package nettopo

import (
	"context"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func newNS(t *testing.T, path string) *os.File {
	t.Helper()
	f, err := New(path)
	require.NoError(t, err)
	t.Cleanup(func() {
		f.Close()
		if path != "" {
			_ = Unmount(path)
		}
	})
	return f
}

// TestBridgedPods builds a node with a bridge and two pods on it, routed to
// a third namespace through the node, checks that connections flow, then
// deletes one pod's veth and checks that it is gone from the node.
func TestBridgedPods(t *testing.T) {
	node, a, b, far := newNS(t, ""), newNS(t, ""), newNS(t, ""), newNS(t, "")
	mp := netip.MustParsePrefix
	require.NoError(t, Bridge(node, "br0", mp("10.9.1.1/24")))
	for _, p := range []struct {
		ns   *os.File
		veth string
		addr netip.Prefix
	}{{a, "va", mp("10.9.1.10/24")}, {b, "vb", mp("10.9.1.20/24")}} {
		require.NoError(t, Veth(node, p.veth, netip.Prefix{}, p.ns, "eth0", p.addr))
		require.NoError(t, Attach(node, p.veth, "br0"))
		require.NoError(t, Route(p.ns, mp("0.0.0.0/0"), netip.MustParseAddr("10.9.1.1")))
	}
	require.NoError(t, Veth(node, "up", mp("10.9.0.1/24"), far, "eth0", mp("10.9.0.2/24")))
	require.NoError(t, Route(far, mp("10.9.1.0/24"), netip.MustParseAddr("10.9.0.1")))
	require.NoError(t, Sysctl(node, "net/ipv4/ip_forward", "1"))
	require.NoError(t, AddAddrTo(far, "lo", mp("10.9.9.9/32")))
	require.NoError(t, Route(node, mp("10.9.9.0/24"), netip.MustParseAddr("10.9.0.2")))

	ctx := context.Background()
	serve := func(ns *os.File, addr string) {
		ln, err := netns.Listen(ctx, ns, "tcp", addr, nil)
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
	serve(b, "10.9.1.20:80")
	serve(far, "10.9.9.9:80")
	dial := func(from *os.File, to string) error {
		c, err := (&netns.Dialer{NetNS: from, Timeout: 3 * time.Second}).DialContext(ctx, "tcp", to)
		if err == nil {
			c.Close()
		}
		return err
	}
	require.NoError(t, dial(a, "10.9.1.20:80"), "pod to pod across the bridge")
	require.NoError(t, dial(a, "10.9.9.9:80"), "pod to a routed namespace through the node")

	bridgeMAC := func() string {
		h, err := Handle(node)
		require.NoError(t, err)
		defer h.Close()
		br, err := h.LinkByName("br0")
		require.NoError(t, err)
		return br.Attrs().HardwareAddr.String()
	}
	mac := bridgeMAC()
	require.NoError(t, DeleteLink(node, "vb"))
	h, err := Handle(b)
	require.NoError(t, err)
	defer h.Close()
	_, err = h.LinkByName("eth0")
	require.Error(t, err, "deleting the node's end takes the pod's end along")
	require.Equal(t, mac, bridgeMAC(), "the bridge keeps its MAC when a port goes (the pods' gateway stays known)")
	require.NoError(t, DeleteLink(node, "va"))
	require.Equal(t, mac, bridgeMAC())
	require.Error(t, DeleteLink(node, "vb"), "an absent link is an error")
}

// TestBindMount shows that a bind-mounted namespace can be opened by path
// until Unmount, which removes the mount and the file and tolerates being
// called again.
func TestBindMount(t *testing.T) {
	path := filepath.Join(t.TempDir(), "netns", "pod")
	f := newNS(t, path)
	want, err := netns.IDOf(f)
	require.NoError(t, err)
	g, err := netns.Open(path)
	require.NoError(t, err)
	got, err := netns.IDOf(g)
	g.Close()
	require.NoError(t, err)
	require.Equal(t, want, got)
	info, err := os.ReadFile("/proc/self/mountinfo")
	require.NoError(t, err)
	require.True(t, strings.Contains(string(info), path))

	require.NoError(t, Unmount(path))
	require.NoFileExists(t, path)
	require.NoError(t, Unmount(path), "unmounting twice is not an error")
	var st unix.Stat_t
	require.Error(t, unix.Stat(path, &st))
}

// TestLoopbackUp: a new namespace's loopback is up, so listeners on
// 127.0.0.1 work at once.
func TestLoopbackUp(t *testing.T) {
	ns := newNS(t, "")
	ln, err := netns.Listen(context.Background(), ns, "tcp", "127.0.0.1:0", nil)
	require.NoError(t, err)
	defer ln.Close()
	go func() {
		if c, err := ln.Accept(); err == nil {
			c.Close()
		}
	}()
	c, err := (&netns.Dialer{NetNS: ns, Timeout: 3 * time.Second}).DialContext(context.Background(), "tcp", ln.Addr().String())
	require.NoError(t, err)
	c.Close()
	_, err = net.Dial("tcp", ln.Addr().String())
	require.Error(t, err, "the namespace's loopback is not the test's")
}
