// Package testnet gives ztunnel's tests loopback addresses (every pod, node
// proxy and gateway of a test gets its own 127.x.y.z address) and small TCP
// apps to put behind them.
//
// The second octet is drawn from 64..243 so that parallel test processes
// rarely meet, and never meet the fixed addresses of the demo topology
// (127.0.50.1, 127.10.x.y, 127.20.x.y).
package testnet

import (
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
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

// Serve accepts TCP connections on addr and runs handle for each in its own
// goroutine; when the test ends it closes the listener and every open
// connection and waits for the handlers. It returns the bound address.
func Serve(tb testing.TB, addr string, handle func(*net.TCPConn)) netip.AddrPort {
	tb.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		tb.Fatalf("listen %s: %v", addr, err)
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		conns = map[net.Conn]struct{}{}
	)
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns[c] = struct{}{}
			mu.Unlock()
			wg.Go(func() {
				defer c.Close()
				handle(c.(*net.TCPConn))
			})
		}
	})
	tb.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		for c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return netip.MustParseAddrPort(ln.Addr().String())
}

// Echo is a Serve handler that echoes until EOF, then half-closes.
func Echo(c *net.TCPConn) {
	_, _ = io.Copy(c, c)
	_ = c.CloseWrite()
}
