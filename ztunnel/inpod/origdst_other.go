//go:build !linux

package inpod

import (
	"errors"
	"net"
	"net/netip"
)

// OriginalDst needs Linux conntrack; elsewhere it fails.
func OriginalDst(net.Conn) (netip.AddrPort, bool, error) {
	return netip.AddrPort{}, false, errors.New("inpod: original destinations need Linux")
}
