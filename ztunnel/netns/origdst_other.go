//go:build !linux

package netns

import (
	"errors"
	"net"
	"net/netip"
)

// OriginalDst needs Linux conntrack; elsewhere it fails.
func OriginalDst(net.Conn) (netip.AddrPort, bool, error) {
	return netip.AddrPort{}, false, errors.New("netns: original destinations need Linux")
}
