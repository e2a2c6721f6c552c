//go:build linux

package demo

import (
	"fmt"
	"strings"
)

// Diagram draws the topology: the clusters, their networks, nodes, pods
// and gateways, numbered by the hops of a reply from sleep to echo, and
// (with delta) the hops with what each proxy counted for the reply.
//
//	+- cluster-1 / network-1 ---------------+       +- cluster-2 / network-2 ---------------+
//	| router 10.1.0.0/16                    |  wan  | router 10.2.0.0/16                    |
//	| node-1a 10.1.0.11                     |<=====>| node-2a 10.2.0.11                     |
//	|   [1] pod sleep-0 10.1.1.10           | only  |   [5] pod echo-0 10.2.1.10            |
//	...
func (d *Demo) Diagram(delta *Path) string {
	const width = 40
	left, right := d.column(d.plan.sites[0]), d.column(d.plan.sites[1])
	middle := []string{"", "  wan  ", "<=====>", " gate- ", " ways  ", " only  "}
	if d.cfg.Loopback {
		middle = []string{"", "       ", "<- - ->", " no    ", " wall  "}
	}
	var b strings.Builder
	switch {
	case d.cfg.Loopback:
		fmt.Fprintf(&b, "host loopback: every pod, ztunnel and gateway on its own 127.x address; pilot %s\n", pilotIP)
	case d.cfg.Expose != nil:
		fmt.Fprintf(&b, "the runner's own namespace (a user namespace: no root): pilot %s and the API servers, reached from the\n"+
			"namespaces below through forwarders, and from the host's loopback through listeners passed in\n", pilotIP)
	default:
		fmt.Fprintf(&b, "host loopback: pilot %s and the API servers, reached from the namespaces below through forwarders\n", pilotIP)
	}
	border := func(title string) string {
		return "+- " + title + " " + strings.Repeat("-", max(0, width-len(title)-2)) + "+"
	}
	fmt.Fprintf(&b, "%s       %s\n", border(left[0]), border(right[0]))
	for i := 1; i < max(len(left), len(right)); i++ {
		mid := "       "
		if i < len(middle) {
			mid = middle[i]
		}
		fmt.Fprintf(&b, "| %-*s|%s| %-*s|\n", width, at(left, i), mid, width, at(right, i))
	}
	bottom := "+" + strings.Repeat("-", width+1) + "+"
	fmt.Fprintf(&b, "%s       %s\n", bottom, bottom)
	if delta != nil {
		fmt.Fprintf(&b, "hops (the reply returns the same way): [1] %s\n", d.numbered(d.Hops(*delta)))
	}
	return b.String()
}

func at(lines []string, i int) string {
	if i < len(lines) {
		return lines[i]
	}
	return ""
}

// column lists one site: its title first, then router, node, pods, the
// node's ztunnel and the gateway, each hop of the reply numbered.
func (d *Demo) column(s *site) []string {
	mark := func(hop int) string {
		if hop == 0 {
			return "    "
		}
		return fmt.Sprintf("[%d] ", hop)
	}
	client, server := s == d.plan.sleep.site, s == d.plan.echo.site
	hop := func(clientHop, serverHop int) string {
		switch {
		case client:
			return mark(clientHop)
		case server:
			return mark(serverHop)
		}
		return mark(0)
	}
	lines := []string{s.cluster + " / " + s.network}
	own := "(own netns)"
	if d.cfg.Loopback {
		lines = append(lines, "loopback addresses only")
		own = s.nodeIP.String()
	} else {
		lines = append(lines, "router "+s.netPrefix().String())
	}
	lines = append(lines, fmt.Sprintf("node %s %s", s.node, s.nodeIP))
	gw := fmt.Sprintf("east-west gateway %s", s.gatewayIP)
	if server {
		gw = "[3] " + gw
	}
	for _, p := range []podSpec{d.plan.sleep, d.plan.echo} {
		if p.site == s {
			lines = append(lines, fmt.Sprintf("  %spod %s %s", hop(1, 5), p.name, p.ip))
		}
	}
	lines = append(lines, fmt.Sprintf("  %sztunnel %s", hop(2, 4), own))
	if !d.cfg.Loopback {
		lines = append(lines, "      cni agent (in the node's netns)")
	}
	return append(lines, gw)
}

// numbered puts the hop numbers of the diagram into Hops' text.
func (d *Demo) numbered(hops string) string {
	c, s := d.plan.sleep.site, d.plan.echo.site
	for _, r := range []struct{ from, to string }{
		{"ztunnel " + c.node, "[2] ztunnel " + c.node},
		{"east-west gateway " + s.network, "[3] gateway " + s.network},
		{"ztunnel " + s.node, "[4] ztunnel " + s.node},
		{"-> " + d.plan.echo.name, "-> [5] " + d.plan.echo.name},
	} {
		hops = strings.Replace(hops, r.from, r.to, 1)
	}
	return hops
}
