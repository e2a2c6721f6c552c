//go:build linux

// Package netnstest builds small networks of Linux network namespaces for
// tests: namespaces (anonymous, or bind-mounted at a path as `ip netns add`
// does), veth pairs between them, addresses, routes and sysctls, all through
// netlink and system calls (no `ip` binary). Everything is removed when the
// test ends; nothing is changed in the test process' own namespace.
//
// The tests need root (CAP_SYS_ADMIN and CAP_NET_ADMIN); without it they
// fail with a message that says so.
package netnstest

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/vishvananda/netlink"
	vnetns "github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
)

const privilegeHint = "network namespace tests run as root (CAP_SYS_ADMIN, CAP_NET_ADMIN)"

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
	type result struct {
		f   *os.File
		err error
	}
	res := make(chan result, 1)
	go func() {
		f, err := unshareLocked(path)
		res <- result{f, err}
	}()
	r := <-res
	if r.err != nil {
		tb.Fatalf("create a network namespace (%s): %v", privilegeHint, r.err)
	}
	tb.Cleanup(func() {
		if path != "" {
			_ = unix.Unmount(path, unix.MNT_DETACH)
			_ = os.Remove(path)
		}
		_ = r.f.Close()
	})
	h := Handle(tb, r.f)
	lo, err := h.LinkByName("lo")
	if err != nil {
		tb.Fatalf("loopback of the new namespace: %v", err)
	}
	if err := h.LinkSetUp(lo); err != nil {
		tb.Fatalf("set loopback up: %v", err)
	}
	return r.f
}

// unshareLocked moves its locked thread into a new network namespace, opens
// it (and bind-mounts it at path), and returns the thread to the original
// namespace. If the return fails the thread stays locked and dies with the
// goroutine.
func unshareLocked(path string) (*os.File, error) {
	runtime.LockOSThread()
	orig, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		runtime.UnlockOSThread()
		return nil, err
	}
	defer orig.Close()
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("unshare: %w", err)
	}
	f, err := os.Open("/proc/thread-self/ns/net")
	if err == nil && path != "" {
		err = bindMount(path)
	}
	if serr := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); serr != nil {
		if f != nil {
			f.Close()
		}
		return nil, fmt.Errorf("return to the original namespace: %w", serr)
	}
	runtime.UnlockOSThread()
	if err != nil {
		if f != nil {
			f.Close()
		}
		return nil, err
	}
	return f, nil
}

func bindMount(path string) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	mf, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_RDONLY, 0o444)
	if err != nil {
		return err
	}
	mf.Close()
	if err := unix.Mount("/proc/thread-self/ns/net", path, "none", unix.MS_BIND, ""); err != nil {
		os.Remove(path)
		return fmt.Errorf("bind-mount at %s: %w", path, err)
	}
	return nil
}

// Handle returns a netlink handle working in ns, closed when the test ends.
func Handle(tb testing.TB, ns *os.File) *netlink.Handle {
	tb.Helper()
	h, err := netlink.NewHandleAt(vnetns.NsHandle(int(ns.Fd())))
	if err != nil {
		tb.Fatalf("netlink handle in %s (%s): %v", ns.Name(), privilegeHint, err)
	}
	tb.Cleanup(h.Close)
	return h
}

// Veth connects namespaces a and b with a veth pair: interface aName in a
// with address aAddr, interface bName in b with address bAddr (prefixes
// with the subnet length, e.g. 10.250.1.2/24). Both ends are brought up.
// IPv6 addresses skip duplicate address detection so they work at once.
func Veth(tb testing.TB, a *os.File, aName string, aAddr netip.Prefix, b *os.File, bName string, bAddr netip.Prefix) {
	tb.Helper()
	ha, hb := Handle(tb, a), Handle(tb, b)
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: aName}, PeerName: bName, PeerNamespace: netlink.NsFd(int(b.Fd()))}
	if err := ha.LinkAdd(veth); err != nil {
		tb.Fatalf("add veth %s/%s: %v", aName, bName, err)
	}
	for _, side := range []struct {
		h    *netlink.Handle
		name string
		addr netip.Prefix
	}{{ha, aName, aAddr}, {hb, bName, bAddr}} {
		link, err := side.h.LinkByName(side.name)
		if err != nil {
			tb.Fatalf("veth end %s: %v", side.name, err)
		}
		if side.addr.IsValid() {
			AddAddr(tb, side.h, link, side.addr)
		}
		if err := side.h.LinkSetUp(link); err != nil {
			tb.Fatalf("set %s up: %v", side.name, err)
		}
	}
}

// AddAddr adds addr to link (IPv6 without duplicate address detection).
func AddAddr(tb testing.TB, h *netlink.Handle, link netlink.Link, addr netip.Prefix) {
	tb.Helper()
	a := &netlink.Addr{IPNet: prefixNet(addr)}
	if addr.Addr().Is6() {
		a.Flags = unix.IFA_F_NODAD
	}
	if err := h.AddrAdd(link, a); err != nil {
		tb.Fatalf("add %s to %s: %v", addr, link.Attrs().Name, err)
	}
}

// Route adds a route to dst via gw in ns.
func Route(tb testing.TB, ns *os.File, dst netip.Prefix, gw netip.Addr) {
	tb.Helper()
	h := Handle(tb, ns)
	if err := h.RouteAdd(&netlink.Route{Dst: prefixNet(dst), Gw: net.IP(gw.AsSlice())}); err != nil {
		tb.Fatalf("route %s via %s: %v", dst, gw, err)
	}
}

// Sysctl writes value to /proc/sys/<key> as seen from inside ns, e.g.
// Sysctl(tb, node, "net/ipv4/ip_forward", "1").
func Sysctl(tb testing.TB, ns *os.File, key, value string) {
	tb.Helper()
	err := netns.Do(ns, func() error {
		return os.WriteFile(filepath.Join("/proc/sys", key), []byte(value), 0o644)
	})
	if err != nil {
		tb.Fatalf("sysctl %s=%s: %v", key, value, err)
	}
}

func prefixNet(p netip.Prefix) *net.IPNet {
	bits := 32
	if p.Addr().Is6() {
		bits = 128
	}
	return &net.IPNet{IP: net.IP(p.Addr().AsSlice()), Mask: net.CIDRMask(p.Bits(), bits)}
}
