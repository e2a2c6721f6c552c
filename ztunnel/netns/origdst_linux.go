//go:build linux

package netns

import (
	"encoding/binary"
	"errors"
	"net"
	"net/netip"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ip6tSoOriginalDst is IP6T_SO_ORIGINAL_DST (linux/netfilter_ipv6/ip6_tables.h).
const ip6tSoOriginalDst = 80

// OriginalDst returns where a connection accepted by a capturing listener was
// going before the pod's rules redirected it: SO_ORIGINAL_DST for IPv4,
// IP6T_SO_ORIGINAL_DST for IPv6 (both read conntrack's NAT record, so they
// work with nftables' redirect as with iptables' REDIRECT). A connection
// that was not redirected has its local address as original destination;
// ok is false only when conntrack has no record of the connection, and dst
// is then the local address too.
func OriginalDst(c net.Conn) (dst netip.AddrPort, ok bool, err error) {
	tc, isTCP := c.(*net.TCPConn)
	if !isTCP {
		return netip.AddrPort{}, false, errors.New("netns: original destination of a non-TCP connection")
	}
	local := tc.LocalAddr().(*net.TCPAddr).AddrPort()
	local = netip.AddrPortFrom(local.Addr().Unmap(), local.Port())
	rc, err := tc.SyscallConn()
	if err != nil {
		return local, false, err
	}
	var got netip.AddrPort
	var gerr error
	if err := rc.Control(func(fd uintptr) {
		if local.Addr().Is4() {
			got, gerr = origDst4(int(fd))
		} else {
			got, gerr = origDst6(int(fd))
		}
	}); err != nil {
		return local, false, err
	}
	if errors.Is(gerr, unix.ENOENT) || (gerr == nil && !got.Addr().IsValid()) {
		return local, false, nil
	}
	if gerr != nil {
		return local, false, gerr
	}
	return got, true, nil
}

func origDst4(fd int) (netip.AddrPort, error) {
	// sockaddr_in (16 bytes) fits the 20-byte ipv6_mreq buffer.
	m, err := unix.GetsockoptIPv6Mreq(fd, unix.SOL_IP, unix.SO_ORIGINAL_DST)
	if err != nil {
		return netip.AddrPort{}, err
	}
	b := m.Multiaddr
	return netip.AddrPortFrom(netip.AddrFrom4([4]byte(b[4:8])), binary.BigEndian.Uint16(b[2:4])), nil
}

func origDst6(fd int) (netip.AddrPort, error) {
	// sockaddr_in6 (28 bytes) fits the 32-byte ip6_mtuinfo buffer.
	m, err := unix.GetsockoptIPv6MTUInfo(fd, unix.SOL_IPV6, ip6tSoOriginalDst)
	if err != nil {
		return netip.AddrPort{}, err
	}
	port := (*[2]byte)(unsafe.Pointer(&m.Addr.Port))
	addr := netip.AddrFrom16(m.Addr.Addr).Unmap()
	return netip.AddrPortFrom(addr, binary.BigEndian.Uint16(port[:])), nil
}
