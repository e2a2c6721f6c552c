// Package testnet hands out loopback addresses for ztunnel's tests: every
// pod, node proxy and gateway of a test gets its own 127.x.y.z address.
//
// The second octet is drawn from 64..243 so that parallel test processes
// rarely meet, and never meet the fixed addresses of the demo topology
// (127.0.50.1, 127.10.x.y, 127.20.x.y).
package testnet

import (
	"math/rand/v2"
	"net/netip"
	"sync/atomic"
)

var (
	base = [2]byte{byte(64 + rand.IntN(180)), byte(rand.IntN(250))}
	n    atomic.Uint32
)

// NextAddr returns a loopback address not handed out before in this process.
// It is safe for concurrent use.
func NextAddr() netip.Addr {
	i := n.Add(1)
	return netip.AddrFrom4([4]byte{127, base[0], base[1] + byte(i/250), byte(1 + i%250)})
}
