package realnode

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"

	"github.com/isthmus-mesh/isthmus/internal/nettopo"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
)

// topology is a set's networks, built as the demo builds its isolated
// ones (test/demo/isolated.go), from internal/nettopo:
//
//	wan ──net<i>── router of network i ──node<k>── node k of network i (eth0)
//	 (pass filter)      │ lo: 10.i.255.n/32, host forwards (API servers, ...)
//	                    └──node<k+1>── ...
//
// Network i is 10.i.0.0/16: its router's end of the link to its node k is
// 10.i.k.1/24, the node's eth0 10.i.k.2/24 (its InternalIP), the node's
// pods 10.i.(100+k).0/24 (its PodCIDR, on the node's CNI bridge), routed
// by the router to the node: the pods of one network reach each other
// directly, whatever node or cluster they are on. The router's link to the
// wan is 10.255.i.2/24 (the wan's end 10.255.i.1/24); the wan routes each
// network's /16 to its router, and its pass filter lets only passed
// addresses and ports through (Set.ExposeGateway, the API servers' host
// forwards) and replies to them.
//
// Everything is in namespaces of the set's own, held by open files (and
// the forwarders' listeners): closing them is the whole teardown.
type topology struct {
	wan      *os.File
	networks []*network

	mu   sync.Mutex
	fwds []*forwarder
}

// network is one network of the set.
type network struct {
	name   string
	index  int // i: the network is 10.i.0.0/16
	router *os.File
	nodes  int // nodes attached so far
	hosts  int // host forwards so far
}

// wanTable is the wan's pass filter (a nettopo pass filter).
const wanTable = "isthmus-realnode-wan"

// maxNetworks and maxNodesPerNetwork bound the address plan (10.i.k.2 and
// 10.i.(100+k).0/24 with i below the wan's 10.255 and k below 100).
const (
	maxNetworks        = 200
	maxNodesPerNetwork = 99
)

func pfx(format string, a ...any) netip.Prefix {
	return netip.MustParsePrefix(fmt.Sprintf(format, a...))
}

// newTopology builds the wan, with its pass filter, and a router per
// network, named in names.
func newTopology(names []string) (t *topology, err error) {
	if len(names) > maxNetworks {
		return nil, fmt.Errorf("%d networks: at most %d", len(names), maxNetworks)
	}
	t = &topology{}
	defer func() {
		if err != nil {
			t.close()
		}
	}()
	if t.wan, err = nettopo.New(""); err != nil {
		return t, err
	}
	if err := nettopo.Sysctl(t.wan, "net/ipv4/ip_forward", "1"); err != nil {
		return t, err
	}
	if err := nettopo.NewPassFilter(t.wan, wanTable); err != nil {
		return t, err
	}
	for i, name := range names {
		n := &network{name: name, index: i + 1}
		if n.router, err = nettopo.New(""); err != nil {
			return t, err
		}
		t.networks = append(t.networks, n)
		wanSide, routerSide := pfx("10.255.%d.1/24", n.index), pfx("10.255.%d.2/24", n.index)
		for _, step := range []func() error{
			func() error {
				return nettopo.Veth(t.wan, fmt.Sprintf("net%d", n.index), wanSide, n.router, "wan", routerSide)
			},
			func() error { return nettopo.Route(t.wan, n.prefix(), routerSide.Addr()) },
			func() error { return nettopo.Route(n.router, pfx("0.0.0.0/0"), wanSide.Addr()) },
			func() error { return nettopo.Sysctl(n.router, "net/ipv4/ip_forward", "1") },
		} {
			if err := step(); err != nil {
				return t, fmt.Errorf("network %s: %w", name, err)
			}
		}
	}
	return t, nil
}

// prefix is the network's /16.
func (n *network) prefix() netip.Prefix { return pfx("10.%d.0.0/16", n.index) }

// network returns the network called name, or nil.
func (t *topology) network(name string) *network {
	for _, n := range t.networks {
		if n.name == name {
			return n
		}
	}
	return nil
}

// nodeNet is a node's place in its network.
type nodeNet struct {
	addr    netip.Prefix // the node's eth0 address (its InternalIP)
	gateway netip.Addr   // the router's end: the node's default route
	podCIDR netip.Prefix
	// uplink links the node's namespace to the router (eth0 there) and
	// routes the node's PodCIDR to it.
	uplink func(node *os.File) error
}

// attachNode allocates the next node's addresses in network n; the link is
// made when the node calls uplink. Not safe for concurrent use.
func (t *topology) attachNode(n *network) (nodeNet, error) {
	if n.nodes == maxNodesPerNetwork {
		return nodeNet{}, fmt.Errorf("network %s: at most %d nodes", n.name, maxNodesPerNetwork)
	}
	n.nodes++
	k := n.nodes
	routerSide := pfx("10.%d.%d.1/24", n.index, k)
	nn := nodeNet{
		addr: pfx("10.%d.%d.2/24", n.index, k), gateway: routerSide.Addr(),
		podCIDR: pfx("10.%d.%d.0/24", n.index, 100+k),
	}
	nn.uplink = func(node *os.File) error {
		if err := nettopo.Veth(n.router, fmt.Sprintf("node%d", k), routerSide, node, "eth0", nn.addr); err != nil {
			return err
		}
		return nettopo.Route(n.router, nn.podCIDR, nn.addr.Addr())
	}
	return nn, nil
}

// exposeHost gives network n an address, on its router, whose port relays
// to target (host:port on the host's loopback: an API server, pilot), and
// lets TCP to it through the wan.
func (t *topology) exposeHost(n *network, port uint16, target string) (netip.AddrPort, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if n.hosts == 254 {
		return netip.AddrPort{}, fmt.Errorf("network %s: no host forward address left", n.name)
	}
	if _, _, err := net.SplitHostPort(target); err != nil {
		return netip.AddrPort{}, fmt.Errorf("host forward target %q: %w", target, err)
	}
	n.hosts++
	ap := netip.AddrPortFrom(pfx("10.%d.255.%d/32", n.index, n.hosts).Addr(), port)
	if err := nettopo.AddAddrTo(n.router, "lo", netip.PrefixFrom(ap.Addr(), 32)); err != nil {
		return netip.AddrPort{}, err
	}
	var ln net.Listener
	if err := netns.Do(n.router, func() (err error) {
		ln, err = net.Listen("tcp", ap.String())
		return err
	}); err != nil {
		return netip.AddrPort{}, fmt.Errorf("listen on %s in network %s's router: %w", ap, n.name, err)
	}
	t.fwds = append(t.fwds, newForwarder(ln, dialTCP(target)))
	if err := nettopo.PassAddrPort(t.wan, wanTable, ap); err != nil {
		return netip.AddrPort{}, err
	}
	return ap, nil
}

// pass lets TCP to ap through the wan.
func (t *topology) pass(ap netip.AddrPort) error {
	return nettopo.PassAddrPort(t.wan, wanTable, ap)
}

// rejected is how many packets the wan's filter refused.
func (t *topology) rejected() (uint64, error) {
	return nettopo.Rejected(t.wan, wanTable)
}

// close closes the forwarders and the namespaces (the links go with them).
func (t *topology) close() {
	t.mu.Lock()
	fwds := t.fwds
	t.fwds = nil
	t.mu.Unlock()
	for _, f := range fwds {
		f.close()
	}
	for _, n := range t.networks {
		if n.router != nil {
			n.router.Close()
		}
	}
	if t.wan != nil {
		t.wan.Close()
	}
}

// errNoNetwork is returned for an address outside every network.
var errNoNetwork = errors.New("not an address of the set's networks")
