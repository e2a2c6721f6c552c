//go:build linux

// Package nettopo builds small networks of Linux network namespaces:
// namespaces (anonymous, or bind-mounted at a path as `ip netns add` and
// container runtimes do), veth pairs between them, bridges, addresses,
// routes, links removed, sysctls, and a forward filter that passes only
// chosen addresses (a wan between networks: filter.go), all through netlink
// and system calls (no `ip` or `nft` binary). Every function works only
// inside the namespaces it is given and returns an error instead of failing
// a test; the demo and test/framework/realnode build their isolated
// networks with it, and ztunnel/netns/netnstest wraps it for tests.
//
// Creating and entering namespaces needs CAP_SYS_ADMIN, changing their
// links CAP_NET_ADMIN — as root, or in a user namespace that owns them.
package nettopo

import (
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
)

// PrivilegeHint says what creating namespaces needs, for error messages.
const PrivilegeHint = "network namespaces need root (CAP_SYS_ADMIN, CAP_NET_ADMIN) or a user namespace of one's own"

// New creates a network namespace whose loopback is up and returns it as an
// open file; the namespace lives while the file (or a socket, process or
// mount in it) does. If path is not empty the namespace is also
// bind-mounted there (Unmount removes it).
func New(path string) (*os.File, error) {
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
		return nil, fmt.Errorf("nettopo: create a network namespace (%s): %w", PrivilegeHint, r.err)
	}
	if err := LoopbackUp(r.f); err != nil {
		r.f.Close()
		if path != "" {
			_ = Unmount(path)
		}
		return nil, err
	}
	return r.f, nil
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
		if err == nil && path != "" {
			_ = Unmount(path)
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

// Unmount removes the bind mount at path (lazily, as `ip netns del` does)
// and the file under it. A path that is not mounted is only removed.
func Unmount(path string) error {
	err := unix.Unmount(path, unix.MNT_DETACH)
	if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
		err = nil // not a mount point (any more)
	}
	if rerr := os.Remove(path); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
		err = errors.Join(err, rerr)
	}
	if err != nil {
		return fmt.Errorf("nettopo: unmount %s: %w", path, err)
	}
	return nil
}

// Handle returns a netlink handle working in ns; the caller closes it. Its
// sockets are created by a thread inside ns (netns.Do), so no thread is
// ever left in ns.
func Handle(ns *os.File) (*netlink.Handle, error) {
	var h *netlink.Handle
	err := netns.Do(ns, func() (err error) {
		h, err = netlink.NewHandle()
		return err
	})
	if err != nil {
		if h != nil {
			h.Close()
		}
		return nil, fmt.Errorf("nettopo: netlink handle in %s: %w", ns.Name(), err)
	}
	return h, nil
}

// inHandle runs fn with a netlink handle in ns.
func inHandle(ns *os.File, fn func(h *netlink.Handle) error) error {
	h, err := Handle(ns)
	if err != nil {
		return err
	}
	defer h.Close()
	return fn(h)
}

// LoopbackUp sets the loopback interface of ns up.
func LoopbackUp(ns *os.File) error {
	return inHandle(ns, func(h *netlink.Handle) error {
		lo, err := h.LinkByName("lo")
		if err != nil {
			return fmt.Errorf("nettopo: loopback of %s: %w", ns.Name(), err)
		}
		if err := h.LinkSetUp(lo); err != nil {
			return fmt.Errorf("nettopo: set loopback of %s up: %w", ns.Name(), err)
		}
		return nil
	})
}

// Veth connects namespaces a and b with a veth pair: interface aName in a
// with address aAddr, interface bName in b with address bAddr (prefixes
// with the subnet length, e.g. 10.250.1.2/24; an invalid prefix adds no
// address). Both ends are brought up. IPv6 addresses skip duplicate
// address detection so they work at once.
func Veth(a *os.File, aName string, aAddr netip.Prefix, b *os.File, bName string, bAddr netip.Prefix) error {
	ha, err := Handle(a)
	if err != nil {
		return err
	}
	defer ha.Close()
	hb, err := Handle(b)
	if err != nil {
		return err
	}
	defer hb.Close()
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: aName}, PeerName: bName, PeerNamespace: netlink.NsFd(int(b.Fd()))}
	if err := ha.LinkAdd(veth); err != nil {
		return fmt.Errorf("nettopo: add veth %s/%s: %w", aName, bName, err)
	}
	for _, side := range []struct {
		h    *netlink.Handle
		name string
		addr netip.Prefix
	}{{ha, aName, aAddr}, {hb, bName, bAddr}} {
		link, err := side.h.LinkByName(side.name)
		if err != nil {
			return fmt.Errorf("nettopo: veth end %s: %w", side.name, err)
		}
		if side.addr.IsValid() {
			if err := AddAddr(side.h, link, side.addr); err != nil {
				return err
			}
		}
		if err := side.h.LinkSetUp(link); err != nil {
			return fmt.Errorf("nettopo: set %s up: %w", side.name, err)
		}
	}
	return nil
}

// AddAddr adds addr to link (IPv6 without duplicate address detection).
func AddAddr(h *netlink.Handle, link netlink.Link, addr netip.Prefix) error {
	a := &netlink.Addr{IPNet: prefixNet(addr)}
	if addr.Addr().Is6() {
		a.Flags = unix.IFA_F_NODAD
	}
	if err := h.AddrAdd(link, a); err != nil {
		return fmt.Errorf("nettopo: add %s to %s: %w", addr, link.Attrs().Name, err)
	}
	return nil
}

// AddAddrTo adds addr to the interface named link in ns.
func AddAddrTo(ns *os.File, link string, addr netip.Prefix) error {
	return inHandle(ns, func(h *netlink.Handle) error {
		l, err := h.LinkByName(link)
		if err != nil {
			return fmt.Errorf("nettopo: %s in %s: %w", link, ns.Name(), err)
		}
		return AddAddr(h, l, addr)
	})
}

// Bridge creates a bridge named name in ns with address addr (none if
// invalid) and brings it up. Its MAC address is set, as CNI's bridge plugin
// sets it: a bridge left to choose takes its lowest port's, so removing that
// port would change the gateway's MAC under every neighbour cache that knows
// it and cut off the other ports for seconds.
func Bridge(ns *os.File, name string, addr netip.Prefix) error {
	mac := net.HardwareAddr{0x02, 0, 0, 0, 0, 0} // locally administered
	if addr.Addr().Is4() {
		a := addr.Addr().As4()
		copy(mac[2:], a[:])
	} else if _, err := rand.Read(mac[1:]); err != nil {
		return err
	}
	return inHandle(ns, func(h *netlink.Handle) error {
		if err := h.LinkAdd(&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: name, HardwareAddr: mac}}); err != nil {
			return fmt.Errorf("nettopo: add bridge %s: %w", name, err)
		}
		br, err := h.LinkByName(name)
		if err != nil {
			return fmt.Errorf("nettopo: bridge %s: %w", name, err)
		}
		if addr.IsValid() {
			if err := AddAddr(h, br, addr); err != nil {
				return err
			}
		}
		if err := h.LinkSetUp(br); err != nil {
			return fmt.Errorf("nettopo: set %s up: %w", name, err)
		}
		return nil
	})
}

// Attach makes the interface link of ns a port of the bridge bridge.
func Attach(ns *os.File, link, bridge string) error {
	return inHandle(ns, func(h *netlink.Handle) error {
		l, err := h.LinkByName(link)
		if err != nil {
			return fmt.Errorf("nettopo: %s: %w", link, err)
		}
		br, err := h.LinkByName(bridge)
		if err != nil {
			return fmt.Errorf("nettopo: bridge %s: %w", bridge, err)
		}
		if err := h.LinkSetMaster(l, br); err != nil {
			return fmt.Errorf("nettopo: attach %s to %s: %w", link, bridge, err)
		}
		return nil
	})
}

// DeleteLink deletes the interface named link in ns (a veth takes its peer
// along).
func DeleteLink(ns *os.File, link string) error {
	return inHandle(ns, func(h *netlink.Handle) error {
		l, err := h.LinkByName(link)
		if err != nil {
			return fmt.Errorf("nettopo: %s: %w", link, err)
		}
		if err := h.LinkDel(l); err != nil {
			return fmt.Errorf("nettopo: delete %s: %w", link, err)
		}
		return nil
	})
}

// Route adds a route to dst via gw in ns.
func Route(ns *os.File, dst netip.Prefix, gw netip.Addr) error {
	return inHandle(ns, func(h *netlink.Handle) error {
		if err := h.RouteAdd(&netlink.Route{Dst: prefixNet(dst), Gw: net.IP(gw.AsSlice())}); err != nil {
			return fmt.Errorf("nettopo: route %s via %s in %s: %w", dst, gw, ns.Name(), err)
		}
		return nil
	})
}

// Sysctl writes value to /proc/sys/<key> as seen from inside ns, e.g.
// Sysctl(node, "net/ipv4/ip_forward", "1") (netns.Sysctl).
func Sysctl(ns *os.File, key, value string) error {
	return netns.Sysctl(ns, key, value)
}

func prefixNet(p netip.Prefix) *net.IPNet {
	bits := 32
	if p.Addr().Is6() {
		bits = 128
	}
	return &net.IPNet{IP: net.IP(p.Addr().AsSlice()), Mask: net.CIDRMask(p.Bits(), bits)}
}
