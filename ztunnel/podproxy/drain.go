package podproxy

import (
	"context"
	"time"

	"github.com/isthmus-mesh/isthmus/internal/conntrack"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
)

// DrainResult says how the connections open when a drain began ended.
type DrainResult struct {
	// Open is the number of connections the pods' listeners had accepted
	// and were serving when the drain began (HBONE connections count once,
	// whatever their streams).
	Open int
	// Drained ended by themselves within the grace period; Forced were
	// still open at its end and closed.
	Drained, Forced int
}

// Drain hands the pods over to a ztunnel that serves them beside this one
// (its listeners bound with SO_REUSEPORT on the same ports): it stops
// accepting on every pod's listeners — the kernel then gives new
// connections to the other ztunnel's, and moves those it had queued for
// this one's there too (EnableListenerMigration) — and tells every HBONE
// connection with a GOAWAY to open no new stream here. The connections
// being served run on until they end by themselves or grace has passed
// (or ctx ends); the rest are then closed, and the Manager is closed as by
// Close. The pods' DNS listeners close at once (a query in flight on them
// is lost; resolvers retry). From the start of the drain on, AddPod takes
// a pod without serving it (the next ztunnel does).
// Outcomes are counted in isthmus_drain_connections_total.
func (m *Manager) Drain(ctx context.Context, grace time.Duration) DrainResult {
	m.mu.Lock()
	m.draining = true
	pods := make([]*pod, 0, len(m.pods))
	for _, p := range m.pods {
		pods = append(pods, p)
	}
	m.mu.Unlock()
	for _, p := range pods {
		p.stopAccepting()
	}
	res := DrainResult{Open: conns(pods)}
	m.log.Info("draining pods", "pods", len(pods), "connections", res.Open, "grace", grace)
	res.Forced = conntrack.WaitIdle(ctx, grace, func() int { return conns(pods) })
	res.Drained = max(0, res.Open-res.Forced)
	m.deps.Metrics.Drain(metrics.DrainDrained, res.Drained)
	m.deps.Metrics.Drain(metrics.DrainForced, res.Forced)
	_ = m.Close()
	m.log.Info("pods drained", "drained", res.Drained, "forced", res.Forced)
	return res
}

// conns counts the connections the pods' proxies serve.
func conns(pods []*pod) int {
	n := 0
	for _, p := range pods {
		n += p.out.Conns() + p.in.Conns() + p.plain.Conns()
	}
	return n
}

// stopAccepting closes p's listeners (and its DNS server) and asks its
// HBONE clients to go elsewhere; connections being served stay.
func (p *pod) stopAccepting() {
	p.drainOnce.Do(func() {
		for _, ln := range p.lns {
			ln.Close()
		}
		if p.dns != nil {
			p.dns.Close()
		}
		p.in.Drain()
	})
}
