//go:build linux

package demo

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"time"

	"golang.org/x/net/proxy"

	"github.com/isthmus-mesh/isthmus/test/framework"
)

// loopback is the unprivileged dataplane: every pod, node proxy and gateway
// listens on its own loopback address of the host; networks are separated
// by policy only, and sleep talks SOCKS5 to its node's ztunnel.
type loopback struct{ d *Demo }

func (l *loopback) setUp(context.Context) error { return nil }

func (l *loopback) close() error { return nil }

func (l *loopback) startNode(ctx context.Context, s *site) error {
	d := l.d
	name := proxyName(s.node)
	token, roots, err := d.proxyCredentials(ctx, d.Cluster(s.cluster), name, s.node, "ztunnel", s.nodeIP)
	if err != nil {
		return fmt.Errorf("%s credentials: %w", name, err)
	}
	ip := s.nodeIP.String()
	args := append(proxyArgs(s, "node", s.node, "ztunnel", pilotIP+":15012", token, roots),
		"--admin-addr", ip+":15000", "--readiness-addr", ip+":15021", "--metrics-addr", ip+":15020",
		"--socks5-addr", ip+":15080", "--outbound-addr", ip+":15001", "--node-ip", ip)
	return d.procs.spawn(d, name, nil, "ztunnel", args...)
}

func (l *loopback) startGateway(ctx context.Context, s *site) error {
	d := l.d
	name := proxyName(s.network)
	node := fmt.Sprintf("gw-node-%d", s.index)
	token, roots, err := d.proxyCredentials(ctx, d.Cluster(s.cluster), name, node, "eastwest-gateway", s.gatewayIP)
	if err != nil {
		return fmt.Errorf("%s credentials: %w", name, err)
	}
	ip := s.gatewayIP.String()
	args := append(proxyArgs(s, "gateway", node, "eastwest-gateway", pilotIP+":15012", token, roots),
		"--admin-addr", ip+":15000", "--readiness-addr", ip+":15021", "--metrics-addr", ip+":15020",
		"--gateway-addr", ip+":15008")
	return d.procs.spawn(d, name, nil, "ztunnel", args...)
}

// addPod writes the pod running with its loopback address and starts its
// application there.
func (l *loopback) addPod(ctx context.Context, c *framework.Cluster, p podSpec) error {
	opts := podOptions(p)
	opts.IP, opts.Ready = p.ip, true
	if _, err := c.CreatePod(ctx, opts); err != nil {
		return err
	}
	if p.app != "echo" {
		return nil
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(p.ip.String(), "8080"))
	if err != nil {
		return fmt.Errorf("%s's application: %w", p.name, err)
	}
	l.d.apps.serveEcho(p.name, ln, p.who())
	return nil
}

// dialEcho asks the ztunnel of sleep's node, over SOCKS5 from sleep's
// address, for a connection to echo.demo:80.
func (l *loopback) dialEcho(ctx context.Context) (net.Conn, error) {
	sleep := l.d.plan.sleep
	src := &net.Dialer{LocalAddr: &net.TCPAddr{IP: sleep.ip.AsSlice()}, Timeout: 5 * time.Second}
	socks, err := proxy.SOCKS5("tcp", net.JoinHostPort(sleep.site.nodeIP.String(), "15080"), nil, src)
	if err != nil {
		return nil, err
	}
	conn, err := socks.(proxy.ContextDialer).DialContext(ctx, "tcp", EchoHost+":80")
	if err != nil {
		return nil, fmt.Errorf("dial %s through the ztunnel of %s: %w", EchoHost, sleep.site.node, err)
	}
	return conn, nil
}

func (l *loopback) proxyHTTP(name string, port int) (*http.Client, string) {
	for _, s := range l.d.plan.sites {
		switch name {
		case s.node:
			return http.DefaultClient, fmt.Sprintf("http://%s:%d", s.nodeIP, port)
		case s.network:
			return http.DefaultClient, fmt.Sprintf("http://%s:%d", s.gatewayIP, port)
		}
	}
	return http.DefaultClient, "http://invalid"
}
