//go:build linux

// Package netnstest builds small networks of Linux network namespaces for
// tests: thin testing.TB wrappers over internal/nettopo (namespaces,
// anonymous or bind-mounted at a path as `ip netns add` does, veth pairs,
// addresses, routes and sysctls, through netlink and system calls, no `ip`
// binary). Everything is removed when the test ends; nothing is changed in
// the test process' own namespace.
//
// The tests need root (CAP_SYS_ADMIN and CAP_NET_ADMIN); without it they
// fail with a message that says so.
package netnstest

import (
	"net/netip"
	"os"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/isthmus-mesh/isthmus/internal/nettopo"
)

// New creates a network namespace whose loopback is up. It is deleted when
// the test ends (once the returned file and every socket in it are closed).
func New(tb testing.TB) *os.File {
	tb.Helper()
	return create(tb, "")
}

// NewAt creates a network namespace like New and bind-mounts it at path, as
// a container runtime does under /var/run/netns; the mount is removed when
// the test ends.
func NewAt(tb testing.TB, path string) *os.File {
	tb.Helper()
	return create(tb, path)
}

func create(tb testing.TB, path string) *os.File {
	tb.Helper()
	f, err := nettopo.New(path)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if path != "" {
			_ = nettopo.Unmount(path)
		}
		_ = f.Close()
	})
	return f
}

// Handle returns a netlink handle working in ns, closed when the test ends.
func Handle(tb testing.TB, ns *os.File) *netlink.Handle {
	tb.Helper()
	h, err := nettopo.Handle(ns)
	if err != nil {
		tb.Fatalf("%v (%s)", err, nettopo.PrivilegeHint)
	}
	tb.Cleanup(h.Close)
	return h
}

// Veth connects namespaces a and b with a veth pair (see nettopo.Veth).
func Veth(tb testing.TB, a *os.File, aName string, aAddr netip.Prefix, b *os.File, bName string, bAddr netip.Prefix) {
	tb.Helper()
	if err := nettopo.Veth(a, aName, aAddr, b, bName, bAddr); err != nil {
		tb.Fatal(err)
	}
}

// AddAddr adds addr to link (IPv6 without duplicate address detection).
func AddAddr(tb testing.TB, h *netlink.Handle, link netlink.Link, addr netip.Prefix) {
	tb.Helper()
	if err := nettopo.AddAddr(h, link, addr); err != nil {
		tb.Fatal(err)
	}
}

// Route adds a route to dst via gw in ns.
func Route(tb testing.TB, ns *os.File, dst netip.Prefix, gw netip.Addr) {
	tb.Helper()
	if err := nettopo.Route(ns, dst, gw); err != nil {
		tb.Fatal(err)
	}
}

// Sysctl writes value to /proc/sys/<key> as seen from inside ns, e.g.
// Sysctl(tb, node, "net/ipv4/ip_forward", "1").
func Sysctl(tb testing.TB, ns *os.File, key, value string) {
	tb.Helper()
	if err := nettopo.Sysctl(ns, key, value); err != nil {
		tb.Fatal(err)
	}
}
