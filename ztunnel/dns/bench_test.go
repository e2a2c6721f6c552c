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
// same run. 8 clients each send b.N/8 UDP queries back to back on their own
// socket. Reported: <case>_qps, <case>_p99_us, and the ratios
// fwd/direct and mesh/direct for both.
//
//	go test -run '^$' -bench BenchmarkDNS -benchtime 20000x ./ztunnel/dns/
func BenchmarkDNS(b *testing.B) {
	m, up := newMesh(), startUpstream(b)
	p := startProxy(b, dns.Config{Upstreams: []string{up.addr}}, meshDeps(m))
	const clients = 8
	run := func(server, name string) (qps, p99 float64) {
		per := max(b.N/clients, 1)
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
		elapsed := time.Since(start)
		all := slices.Concat(lat...)
		slices.Sort(all)
		if len(all) == 0 {
			return 0, 0
		}
		return float64(len(all)) / elapsed.Seconds(), float64(all[len(all)*99/100].Microseconds())
	}
	b.ResetTimer()
	dq, dp := run(up.addr, "ext.example.")
	fq, fp := run(p.addr, "ext.example.")
	mq, mp := run(p.addr, "echo.demo.svc.cluster.local.")
	b.StopTimer()
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
