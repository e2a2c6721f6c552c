package proxy

import (
	"io"
	"net"
	"net/netip"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// benchPath opens a connection from the client pod: "raw" is plain TCP to the
// echo app, "hbone" goes SOCKS5 -> HBONE -> echo on the same network, and
// "gateway" goes SOCKS5 -> double HBONE through the east-west gateway.
func benchPath(b *testing.B, m *mesh, path string) *net.TCPConn {
	switch path {
	case "raw":
		d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(m.a1, 0))}
		c, err := d.Dial("tcp", netip.AddrPortFrom(m.b1, appPort).String())
		if err != nil {
			b.Fatal(err)
		}
		return c.(*net.TCPConn)
	default:
		c, code := socksDial(b, m.socksAddr, m.a1, echoHost, svcPort)
		if code != 0 {
			b.Fatalf("socks reply %d", code)
		}
		return c
	}
}

func benchMesh(b *testing.B, path string) *mesh {
	m := newMesh(b, nil)
	if path == "gateway" {
		m.n1.Update(func(tx *state.Tx) { tx.RemoveWorkload("b1") })
	}
	return m
}

// pump sends total bytes in chunk-sized writes while a reader drains the
// echo, and returns the elapsed time.
func pump(b *testing.B, c *net.TCPConn, chunk []byte, total int64) time.Duration {
	start := time.Now()
	var wg sync.WaitGroup
	wg.Go(func() {
		if _, err := io.CopyN(io.Discard, c, total); err != nil {
			b.Error(err)
		}
	})
	for sent := int64(0); sent < total; sent += int64(len(chunk)) {
		if _, err := c.Write(chunk); err != nil {
			b.Fatal(err)
		}
	}
	wg.Wait()
	return time.Since(start)
}

// BenchmarkThroughput measures single-stream echo throughput (bytes are
// carried both ways) and, for tunnelled paths, reports the ratio to raw
// loopback TCP measured on the same volume.
func BenchmarkThroughput(b *testing.B) {
	for _, path := range []string{"raw", "hbone", "gateway"} {
		b.Run(path, func(b *testing.B) {
			m := benchMesh(b, path)
			c := benchPath(b, m, path)
			defer c.Close()
			chunk := make([]byte, 64<<10)
			b.SetBytes(int64(len(chunk)))
			b.ResetTimer()
			start := time.Now()
			var wg sync.WaitGroup
			total := int64(0)
			done := make(chan int64)
			wg.Go(func() {
				n, _ := io.Copy(io.Discard, c)
				done <- n
			})
			for b.Loop() {
				if _, err := c.Write(chunk); err != nil {
					b.Fatal(err)
				}
				total += int64(len(chunk))
			}
			_ = c.CloseWrite()
			got := <-done
			elapsed := time.Since(start)
			b.StopTimer()
			wg.Wait()
			if got != total {
				b.Fatalf("echoed %d of %d bytes", got, total)
			}
			rate := float64(total) / elapsed.Seconds()
			if path != "raw" {
				raw := benchPath(b, m, "raw")
				defer raw.Close()
				rawElapsed := pump(b, raw, chunk, total)
				b.ReportMetric(rate/(float64(total)/rawElapsed.Seconds()), "x_raw")
			}
		})
	}
}

func percentile(d []time.Duration, p float64) time.Duration {
	slices.Sort(d)
	return d[int(float64(len(d)-1)*p)]
}

// rtt measures one 1 KiB request/response on c.
func rtt(b *testing.B, c *net.TCPConn, req, resp []byte) time.Duration {
	start := time.Now()
	if _, err := c.Write(req); err != nil {
		b.Fatal(err)
	}
	if _, err := io.ReadFull(c, resp); err != nil {
		b.Fatal(err)
	}
	return time.Since(start)
}

// BenchmarkLatency measures 1 KiB request/response round trips on an
// established connection and reports p50/p99 and, for tunnelled paths, the
// p50 added over direct TCP (measured in the same run).
func BenchmarkLatency(b *testing.B) {
	for _, path := range []string{"raw", "hbone", "gateway"} {
		b.Run(path, func(b *testing.B) {
			m := benchMesh(b, path)
			c := benchPath(b, m, path)
			defer c.Close()
			req, resp := make([]byte, 1024), make([]byte, 1024)
			for range 100 { // warm up windows and pools
				rtt(b, c, req, resp)
			}
			var samples []time.Duration
			for b.Loop() {
				samples = append(samples, rtt(b, c, req, resp))
			}
			b.StopTimer()
			p50, p99 := percentile(samples, 0.5), percentile(samples, 0.99)
			b.ReportMetric(float64(p50.Microseconds()), "p50_us")
			b.ReportMetric(float64(p99.Microseconds()), "p99_us")
			if path != "raw" {
				raw := benchPath(b, m, "raw")
				defer raw.Close()
				direct := make([]time.Duration, 0, len(samples))
				for range max(len(samples), 1000) {
					direct = append(direct, rtt(b, raw, req, resp))
				}
				b.ReportMetric(float64((p50 - percentile(direct, 0.5)).Microseconds()), "added_p50_us")
			}
		})
	}
}

// BenchmarkNewConnections opens, uses (1 byte echo) and closes one
// application connection per iteration. HBONE streams ride pooled HTTP/2
// connections, as in production.
func BenchmarkNewConnections(b *testing.B) {
	for _, path := range []string{"raw", "hbone", "gateway"} {
		b.Run(path, func(b *testing.B) {
			m := benchMesh(b, path)
			one := make([]byte, 1)
			start := time.Now()
			for b.Loop() {
				c := benchPath(b, m, path)
				if _, err := c.Write(one); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(c, one); err != nil {
					b.Fatal(err)
				}
				c.Close()
			}
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "conns/s")
		})
	}
}

// BenchmarkIdleTunnelMemory opens idle tunnels and reports the heap and
// goroutine stacks they hold per tunnel, counting every in-process party
// (app client socket, outbound, gateway, inbound, echo app).
func BenchmarkIdleTunnelMemory(b *testing.B) {
	for _, path := range []string{"raw", "hbone", "gateway"} {
		b.Run(path, func(b *testing.B) {
			m := benchMesh(b, path)
			const n = 200
			for b.Loop() {
				var before, after runtime.MemStats
				// Two GCs empty the buffer pools (primary, then victim cache).
				runtime.GC()
				runtime.GC()
				runtime.ReadMemStats(&before)
				conns := make([]*net.TCPConn, 0, n)
				for range n {
					c := benchPath(b, m, path)
					one := []byte{1}
					if _, err := c.Write(one); err != nil {
						b.Fatal(err)
					}
					if _, err := io.ReadFull(c, one); err != nil {
						b.Fatal(err)
					}
					conns = append(conns, c)
				}
				runtime.GC()
				runtime.ReadMemStats(&after)
				used := func(s runtime.MemStats) int64 { return int64(s.HeapInuse + s.StackInuse) }
				b.ReportMetric(float64(used(after)-used(before))/n, "bytes/tunnel")
				b.ReportMetric(float64(runtime.NumGoroutine())/n, "goroutines/tunnel")
				for _, c := range conns {
					c.Close()
				}
			}
		})
	}
}
