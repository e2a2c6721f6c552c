package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"sync"
	"testing"
	"unicode/utf8"

	"github.com/isthmus-mesh/isthmus/ztunnel/hbone"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/internal/testca"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// pipeDialer stands in for the network in the CONNECT fuzz targets: no real
// connection is ever made. It answers with an in-memory pipe for a loopback
// address that allowed accepts (the loopback workloads a handler may reach),
// refuses everything else, and records every address it was asked for, so
// the test can fail on any dial a CONNECT should not have caused.
type pipeDialer struct {
	allowed func(netip.AddrPort) bool
	mu      sync.Mutex
	asked   []string
	conns   []net.Conn
}

func (d *pipeDialer) DialContext(_ context.Context, _, addr string) (net.Conn, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.asked = append(d.asked, addr)
	ap, err := netip.ParseAddrPort(addr)
	if err != nil || !ap.Addr().Unmap().IsLoopback() || !d.allowed(netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())) {
		return nil, fmt.Errorf("pipeDialer: %q is not a loopback workload of the store", addr)
	}
	a, b := net.Pipe()
	d.conns = append(d.conns, a, b)
	return a, nil
}

// reset closes the pipes handed out and returns the addresses asked for.
func (d *pipeDialer) reset() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, c := range d.conns {
		c.Close()
	}
	asked := d.asked
	d.asked, d.conns = nil, nil
	return asked
}

// Addresses of the fuzzed stores: loopback only, and never listened on.
var (
	fzB1    = netip.MustParseAddr("127.1.0.1") // node-b, HBONE, backs echo
	fzB2    = netip.MustParseAddr("::1")       // node-b, HBONE, backs echo on 8443
	fzB3    = netip.MustParseAddr("127.1.0.3") // node-b, no tunnel
	fzA1    = netip.MustParseAddr("127.1.0.2") // node-a
	fzNode  = netip.MustParseAddr("127.1.0.9") // node-b's IP, a hostNetwork pod's
	fzC1    = netip.MustParseAddr("127.2.0.1") // n2/c2, backs echo, secret, scoped, private
	fzC3    = netip.MustParseAddr("127.2.0.3") // n2/c3, backs echo, scoped
	fzC4    = netip.MustParseAddr("127.2.0.4") // n2/c2, no tunnel
	fzC5    = netip.MustParseAddr("127.2.0.5") // n2/c2, not ready
	fzR1    = netip.MustParseAddr("127.3.0.1") // n1, another network
	fzPeer  = identity.Identity{TrustDomain: trustDomain, Namespace: "client-ns", ServiceAccount: "client"}
	fzLocal = []netip.Addr{fzB1, fzB2, fzB3, fzA1, fzNode, fzC1}
)

func fzWorkload(uid string, a netip.Addr, node, network, cluster string, svcs map[string]state.PortMap) *state.Workload {
	w := pod(uid, a, node, network, cluster, uid+"-sa")
	w.Services = svcs
	return w
}

func fzService(name string, mod func(*state.Service)) *state.Service {
	s := &state.Service{Name: name, Namespace: "default", Ports: []uint16{svcPort, 8443}}
	if mod != nil {
		mod(s)
	}
	return s
}

func fzKey(name string) string { return state.ServiceKey("default", state.Hostname(name, "default")) }

// fuzzStore holds both networks' workloads, as a node may hear of them.
func fuzzStore() *state.Store {
	st := state.NewStore()
	echo := map[string]state.PortMap{fzKey("echo"): {svcPort: appPort, 8443: 0}}
	st.Update(func(tx *state.Tx) {
		tx.UpsertService(fzService("echo", func(s *state.Service) { s.VIPs = []netip.Addr{netip.MustParseAddr("10.0.0.10")} }))
		tx.UpsertService(fzService("secret", func(s *state.Service) { s.ClusterLocal = true }))
		tx.UpsertService(fzService("scoped", func(s *state.Service) { s.LocalClusters = []string{"c2"} }))
		tx.UpsertService(fzService("private", func(s *state.Service) { s.LocalClusters = []string{"c2"} }))
		tx.UpsertWorkload(fzWorkload("b1", fzB1, "node-b", "n1", "c1", echo))
		tx.UpsertWorkload(fzWorkload("b2", fzB2, "node-b", "n1", "c1", map[string]state.PortMap{fzKey("echo"): {8443: 0}}))
		b3 := fzWorkload("b3", fzB3, "node-b", "n1", "c1", echo)
		b3.Protocol = state.TunnelNone
		tx.UpsertWorkload(b3)
		tx.UpsertWorkload(fzWorkload("a1", fzA1, "node-a", "n1", "c1", echo))
		h := fzWorkload("h1", fzNode, "node-b", "n1", "c1", echo)
		h.HostNetwork = true
		tx.UpsertWorkload(h)
		all := map[string]state.PortMap{fzKey("echo"): {svcPort: appPort}, fzKey("secret"): {svcPort: appPort}, fzKey("scoped"): {svcPort: appPort}, fzKey("private"): {svcPort: appPort}}
		tx.UpsertWorkload(fzWorkload("c1", fzC1, "node-c", "n2", "c2", all))
		tx.UpsertWorkload(fzWorkload("c3", fzC3, "node-c3", "n2", "c3", map[string]state.PortMap{fzKey("echo"): {svcPort: appPort}, fzKey("scoped"): {svcPort: 0}}))
		c4 := fzWorkload("c4", fzC4, "node-c", "n2", "c2", all)
		c4.Protocol = state.TunnelNone
		tx.UpsertWorkload(c4)
		c5 := fzWorkload("c5", fzC5, "node-c", "n2", "c2", all)
		c5.Status = state.StatusNotReady
		tx.UpsertWorkload(c5)
		tx.UpsertWorkload(fzWorkload("r1", fzR1, "node-r", "n1", "c1", all))
	})
	return st
}

func fuzzDeps(t testing.TB, st *state.Store, d *pipeDialer) Deps {
	ca, err := testca.New(trustDomain)
	if err != nil {
		t.Fatal(err)
	}
	return Deps{Store: st, Certs: identity.NewCache(ca), Metrics: newMetrics(t), Dialer: d}
}

// checkLabels requires every label value to be valid UTF-8, the source's
// cluster and network to be ones the store knows (or unknown), and the
// destination's to be the chosen workload's.
func checkLabels(t *testing.T, snap *state.Snapshot, l metrics.ConnLabels, w *state.Workload) {
	for _, v := range []string{l.Reporter, l.SourcePrincipal, l.DestinationPrincipal, l.SourceCluster, l.DestinationCluster, l.SourceNetwork, l.DestinationNetwork} {
		if !utf8.ValidString(v) {
			t.Fatalf("label value %q is not UTF-8 (%+v)", v, l)
		}
	}
	if l.SourceCluster != metrics.Unknown && !snap.KnownCluster(l.SourceCluster) {
		t.Fatalf("source cluster %q is not the store's", l.SourceCluster)
	}
	if l.SourceNetwork != metrics.Unknown && !snap.KnownNetwork(l.SourceNetwork) {
		t.Fatalf("source network %q is not the store's", l.SourceNetwork)
	}
	if l.SourcePrincipal != fzPeer.String() || l.DestinationPrincipal != w.Identity().String() ||
		l.DestinationCluster != w.Cluster || l.DestinationNetwork != w.Network {
		t.Fatalf("labels %+v do not describe peer %s and workload %s", l, fzPeer, w.UID)
	}
}

// checkRefusal requires err to be a *hbone.Refusal with one of reasons.
func checkRefusal(t *testing.T, err error, reasons ...string) {
	var ref *hbone.Refusal
	if !errors.As(err, &ref) || !slices.Contains(reasons, ref.Reason) || ref.Status < 400 || ref.Status > 599 {
		t.Fatalf("error %v is not a refusal with one of %q", err, reasons)
	}
}

// FuzzInboundConnect fuzzes the CONNECT authority and Baggage header an
// inbound proxy receives, over a store with local and remote, HBONE and
// plain, and hostNetwork workloads. A CONNECT may only reach the local
// workload the connection arrived at, on a port one of its services
// targets; anything else is a refusal with its reason, never a dial; and
// metric labels carry only the store's clusters and networks.
func FuzzInboundConnect(f *testing.F) {
	st := fuzzStore()
	d := &pipeDialer{allowed: func(ap netip.AddrPort) bool {
		w, ok := st.Load().WorkloadByAddr(ap.Addr())
		return ok && w.Node == "node-b" && w.ServesPort(ap.Port())
	}}
	in, err := NewInbound(Config{Node: "node-b"}, fuzzDeps(f, st, d))
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { in.Close() })
	f.Fuzz(func(t *testing.T, authority, baggage string, local uint8) {
		defer d.reset()
		req := &hbone.Request{
			Local:     netip.AddrPortFrom(fzLocal[int(local)%len(fzLocal)], 15008),
			Remote:    netip.MustParseAddrPort("127.1.0.2:40000"),
			Peer:      fzPeer,
			Authority: authority,
			Header:    http.Header{HeaderBaggage: {baggage}},
		}
		snap := st.Load()
		up, err := in.Connect(t.Context(), req)
		asked := d.reset()
		if err != nil {
			checkRefusal(t, err, hbone.ReasonBadAuthority, ReasonDestinationNotLocal, ReasonDestinationMismatch, ReasonPortNotAllowed)
			if len(asked) > 0 {
				t.Fatalf("refused CONNECT %q dialled %q", authority, asked)
			}
			return
		}
		ap, perr := netip.ParseAddrPort(authority)
		w, ok := snap.WorkloadByAddr(ap.Addr().Unmap())
		if perr != nil || !ok || ap.Addr().Unmap() != req.Local.Addr() || w.Node != "node-b" || !w.ServesPort(ap.Port()) {
			t.Fatalf("CONNECT %q at %s was accepted", authority, req.Local)
		}
		if len(asked) != 1 || asked[0] != authority {
			t.Fatalf("CONNECT %q dialled %q", authority, asked)
		}
		checkLabels(t, snap, up.Labels, w)
		checkBaggageIdempotent(t, baggage)
	})
}

// checkBaggageIdempotent requires the parsed baggage to print as a header
// that parses back to itself.
func checkBaggageIdempotent(t *testing.T, h string) {
	b := parseBaggage(h)
	if again := parseBaggage(b.String()); again != b {
		t.Fatalf("baggage %q parsed as %+v, printed as %q, re-parsed as %+v", h, b, b.String(), again)
	}
}

// FuzzGatewayConnect fuzzes the outer CONNECT authority and Baggage header
// an east-west gateway of network n2 receives. A CONNECT may only reach,
// at its HBONE port, a ready HBONE endpoint on n2 of the named service that
// other clusters may reach; everything else is a refusal with its reason and
// no dial; the endpoint header names that endpoint's target port; labels
// carry only the store's clusters and networks.
func FuzzGatewayConnect(f *testing.F) {
	st := fuzzStore()
	d := &pipeDialer{allowed: func(ap netip.AddrPort) bool {
		w, ok := st.Load().WorkloadByAddr(ap.Addr())
		return ok && ap.Port() == 15008 && w.Network == "n2" && w.Protocol == state.TunnelHBONE && w.Status == state.StatusReady
	}}
	gwID := identity.Identity{TrustDomain: trustDomain, Namespace: "isthmus-system", ServiceAccount: "eastwest"}
	gw, err := NewGateway(GatewayConfig{Config: Config{Node: "node-g"}, Network: "n2", Cluster: "c2", Identity: gwID},
		fuzzDeps(f, st, d), state.Selector{Rand: func(n uint64) uint64 { return n / 2 }})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { gw.Close() })
	f.Fuzz(func(t *testing.T, authority, baggage string, _ uint8) {
		req := &hbone.Request{
			Local: netip.MustParseAddrPort("127.2.0.100:15008"), Remote: netip.MustParseAddrPort("127.3.0.1:40000"),
			Peer: fzPeer, Authority: authority, Header: http.Header{HeaderBaggage: {baggage}},
		}
		snap := st.Load()
		up, err := gw.Connect(t.Context(), req)
		asked := d.reset()
		if err != nil {
			checkRefusal(t, err, hbone.ReasonBadAuthority, ReasonUnknownService, ReasonUnknownPort, ReasonNotVisible, ReasonNoLocalEndpoint)
			if len(asked) > 0 {
				t.Fatalf("refused CONNECT %q dialled %q", authority, asked)
			}
			return
		}
		if len(asked) != 1 {
			t.Fatalf("CONNECT %q dialled %q", authority, asked)
		}
		w := checkGatewayTarget(t, snap, authority, asked[0], up.Header.Get(HeaderEndpoint))
		checkLabels(t, snap, up.Labels, w)
	})
}

// checkGatewayTarget checks an accepted gateway CONNECT and returns the
// endpoint it reached.
func checkGatewayTarget(t *testing.T, snap *state.Snapshot, authority, dialled, endpoint string) *state.Workload {
	host, portStr, err := net.SplitHostPort(authority)
	if err != nil {
		t.Fatalf("accepted authority %q: %v", authority, err)
	}
	svc, ok := snap.ServiceByHostname(host)
	p, err := strconv.ParseUint(portStr, 10, 16)
	port := uint16(p)
	if err != nil || !ok || svc.ClusterLocal || !svc.HasPort(port) {
		t.Fatalf("accepted CONNECT %q to no visible service port", authority)
	}
	ap := netip.MustParseAddrPort(dialled)
	w, ok := snap.WorkloadByAddr(ap.Addr())
	if !ok || ap.Port() != 15008 || w.Network != "n2" || w.Protocol != state.TunnelHBONE || w.Status != state.StatusReady ||
		!svc.ReachableFromOtherClusters(w.Cluster) {
		t.Fatalf("CONNECT %q reached %s", authority, dialled)
	}
	tp, ok := w.TargetPort(svc.Key(), port)
	if !ok || endpoint != netip.AddrPortFrom(w.Addresses[0], tp).String() {
		t.Fatalf("CONNECT %q: endpoint header %q for workload %s", authority, endpoint, w.UID)
	}
	return w
}
