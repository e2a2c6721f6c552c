//go:build linux

package demo

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"sync"

	"github.com/isthmus-mesh/isthmus/internal/nettopo"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
)

// isolated is the dataplane of real networks: every network is a set of
// network namespaces, and only the gateways' addresses cross between them.
//
//	wan ──net1── router-network-1 ──node-1a── node-1a (bridge cni0: the pods)
//	  │                           └─gateway── gateway-network-1
//	  └──net2── router-network-2 ...
//
// plus a namespace per node's ztunnel (loopback only: it works inside the
// pods' namespaces). The wan's forward filter passes only packets to or
// from a gateway address.
type isolated struct {
	d *Demo

	mu        sync.Mutex
	ns        map[string]*os.File // every namespace by name (see names above)
	ids       []netns.ID          // of every namespace made, for leftover checks
	sandboxes map[string]*sandbox // live pods by name
	clients   map[string]*http.Client
}

func newIsolated(d *Demo) *isolated {
	return &isolated{d: d, ns: map[string]*os.File{}, sandboxes: map[string]*sandbox{}, clients: map[string]*http.Client{}}
}

// newNS makes a namespace called name (bind-mounted at path if not empty).
func (n *isolated) newNS(name, path string) (*os.File, error) {
	f, err := nettopo.New(path)
	if err != nil {
		return nil, err
	}
	id, err := netns.IDOf(f)
	if err != nil {
		f.Close()
		return nil, err
	}
	n.mu.Lock()
	n.ns[name], n.ids = f, append(n.ids, id)
	n.mu.Unlock()
	return f, nil
}

// get returns the namespace called name, or nil.
func (n *isolated) get(name string) *os.File {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.ns[name]
}

func routerName(s *site) string { return "router-" + s.network }

// maxSocketPath is the longest path a unix socket can be bound to
// (sun_path holds 108 bytes with the terminating NUL).
const maxSocketPath = 107

// setUp builds the wan, then each network: its router, node (with the pod
// bridge), gateway and the node ztunnel's namespace, their links and
// routes, and the wan's filter.
func (n *isolated) setUp(context.Context) error {
	for _, s := range n.d.plan.sites {
		if sock := n.nodeDir(s, "ztunnel.sock"); len(sock) > maxSocketPath {
			return fmt.Errorf("the agent's socket %s is longer than a unix socket path may be (%d bytes): use a shorter TMPDIR", sock, maxSocketPath)
		}
	}
	wan, err := n.newNS("wan", "")
	if err != nil {
		return fmt.Errorf("%w; `isthmus-demo --loopback` runs without namespaces", err)
	}
	if err := nettopo.Sysctl(wan, "net/ipv4/ip_forward", "1"); err != nil {
		return err
	}
	for _, s := range n.d.plan.sites {
		if err := n.network(wan, s); err != nil {
			return fmt.Errorf("network %s: %w", s.network, err)
		}
	}
	gws := []netip.Addr{n.d.plan.sites[0].gatewayIP, n.d.plan.sites[1].gatewayIP}
	return applyWANFilter(wan, gws)
}

// network builds one site's namespaces and links.
func (n *isolated) network(wan *os.File, s *site) error {
	var nss [4]*os.File
	for i, name := range []string{routerName(s), s.node, proxyName(s.node), proxyName(s.network)} {
		f, err := n.newNS(name, "")
		if err != nil {
			return err
		}
		nss[i] = f
	}
	router, node, gw := nss[0], nss[1], nss[3]
	any4 := pfx("0.0.0.0/0")
	for _, step := range []func() error{
		func() error {
			return nettopo.Veth(wan, fmt.Sprintf("net%d", s.index), s.wanSide(), router, "wan", s.routerWAN())
		},
		func() error {
			return nettopo.Veth(router, s.node, s.routerNode(), node, "uplink", netip.PrefixFrom(s.nodeIP, 24))
		},
		func() error {
			return nettopo.Veth(router, "gateway", s.routerGateway(), gw, "eth0", netip.PrefixFrom(s.gatewayIP, 24))
		},
		func() error { return nettopo.Bridge(node, "cni0", s.bridge()) },
		func() error { return nettopo.Route(wan, s.netPrefix(), s.routerWAN().Addr()) },
		func() error { return nettopo.Route(router, any4, s.wanSide().Addr()) },
		func() error { return nettopo.Route(router, s.bridge().Masked(), s.nodeIP) },
		func() error { return nettopo.Route(node, any4, s.routerNode().Addr()) },
		func() error { return nettopo.Route(gw, any4, s.routerGateway().Addr()) },
		func() error { return nettopo.Sysctl(router, "net/ipv4/ip_forward", "1") },
		func() error { return nettopo.Sysctl(node, "net/ipv4/ip_forward", "1") },
	} {
		if err := step(); err != nil {
			return err
		}
	}
	return nil
}

// nodeDir is the node's folder in the run folder: CNI directories, the
// agent's sockets, the pods' bind-mounted namespaces.
func (n *isolated) nodeDir(s *site, parts ...string) string {
	return filepath.Join(append([]string{n.d.run, s.node}, parts...)...)
}

// forwardIn listens on addr inside the namespace called where and forwards
// to target on the host.
func (n *isolated) forwardIn(ctx context.Context, where, addr, target string) error {
	ln, err := netns.Listen(ctx, n.get(where), "tcp", addr, nil)
	if err != nil {
		return fmt.Errorf("forwarder in %s: %w", where, err)
	}
	n.d.fwd.start(ln, target)
	return nil
}

// startNode starts the node's CNI agent, then its ztunnel in a namespace
// of its own, in-pod: it serves the pods the agent hands it inside their
// namespaces.
func (n *isolated) startNode(ctx context.Context, s *site) error {
	d := n.d
	if err := n.startAgent(ctx, s); err != nil {
		return err
	}
	name := proxyName(s.node)
	token, roots, err := d.proxyCredentials(ctx, d.Cluster(s.cluster), name, s.node, "ztunnel", s.nodeIP)
	if err != nil {
		return fmt.Errorf("%s credentials: %w", name, err)
	}
	if err := n.forwardIn(ctx, name, "127.0.0.1:15012", pilotIP+":15012"); err != nil {
		return err
	}
	args := append(proxyArgs(s, "node", s.node, "ztunnel", "127.0.0.1:15012", token, roots),
		"--admin-addr", "127.0.0.1:15000", "--readiness-addr", "127.0.0.1:15021", "--metrics-addr", "127.0.0.1:15020",
		"--socks5-addr", "none", "--outbound-addr", "none", "--inpod-socket", n.nodeDir(s, "ztunnel.sock"),
		"--node-ip", s.nodeIP.String())
	return d.procs.spawn(d, name, n.get(name), "ztunnel", args...)
}

// startGateway starts the network's gateway in its namespace, on the
// gateway address.
func (n *isolated) startGateway(ctx context.Context, s *site) error {
	d := n.d
	name := proxyName(s.network)
	node := fmt.Sprintf("gw-node-%d", s.index)
	token, roots, err := d.proxyCredentials(ctx, d.Cluster(s.cluster), name, node, "eastwest-gateway", s.gatewayIP)
	if err != nil {
		return fmt.Errorf("%s credentials: %w", name, err)
	}
	if err := n.forwardIn(ctx, name, "127.0.0.1:15012", pilotIP+":15012"); err != nil {
		return err
	}
	args := append(proxyArgs(s, "gateway", node, "eastwest-gateway", "127.0.0.1:15012", token, roots),
		"--admin-addr", "127.0.0.1:15000", "--readiness-addr", "127.0.0.1:15021", "--metrics-addr", "127.0.0.1:15020",
		"--gateway-addr", netip.AddrPortFrom(s.gatewayIP, 15008).String())
	return d.procs.spawn(d, name, n.get(name), "ztunnel", args...)
}

// httpIn returns an HTTP client whose connections are made inside the
// namespace called where.
func (n *isolated) httpIn(where string) *http.Client {
	n.mu.Lock()
	defer n.mu.Unlock()
	if c := n.clients[where]; c != nil {
		return c
	}
	dialer := &netns.Dialer{NetNS: n.ns[where]}
	c := &http.Client{Transport: &http.Transport{DialContext: dialer.DialContext, DisableKeepAlives: true}}
	n.clients[where] = c
	return c
}

func (n *isolated) proxyHTTP(name string, port int) (*http.Client, string) {
	return n.httpIn(proxyName(name)), fmt.Sprintf("http://127.0.0.1:%d", port)
}

// dialEcho resolves echo.demo's name the way an application in sleep's
// namespace does (a DNS query to its nameserver, which the pod's rules
// send to ztunnel) and connects to the address with a plain socket made in
// sleep's namespace: no mark, so the pod's rules capture it.
func (n *isolated) dialEcho(ctx context.Context) (net.Conn, error) {
	sleep := n.get(n.d.plan.sleep.name)
	r := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
		return dialIn(ctx, sleep, network, nameserver)
	}}
	addrs, err := r.LookupNetIP(ctx, "ip4", EchoHost+".")
	if err != nil {
		return nil, fmt.Errorf("resolve %s in %s: %w", EchoHost, n.d.plan.sleep.name, err)
	}
	dst := netip.AddrPortFrom(addrs[0], 80)
	conn, err := (&netns.Dialer{NetNS: sleep}).DialContext(ctx, "tcp", dst.String())
	if err != nil {
		return nil, fmt.Errorf("connect to %s (%s) from %s: %w", EchoHost, dst, n.d.plan.sleep.name, err)
	}
	return conn, nil
}

// dialIn connects to address (an IP literal and port) from inside ns over
// "udp" or "tcp", with a plain socket.
func dialIn(ctx context.Context, ns *os.File, network, address string) (net.Conn, error) {
	if network == "tcp" || network == "tcp4" || network == "tcp6" {
		return (&netns.Dialer{NetNS: ns}).DialContext(ctx, network, address)
	}
	var conn net.Conn
	err := netns.Do(ns, func() (err error) {
		// A UDP "connect" only sets the peer: it never blocks the thread.
		conn, err = (&net.Dialer{}).DialContext(ctx, network, address)
		return err
	})
	return conn, err
}

// close removes every namespace and mount the demo made (processes are
// already stopped and forwarders closed).
func (n *isolated) close() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	var errs []error
	for _, c := range n.clients {
		c.CloseIdleConnections()
	}
	for name, sb := range n.sandboxes {
		errs = append(errs, sb.remove())
		delete(n.sandboxes, name)
	}
	for name, f := range n.ns {
		f.Close()
		delete(n.ns, name)
	}
	return errors.Join(errs...)
}
