//go:build linux

package demo

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
)

// Path counts what each hop's proxy reported: connections opened by the
// client's and the server's ztunnel and by network-2's gateway, and bytes
// the gateway received (inner tunnels through it are pooled, so a new
// connection need not open a new gateway stream).
type Path struct {
	ClientZtunnel, Gateway, GatewayBytes, ServerZtunnel float64
}

// Sub returns the counts of p since before.
func (p Path) Sub(before Path) Path {
	return Path{ClientZtunnel: p.ClientZtunnel - before.ClientZtunnel, Gateway: p.Gateway - before.Gateway,
		GatewayBytes: p.GatewayBytes - before.GatewayBytes, ServerZtunnel: p.ServerZtunnel - before.ServerZtunnel}
}

// Path reads the counters of the client's ztunnel (sleep's node), network-2's
// gateway and echo's ztunnel, from their metrics ports (isolated: inside
// their namespaces).
func (d *Demo) Path(ctx context.Context) (Path, error) {
	var p Path
	var err error
	client, server := d.plan.sleep.site, d.plan.echo.site
	if p.ClientZtunnel, err = d.metricSum(ctx, client.node, "isthmus_tcp_connections_opened_total"); err != nil {
		return p, err
	}
	if p.Gateway, err = d.metricSum(ctx, server.network, "isthmus_tcp_connections_opened_total"); err != nil {
		return p, err
	}
	if p.GatewayBytes, err = d.metricSum(ctx, server.network, "isthmus_tcp_received_bytes_total"); err != nil {
		return p, err
	}
	p.ServerZtunnel, err = d.metricSum(ctx, server.node, "isthmus_tcp_connections_opened_total")
	return p, err
}

// metricSum sums a metric's series on a proxy (a node's ztunnel by node
// name, a gateway by network).
func (d *Demo) metricSum(ctx context.Context, proxy, name string) (float64, error) {
	client, base := d.dp.proxyHTTP(proxy, 15020)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/metrics", nil)
	if err != nil {
		return 0, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, fmt.Errorf("metrics of %s: %w", proxyName(proxy), err)
	}
	defer resp.Body.Close()
	var sum float64
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, name+"{") || strings.HasPrefix(line, name+" ") {
			f := strings.Fields(line)
			v, err := strconv.ParseFloat(f[len(f)-1], 64)
			if err == nil {
				sum += v
			}
		}
	}
	return sum, sc.Err()
}

// Hops describes the path of one reply, from sleep to echo-0 and back, with
// the counts of delta (what the proxies reported for it).
func (d *Demo) Hops(delta Path) string {
	c, s := d.plan.sleep.site, d.plan.echo.site
	wan := ""
	if !d.cfg.Loopback {
		wan = " -> wan (gateways only)"
	}
	return fmt.Sprintf("%s -> ztunnel %s (+%.0f conn)%s -> east-west gateway %s (+%.0f conn, +%.0f bytes) -> ztunnel %s (+%.0f conn) -> %s",
		d.plan.sleep.name, c.node, delta.ClientZtunnel, wan, s.network, delta.Gateway, delta.GatewayBytes, s.node, delta.ServerZtunnel, d.plan.echo.name)
}
