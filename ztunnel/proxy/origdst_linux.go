//go:build linux

package proxy

import (
	"encoding/binary"
	"errors"
	"net"
	"net/netip"

	"golang.org/x/sys/unix"

	"github.com/isthmus-mesh/isthmus/ztunnel/hbone"
)

// OriginalDst returns the destination a connection had before an iptables
// REDIRECT (SO_ORIGINAL_DST, IPv4), falling back to the connection's local
// address when the connection was not redirected.
func OriginalDst(c net.Conn) (netip.AddrPort, error) {
	local, ok := hbone.AddrPortOf(c.LocalAddr())
	if !ok {
		return netip.AddrPort{}, errors.New("connection has no TCP local address")
	}
	tc, ok := c.(*net.TCPConn)
	if !ok || !local.Addr().Is4() {
		return local, nil
	}
	raw, err := tc.SyscallConn()
	if err != nil {
		return local, nil
	}
	var (
		mreq *unix.IPv6Mreq
		gerr error
	)
	if err := raw.Control(func(fd uintptr) {
		// sockaddr_in fits in the 16-byte ipv6_mreq buffer.
		mreq, gerr = unix.GetsockoptIPv6Mreq(int(fd), unix.SOL_IP, unix.SO_ORIGINAL_DST)
	}); err != nil || gerr != nil {
		return local, nil
	}
	b := mreq.Multiaddr
	port := binary.BigEndian.Uint16(b[2:4])
	addr := netip.AddrFrom4([4]byte{b[4], b[5], b[6], b[7]})
	if port == 0 || !addr.IsValid() || addr.IsUnspecified() {
		return local, nil
	}
	return netip.AddrPortFrom(addr, port), nil
}
