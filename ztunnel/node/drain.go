package node

import (
	"context"
	"net"
	"sync"
	"time"

	"github.com/isthmus-mesh/isthmus/internal/conntrack"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
)

// reusePortListen is the default listen of the proxies: SO_REUSEPORT, so
// that a new ztunnel binds beside this one while it drains.
func reusePortListen(network, addr string) (net.Listener, error) {
	return netns.ReusePortConfig().Listen(context.Background(), network, addr)
}

// drain is the first part of a requested stop in node mode: it waits until
// a newer ztunnel serves every enrolled pod (the agent's HandedOff) or
// HandoffWait has passed, then stops accepting on the pods' listeners and
// on its own (outbound, SOCKS5, inbound) and lets the connections being
// served run for DrainGrace; what is left is closed by the stop that
// follows. The pods' connections and the node's drain at the same time,
// each counted in isthmus_drain_connections_total.
func (n *Node) drain(lns *listeners) {
	var handed <-chan struct{}
	if n.inpod != nil {
		handed = n.inpod.HandedOff()
	}
	wait := time.NewTimer(n.cfg.HandoffWait)
	defer wait.Stop()
	select {
	case <-handed:
		n.log.Info("a newer ztunnel serves every enrolled pod: draining", "grace", n.cfg.DrainGrace)
	case <-wait.C:
		n.log.Info("no newer ztunnel took the pods within the handoff wait: draining anyway",
			"wait", n.cfg.HandoffWait, "grace", n.cfg.DrainGrace)
	}
	ctx := context.Background()
	var wg sync.WaitGroup
	if n.pods != nil {
		wg.Go(func() { n.pods.Drain(ctx, n.cfg.DrainGrace) })
	}
	for _, ln := range []*net.Listener{&lns.outbound, &lns.socks} {
		if *ln != nil {
			n.self.Remove((*ln).Addr())
			(*ln).Close()
		}
	}
	if n.in != nil {
		n.in.Drain()
	}
	conns := func() int {
		c := n.out.Conns()
		if n.in != nil {
			c += n.in.Conns()
		}
		return c
	}
	open := conns()
	forced := conntrack.WaitIdle(ctx, n.cfg.DrainGrace, conns)
	n.m.Drain(metrics.DrainDrained, max(0, open-forced))
	n.m.Drain(metrics.DrainForced, forced)
	wg.Wait()
}

// drainGateway is a requested stop of a gateway (a rollout, a scale-down,
// a drained node). It is not ready from the start, so its pod leaves the
// ready endpoints of the gateway's Service and kube-proxy sends new outer
// connections to the other replicas. For HandoffWait it keeps accepting
// (a client may still reach it while the endpoints move) and, every
// second, tells each outer connection (an HTTP/2 GOAWAY) to open no new
// tunnel on it: clients open their next tunnels on a new connection,
// which lands on another replica, while the tunnels open run on. It then
// stops accepting and waits up to DrainGrace for the open tunnels to end;
// what is left is closed by the stop that follows.
func (n *Node) drainGateway(lns *listeners) {
	n.log.Info("gateway draining: not ready, sending clients away", "wait", n.cfg.HandoffWait, "grace", n.cfg.DrainGrace)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	until := time.Now().Add(n.cfg.HandoffWait)
	for {
		n.gw.Drain()
		if !time.Now().Before(until) {
			break
		}
		select {
		case <-tick.C:
		case <-time.After(time.Until(until)):
		}
	}
	for _, ln := range []net.Listener{lns.gateway, lns.gatewayTLS} {
		if ln != nil {
			n.self.Remove(ln.Addr())
			ln.Close()
		}
	}
	n.gw.Drain() // connections accepted since the last tick
	open := n.gw.Conns()
	forced := conntrack.WaitIdle(context.Background(), n.cfg.DrainGrace, n.gw.Conns)
	n.m.Drain(metrics.DrainDrained, max(0, open-forced))
	n.m.Drain(metrics.DrainForced, forced)
}
