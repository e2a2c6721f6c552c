package proxy

import (
	"context"
	"net"
	"sync"

	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// ReasonNoLongerVisible counts open tunnels the gateway closed because the
// service they reach became invisible to other clusters (cluster-local, or
// no longer exported by the endpoint's cluster).
const ReasonNoLongerVisible = "service_no_longer_visible"

// A tunnel through the gateway carries a source ztunnel's pooled inner
// HTTP/2 connection: every stream the source opens on it reaches the
// endpoint the gateway chose, and the gateway never sees them. The gateway
// therefore checks its open tunnels again whenever the state changes (Run)
// and closes those whose service other clusters may no longer reach, with
// every inner stream on them; the sources dial again, and are refused. A
// service that disappears from the state closes nothing: its endpoints are
// going away anyway, and a state rebuilt from scratch must not cut every
// tunnel.

// openTunnel is what admitted one open tunnel.
type openTunnel struct {
	host string
	// cluster is the cluster of the endpoint the gateway chose.
	cluster string
	conn    net.Conn
}

type gatewayTunnels struct {
	mu   sync.Mutex
	open map[*openTunnel]struct{}
}

// visibleTo reports whether snap lets other clusters reach host's
// endpoints in cluster.
func visibleTo(snap *state.Snapshot, host, cluster string) bool {
	svc, ok := snap.ServiceByHostname(host)
	return !ok || svc.ReachableFromOtherClusters(cluster)
}

// track registers the tunnel to conn until ctx (the CONNECT stream's) ends,
// and reports whether the current state still admits it: a state that
// changed since the admission may have been checked before the tunnel was
// registered.
func (g *Gateway) track(ctx context.Context, host, cluster string, conn net.Conn) bool {
	t := &openTunnel{host: host, cluster: cluster, conn: conn}
	g.tunnels.mu.Lock()
	g.tunnels.open[t] = struct{}{}
	g.tunnels.mu.Unlock()
	forget := func() {
		g.tunnels.mu.Lock()
		delete(g.tunnels.open, t)
		g.tunnels.mu.Unlock()
	}
	if !visibleTo(g.deps.Store.Load(), host, cluster) {
		forget()
		return false
	}
	context.AfterFunc(ctx, forget)
	return true
}

// Run closes the open tunnels a state change makes invisible, until ctx
// ends.
func (g *Gateway) Run(ctx context.Context) error {
	g.deps.Store.Follow(ctx, g.recheck)
	return nil
}

// recheck closes the open tunnels snap makes invisible.
func (g *Gateway) recheck(snap *state.Snapshot) {
	var cut []*openTunnel
	g.tunnels.mu.Lock()
	for t := range g.tunnels.open {
		if !visibleTo(snap, t.host, t.cluster) {
			delete(g.tunnels.open, t)
			cut = append(cut, t)
		}
	}
	g.tunnels.mu.Unlock()
	for _, t := range cut {
		g.deps.Metrics.Refused(metrics.ReporterGateway, ReasonNoLongerVisible)
		g.deps.Log.Info("gateway closed a tunnel to a service other clusters may no longer reach", "service", t.host, "cluster", t.cluster)
		t.conn.Close()
	}
}

// Open returns the number of open tunnels.
func (g *Gateway) Open() int {
	g.tunnels.mu.Lock()
	defer g.tunnels.mu.Unlock()
	return len(g.tunnels.open)
}
