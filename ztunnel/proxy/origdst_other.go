//go:build !linux

package proxy

import (
	"errors"
	"net"
	"net/netip"

	"github.com/isthmus-mesh/isthmus/ztunnel/hbone"
)

// OriginalDst returns the connection's local address: SO_ORIGINAL_DST exists
// only on Linux.
func OriginalDst(c net.Conn) (netip.AddrPort, error) {
	local, ok := hbone.AddrPortOf(c.LocalAddr())
	if !ok {
		return netip.AddrPort{}, errors.New("connection has no TCP local address")
	}
	return local, nil
}
