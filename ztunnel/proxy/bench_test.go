package proxy

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/netip"
	"runtime"
	"runtime/debug"
	"slices"
	"testing"
	"time"

	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// benchWatchdog bounds every sub-benchmark, setup and teardown included: a
// benchmark that hangs fails with every goroutine's stack instead of
// running until the test binary's timeout.
const benchWatchdog = 2 * time.Minute

// benchConnDeadline bounds every I/O of a benchmark connection.
const benchConnDeadline = time.Minute

var benchPaths = []string{"raw", "hbone", "gateway"}

// watchdog panics, printing all goroutines, if the benchmark b has not
// finished (including its cleanups) within d.
func watchdog(b *testing.B, d time.Duration) {
	name := b.Name()
	t := time.AfterFunc(d, func() {
		debug.SetTraceback("all")
		panic(fmt.Sprintf("benchmark %s still running after %s: goroutine dump follows", name, d))
	})
	b.Cleanup(func() { t.Stop() })
}

// benchPath opens a connection from the client pod: "raw" is plain TCP to the
// echo app, "hbone" goes SOCKS5 -> HBONE -> echo on the same network, and
// "gateway" goes SOCKS5 -> double HBONE through the east-west gateway. Every
// I/O on it fails after benchConnDeadline.
func benchPath(b *testing.B, m *mesh, path string) *net.TCPConn {
	var c *net.TCPConn
	switch path {
	case "raw":
		d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(m.a1, 0)), Timeout: 5 * time.Second}
		nc, err := d.Dial("tcp", netip.AddrPortFrom(m.b1, appPort).String())
		if err != nil {
			b.Fatal(err)
		}
		c = nc.(*net.TCPConn)
	default:
		var code byte
		c, code = socksDial(b, m.socksAddr, m.a1, echoHost, svcPort)
		if code != 0 {
			b.Fatalf("socks reply %d", code)
		}
	}
	_ = c.SetDeadline(time.Now().Add(benchConnDeadline))
	return c
}

// benchMesh starts a mesh for path under a watchdog.
func benchMesh(b *testing.B, path string) *mesh {
	watchdog(b, benchWatchdog)
	m := newMesh(b, nil)
	if path == "gateway" {
		m.n1.Update(func(tx *state.Tx) { tx.RemoveWorkload("b1") })
	}
	return m
}

// chunks returns an iterator over total/len(chunk) writes.
func chunks(total int64, chunk []byte) func() bool {
	left := total / int64(len(chunk))
	return func() bool { left--; return left >= 0 }
}

// echoPump writes chunk while next allows, while a reader drains the echo,
// then half-closes; it returns the bytes sent and the elapsed time once
// every byte came back.
func echoPump(b *testing.B, c *net.TCPConn, chunk []byte, next func() bool) (int64, time.Duration) {
	start := time.Now()
	done := make(chan int64, 1)
	go func() {
		n, err := io.Copy(io.Discard, c)
		if err != nil {
			b.Error(err)
		}
		done <- n
	}()
	var sent int64
	for next() {
		if _, err := c.Write(chunk); err != nil {
			b.Fatal(err)
		}
		sent += int64(len(chunk))
	}
	if err := c.CloseWrite(); err != nil {
		b.Fatal(err)
	}
	if got := <-done; got != sent {
		b.Fatalf("echoed %d of %d bytes", got, sent)
	}
	return sent, time.Since(start)
}

// uploadPump writes chunk to the sink app while next allows, then
// half-closes; it returns the bytes sent and the elapsed time once the app
// confirmed it received every byte.
func uploadPump(b *testing.B, c *net.TCPConn, chunk []byte, next func() bool) (int64, time.Duration) {
	start := time.Now()
	if _, err := c.Write([]byte(sinkMagic)); err != nil {
		b.Fatal(err)
	}
	var sent int64
	for next() {
		if _, err := c.Write(chunk); err != nil {
			b.Fatal(err)
		}
		sent += int64(len(chunk))
	}
	if err := c.CloseWrite(); err != nil {
		b.Fatal(err)
	}
	var got [8]byte
	if _, err := io.ReadFull(c, got[:]); err != nil {
		b.Fatal(err)
	}
	if n := int64(binary.BigEndian.Uint64(got[:])); n != sent {
		b.Fatalf("app received %d of %d bytes", n, sent)
	}
	return sent, time.Since(start)
}

// pumpFunc carries chunks on c while next allows and returns the bytes sent
// and the elapsed time until the far end has them all.
type pumpFunc func(b *testing.B, c *net.TCPConn, chunk []byte, next func() bool) (int64, time.Duration)

// roundBytes is the volume carried per benchmark iteration on each path.
const roundBytes = 8 << 20

// throughput runs one throughput benchmark. Every iteration carries
// roundBytes on a new stream of the path under test and, for tunnelled
// paths, then the same volume on a new raw TCP connection, so both see the
// same load on this shared machine; x_raw is the ratio of the two rates
// summed over all rounds (each round timed until the last byte arrived).
func throughput(b *testing.B, run pumpFunc) {
	for _, path := range benchPaths {
		b.Run(path, func(b *testing.B) {
			m := benchMesh(b, path)
			chunk := make([]byte, 64<<10)
			// round returns the wall and CPU time (all parties) to carry
			// roundBytes on a new connection of path.
			round := func(path string) (wall, cpu time.Duration) {
				c := benchPath(b, m, path)
				defer c.Close()
				c0 := cpuTime()
				_, d := run(b, c, chunk, chunks(roundBytes, chunk))
				return d, cpuTime() - c0
			}
			round(path) // warm up pools, windows and TCP
			b.SetBytes(roundBytes)
			var pathTime, rawTime, pathCPU, rawCPU time.Duration
			for b.Loop() {
				w, c := round(path)
				pathTime, pathCPU = pathTime+w, pathCPU+c
				if path != "raw" {
					b.StopTimer()
					w, c := round("raw")
					rawTime, rawCPU = rawTime+w, rawCPU+c
					b.StartTimer()
				}
			}
			mb := float64(b.N) * roundBytes / 1e6
			b.ReportMetric(mb/pathTime.Seconds(), "MB/s_path")
			// CPU per byte is steadier than wall time on a shared machine.
			b.ReportMetric(float64(pathCPU.Nanoseconds())/(mb*1e6), "cpu_ns/B")
			if path != "raw" {
				b.ReportMetric(mb/rawTime.Seconds(), "MB/s_raw")
				b.ReportMetric(rawTime.Seconds()/pathTime.Seconds(), "x_raw")
				b.ReportMetric(float64(pathCPU)/float64(rawCPU), "cpu_x_raw")
			}
		})
	}
}

// BenchmarkThroughput measures single-stream echo throughput (every byte is
// carried both ways through the echo app) and, for tunnelled paths, the
// ratio to raw loopback TCP echo of the same volume in the same run.
func BenchmarkThroughput(b *testing.B) {
	throughput(b, echoPump)
}

// BenchmarkUpload measures single-stream one-way throughput (client -> app,
// like iperf): the app only reads, and confirms the byte count at the end.
func BenchmarkUpload(b *testing.B) {
	throughput(b, uploadPump)
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
	for _, path := range benchPaths {
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
	for _, path := range benchPaths {
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

// stableGoroutines waits until the goroutine count stops falling and
// returns it.
func stableGoroutines() int {
	n := runtime.NumGoroutine()
	for range 100 {
		time.Sleep(50 * time.Millisecond)
		m := runtime.NumGoroutine()
		if m >= n {
			return m
		}
		n = m
	}
	return n
}

// settle waits until at most want goroutines run, so that tunnels closed
// before are torn down before memory is measured.
func settle(b *testing.B, want int) {
	deadline := time.Now().Add(10 * time.Second)
	for runtime.NumGoroutine() > want {
		if time.Now().After(deadline) {
			b.Fatalf("%d goroutines still running, want %d", runtime.NumGoroutine(), want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// heldBytes returns heap and stack in use after two GCs (the second empties
// the sync.Pool victim caches, so pooled buffers no one holds do not count).
func heldBytes() (heap, stack int64) {
	var s runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&s)
	return int64(s.HeapInuse), int64(s.StackInuse)
}

// BenchmarkIdleTunnelMemory opens idle tunnels (each carried one byte each
// way, then left open) and reports the heap and goroutine stacks they hold
// per tunnel, counting every in-process party (app client socket, outbound,
// gateway, inbound, echo app). The pooled HTTP/2 connections are opened
// before measuring, so the figure is the cost of one more idle tunnel.
func BenchmarkIdleTunnelMemory(b *testing.B) {
	for _, path := range benchPaths {
		b.Run(path, func(b *testing.B) {
			m := benchMesh(b, path)
			const n = 200
			one := []byte{1}
			open := func() *net.TCPConn {
				c := benchPath(b, m, path)
				if _, err := c.Write(one); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(c, one); err != nil {
					b.Fatal(err)
				}
				return c
			}
			// Open and close n tunnels first, so that the pooled HTTP/2
			// connections n tunnels need exist before measuring.
			warm := make([]*net.TCPConn, 0, n)
			for range n {
				warm = append(warm, open())
			}
			for _, c := range warm {
				c.Close()
			}
			base := stableGoroutines()
			var heap, stack, goroutines float64
			for b.Loop() {
				settle(b, base)
				h0, s0 := heldBytes()
				g0 := runtime.NumGoroutine()
				conns := make([]*net.TCPConn, 0, n)
				for range n {
					conns = append(conns, open())
				}
				h1, s1 := heldBytes()
				heap, stack = float64(h1-h0)/n, float64(s1-s0)/n
				goroutines = float64(runtime.NumGoroutine()-g0) / n
				for _, c := range conns {
					c.Close()
				}
			}
			b.ReportMetric(heap+stack, "bytes/tunnel")
			b.ReportMetric(heap, "heap_B/tunnel")
			b.ReportMetric(stack, "stack_B/tunnel")
			b.ReportMetric(goroutines, "goroutines/tunnel")
		})
	}
}
