package dns_test

import (
	"net"
	"slices"
	"sync"
	"testing"
	"time"

	mdns "github.com/miekg/dns"

	"github.com/isthmus-mesh/isthmus/ztunnel/dns"
)

// BenchmarkDNS measures answers per second and p99 latency through the
// proxy for a mesh name and for a forwarded name, and as a baseline the
// loopback upstream answering the same forwarded name directly, all in the
// same run. The three cases take turns in 10 rounds, so a change of load on
// the shared machine hits all three alike; in each round 8 clients each send
// b.N/80 UDP queries back to back on their own socket. Reported: <case>_qps, <case>_p99_us, and the ratios
// fwd/direct and mesh/direct for both.
//
//	go test -run '^$' -bench BenchmarkDNS -benchtime 20000x ./ztunnel/dns/
func BenchmarkDNS(b *testing.B) {
	m, up := newMesh(), startUpstream(b)
	p := startProxy(b, dns.Config{Upstreams: []string{up.addr}}, meshDeps(m))
	const clients, rounds = 8, 10
	type result struct {
		lat     []time.Duration
		elapsed time.Duration
	}
	run := func(server, name string, res *result) {
		per := max(b.N/clients/rounds, 1)
		lat := make([][]time.Duration, clients)
		var wg sync.WaitGroup
		start := time.Now()
		for i := range clients {
			wg.Go(func() {
				local := &net.UDPAddr{IP: m.client.AsSlice()}
				c := &mdns.Client{Net: "udp", Dialer: &net.Dialer{LocalAddr: local}, Timeout: 5 * time.Second}
				co, err := c.Dial(server)
				if err != nil {
					b.Error(err)
					return
				}
				defer co.Close()
				q := new(mdns.Msg)
				q.SetQuestion(name, mdns.TypeA)
				l := make([]time.Duration, 0, per)
				for range per {
					q.Id = mdns.Id()
					t0 := time.Now()
					r, _, err := c.ExchangeWithConn(q, co)
					if err != nil || len(r.Answer) != 1 {
						b.Errorf("%s via %s: %v %v", name, server, err, r)
						return
					}
					l = append(l, time.Since(t0))
				}
				lat[i] = l
			})
		}
		wg.Wait()
		res.elapsed += time.Since(start)
		res.lat = append(res.lat, slices.Concat(lat...)...)
	}
	stats := func(r *result) (qps, p99 float64) {
		slices.Sort(r.lat)
		if len(r.lat) == 0 {
			return 0, 0
		}
		return float64(len(r.lat)) / r.elapsed.Seconds(), float64(r.lat[len(r.lat)*99/100].Microseconds())
	}
	var direct, fwd, mesh result
	b.ResetTimer()
	for range rounds {
		run(up.addr, "ext.example.", &direct)
		run(p.addr, "ext.example.", &fwd)
		run(p.addr, "echo.demo.svc.cluster.local.", &mesh)
	}
	b.StopTimer()
	dq, dp := stats(&direct)
	fq, fp := stats(&fwd)
	mq, mp := stats(&mesh)
	b.ReportMetric(dq, "direct_qps")
	b.ReportMetric(dp, "direct_p99_us")
	b.ReportMetric(fq, "fwd_qps")
	b.ReportMetric(fp, "fwd_p99_us")
	b.ReportMetric(mq, "mesh_qps")
	b.ReportMetric(mp, "mesh_p99_us")
	b.ReportMetric(fq/dq, "fwd/direct_qps")
	b.ReportMetric(fp/dp, "fwd/direct_p99")
	b.ReportMetric(mq/dq, "mesh/direct_qps")
	b.ReportMetric(mp/dp, "mesh/direct_p99")
}
