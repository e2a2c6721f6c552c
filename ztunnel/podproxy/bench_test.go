//go:build linux

package podproxy

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/cni/redirect"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
	"github.com/isthmus-mesh/isthmus/ztunnel/proxy"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

const bulkPort = 8081

// benchPath opens a connection from pod A to B's bulk app, one way or the
// other.
type benchPath func() (net.Conn, error)

// socksConnect speaks SOCKS5 on c (no authentication) to reach dst.
func socksConnect(c net.Conn, dst netip.AddrPort) error {
	req := []byte{5, 1, 0, 5, 1, 0, 1}
	a := dst.Addr().As4()
	req = append(req, a[:]...)
	req = binary.BigEndian.AppendUint16(req, dst.Port())
	if _, err := c.Write(req); err != nil {
		return err
	}
	var reply [12]byte // method selection (2) + reply (10)
	if _, err := io.ReadFull(c, reply[:]); err != nil {
		return err
	}
	if reply[3] != 0 {
		return errors.New("socks5: refused")
	}
	return nil
}

// BenchmarkCapturedVsSOCKS5 carries the same traffic from pod A to pod B's
// application two ways, in the same run, on the same in-pod inbound at B:
// captured (A's application just connects; its rules redirect the
// connection to ztunnel's 15001 inside A), and through SOCKS5 (A's
// application speaks SOCKS5 to ztunnel). It reports each path's upload
// throughput, connection latency (connect + one round trip) p50/p99 and
// connections per second, and the ratios captured / SOCKS5.
func BenchmarkCapturedVsSOCKS5(b *testing.B) {
	e := newEnv(b)
	e.store.Update(func(tx *state.Tx) {
		w, _ := e.store.Load().Workload("c1/app/b")
		nw := *w
		nw.Services = map[string]state.PortMap{svcKey: {svcPort: appPort, bulkPort: bulkPort}}
		tx.UpsertWorkload(&nw)
		tx.UpsertService(&state.Service{Name: "b", Namespace: "app", VIPs: []netip.Addr{vip}, Ports: []uint16{svcPort, bulkPort}})
	})
	e.start(b)
	// B's bulk app: it reads to EOF, answers the byte count, or echoes a
	// first short message.
	ln, err := netns.Listen(context.Background(), e.b, "tcp", netip.AddrPortFrom(b4, bulkPort).String(), nil)
	require.NoError(b, err)
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() {
				defer c.Close()
				buf := make([]byte, 64<<10)
				var n int64
				for {
					m, err := c.Read(buf)
					n += int64(m)
					if m == 1 && n == 1 { // a ping: answer it
						if _, err := c.Write(buf[:1]); err != nil {
							return
						}
						continue
					}
					if err != nil {
						break
					}
				}
				_, _ = c.Write(binary.BigEndian.AppendUint64(nil, uint64(n)))
			})
		}
	})
	defer func() { ln.Close(); wg.Wait() }()

	// SOCKS5: an outbound of A's, as a node ztunnel offers it, on A's own
	// address (not captured: it is A's loopback route).
	out, err := proxy.NewOutbound(proxy.Config{Node: "node-1"},
		proxy.Deps{Store: e.store, Certs: e.certs, Dialer: &netns.Dialer{NetNS: e.a, Mark: redirect.Mark}}, state.Selector{})
	require.NoError(b, err)
	sln, err := netns.Listen(context.Background(), e.a, "tcp", netip.AddrPortFrom(a4, 15080).String(), nil)
	require.NoError(b, err)
	go func() { _ = out.ServeSOCKS5(sln) }()
	defer out.Close()

	dst := netip.AddrPortFrom(b4, bulkPort)
	paths := []struct {
		name string
		open benchPath
	}{
		{"captured", func() (net.Conn, error) { return dialFrom(e.a, dst) }},
		{"socks5", func() (net.Conn, error) {
			c, err := dialFrom(e.a, netip.AddrPortFrom(a4, 15080))
			if err != nil {
				return nil, err
			}
			if err := socksConnect(c, dst); err != nil {
				c.Close()
				return nil, err
			}
			return c, nil
		}},
	}
	const volume = 256 << 20
	const conns = 400
	type result struct{ mbps, p50, p99, cps float64 }
	res := map[string]result{}
	b.ResetTimer()
	for range b.N {
		for round := range 2 { // alternate, so both see the same machine state
			for i := range paths {
				p := paths[(i+round)%len(paths)]
				mbps := upload(b, p.open, volume)
				p50, p99, cps := connect(b, p.open, conns)
				r := res[p.name]
				res[p.name] = result{r.mbps + mbps/2, r.p50 + p50/2, r.p99 + p99/2, r.cps + cps/2}
			}
		}
	}
	b.StopTimer()
	c, s := res["captured"], res["socks5"]
	b.ReportMetric(c.mbps, "captured-MB/s")
	b.ReportMetric(s.mbps, "socks5-MB/s")
	b.ReportMetric(c.mbps/s.mbps, "throughput-captured/socks5")
	b.ReportMetric(c.p50, "captured-p50-us")
	b.ReportMetric(c.p99, "captured-p99-us")
	b.ReportMetric(s.p50, "socks5-p50-us")
	b.ReportMetric(s.p99, "socks5-p99-us")
	b.ReportMetric(c.p50-s.p50, "p50-added-us")
	b.ReportMetric(c.p99-s.p99, "p99-added-us")
	b.ReportMetric(c.cps, "captured-conns/s")
	b.ReportMetric(s.cps, "socks5-conns/s")
	b.ReportMetric(c.cps/s.cps, "connrate-captured/socks5")
}

// upload sends volume bytes over one connection and returns MB/s.
func upload(b *testing.B, open benchPath, volume int) float64 {
	c, err := open()
	require.NoError(b, err)
	defer c.Close()
	buf := make([]byte, 64<<10)
	start := time.Now()
	for sent := 0; sent < volume; sent += len(buf) {
		_, err := c.Write(buf)
		require.NoError(b, err)
	}
	require.NoError(b, c.(interface{ CloseWrite() error }).CloseWrite())
	var n [8]byte
	_ = c.SetReadDeadline(time.Now().Add(time.Minute))
	_, err = io.ReadFull(c, n[:])
	require.NoError(b, err)
	require.Equal(b, uint64(volume), binary.BigEndian.Uint64(n[:]))
	return float64(volume) / 1e6 / time.Since(start).Seconds()
}

// connect opens n connections one after the other, each with one round
// trip, and returns the p50 and p99 latency in µs and connections/s.
func connect(b *testing.B, open benchPath, n int) (p50, p99, cps float64) {
	lat := make([]time.Duration, 0, n)
	start := time.Now()
	for range n {
		t0 := time.Now()
		c, err := open()
		require.NoError(b, err)
		_, err = c.Write([]byte{1})
		require.NoError(b, err)
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, err = io.ReadFull(c, make([]byte, 1))
		require.NoError(b, err)
		lat = append(lat, time.Since(t0))
		c.Close()
	}
	total := time.Since(start)
	slices.Sort(lat)
	us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
	return us(lat[len(lat)/2]), us(lat[len(lat)*99/100]), float64(n) / total.Seconds()
}
