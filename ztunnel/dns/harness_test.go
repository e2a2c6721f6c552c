package dns_test

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	mdns "github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/ztunnel/dns"
	"github.com/isthmus-mesh/isthmus/ztunnel/internal/testnet"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// The mesh every test resolves against, as a node on network n1 sees it.
var (
	echoVIP     = netip.MustParseAddr("10.96.0.10")
	echoVIP6    = netip.MustParseAddr("fd00:96::10")
	remoteVIP   = netip.MustParseAddr("240.240.0.5")
	remoteVIP6  = netip.MustParseAddr("2001:2::5")
	headlessVIP = netip.MustParseAddr("240.240.0.6")
	sharedVIP   = netip.MustParseAddr("10.96.0.11")
	clusterSet  = netip.MustParseAddr("240.240.0.7")
	extAddr     = netip.MustParseAddr("192.0.2.80")
)

// testNode is the node of the DNS proxy and of the mesh's client pods.
const testNode = "node-1"

// mesh is a state store with:
//   - echo.demo: VIPs in n1, exported;
//   - remote.demo: no VIP in n1 (it runs on n2 only), allocated addresses;
//   - db.demo: headless, pods db-0 and db-1 on n1 (db-2 not ready), plus
//     endpoints on n2 behind a gateway; allocated address;
//   - far.demo: headless, endpoints on n2 only; exported;
//   - shared.demo: a VIP in n1 and, exported, its clusterset IP (allocated,
//     among its VIPs as xDS sends it);
//   - a client pod in namespace demo and one in namespace other (all pods
//     on testNode).
type mesh struct {
	store         *state.Store
	catalog       *dns.StoreCatalog
	client, other netip.Addr
	db0, db1, db2 netip.Addr
	attrs         map[string]dns.Attributes
}

func newMesh() *mesh {
	m := &mesh{
		store: state.NewStore(), client: testnet.NextAddr(), other: testnet.NextAddr(),
		db0: testnet.NextAddr(), db1: testnet.NextAddr(), db2: testnet.NextAddr(),
	}
	host := func(n string) string { return n + ".demo.svc.cluster.local" }
	m.attrs = map[string]dns.Attributes{
		host("echo"):   {Exported: true},
		host("remote"): {Allocated: []netip.Addr{remoteVIP, remoteVIP6}},
		host("db"):     {Headless: true, Allocated: []netip.Addr{headlessVIP}},
		host("far"):    {Headless: true, Exported: true, Allocated: []netip.Addr{headlessVIP}},
		host("ext"):    {Exported: true}, // added by TestNXDomainAtOnce
		host("shared"): {Exported: true, Allocated: []netip.Addr{clusterSet}},
	}
	gw := &state.NetworkGateway{Network: "n2", Address: testnet.NextAddr(), HBONEPort: 15008}
	pod := func(name, ns string, a netip.Addr, st state.Status, svcs ...string) *state.Workload {
		w := &state.Workload{UID: "c1/" + ns + "/" + name, Name: name, Namespace: ns, Addresses: []netip.Addr{a},
			Network: "n1", Cluster: "c1", Node: testNode, Status: st, Protocol: state.TunnelHBONE, Services: map[string]state.PortMap{}}
		for _, s := range svcs {
			w.Services[state.ServiceKey("demo", host(s))] = nil
		}
		return w
	}
	m.store.Update(func(tx *state.Tx) {
		tx.UpsertService(&state.Service{Name: "echo", Namespace: "demo", VIPs: []netip.Addr{echoVIP, echoVIP6}, Ports: []uint16{80}})
		tx.UpsertService(&state.Service{Name: "remote", Namespace: "demo", Ports: []uint16{80}})
		tx.UpsertService(&state.Service{Name: "db", Namespace: "demo", Ports: []uint16{5432}})
		tx.UpsertService(&state.Service{Name: "far", Namespace: "demo", Ports: []uint16{5432}})
		tx.UpsertService(&state.Service{Name: "shared", Namespace: "demo", VIPs: []netip.Addr{sharedVIP, clusterSet}, Ports: []uint16{80}})
		tx.UpsertWorkload(pod("client", "demo", m.client, state.StatusReady))
		tx.UpsertWorkload(pod("other", "other", m.other, state.StatusReady))
		tx.UpsertWorkload(pod("db-0", "demo", m.db0, state.StatusReady, "db"))
		tx.UpsertWorkload(pod("db-1", "demo", m.db1, state.StatusReady, "db"))
		tx.UpsertWorkload(pod("db-2", "demo", m.db2, state.StatusNotReady, "db"))
		for _, s := range []string{"db", "far", "remote"} {
			tx.UpsertWorkload(&state.Workload{UID: "c2/demo/" + s + "-n2", Name: s, Namespace: "demo", Network: "n2",
				Cluster: "c2", Gateways: []*state.NetworkGateway{gw}, Status: state.StatusReady, Capacity: 2,
				Services: map[string]state.PortMap{state.ServiceKey("demo", host(s)): nil}})
		}
	})
	m.catalog = &dns.StoreCatalog{Store: m.store, Network: "n1", Node: testNode,
		Attributes: func(s *state.Service) dns.Attributes { return m.attrs[s.Hostname] }}
	return m
}

// upstream is a fake resolver on its own loopback address, serving UDP and
// TCP on one port:
//   - ext.example. A: extAddr, TTL 1234;
//   - big.example. A: 60 addresses; over UDP it answers truncated (TC, no
//     records), as a resolver whose answer exceeds the buffer does;
//   - slow.example.: never answered;
//   - everything else: NXDOMAIN.
type upstream struct {
	addr     string
	udp, tcp atomic.Int64 // queries received per transport
}

func startUpstream(t testing.TB) *upstream { return startUpstreamOn(t, "0") }

// startUpstreamOn starts the upstream on a fresh loopback address and the
// given port ("0": any).
func startUpstreamOn(t testing.TB, port string) *upstream {
	t.Helper()
	u := &upstream{}
	ip := testnet.NextAddr()
	pc, err := net.ListenPacket("udp", net.JoinHostPort(ip.String(), port))
	require.NoError(t, err)
	ln, err := net.Listen("tcp", net.JoinHostPort(ip.String(), strconv.Itoa(pc.LocalAddr().(*net.UDPAddr).Port)))
	require.NoError(t, err)
	u.addr = pc.LocalAddr().String()
	h := mdns.HandlerFunc(func(w mdns.ResponseWriter, r *mdns.Msg) {
		_, tcp := w.RemoteAddr().(*net.TCPAddr)
		if tcp {
			u.tcp.Add(1)
		} else {
			u.udp.Add(1)
		}
		m := new(mdns.Msg)
		m.SetReply(r)
		q := r.Question[0]
		switch q.Name {
		case "ext.example.":
			m.Answer = append(m.Answer, &mdns.A{Hdr: mdns.RR_Header{Name: q.Name, Rrtype: mdns.TypeA, Class: mdns.ClassINET, Ttl: 1234}, A: extAddr.AsSlice()})
		case "big.example.":
			if !tcp {
				m.Truncated = true
				break
			}
			for i := range 60 {
				m.Answer = append(m.Answer, &mdns.A{Hdr: mdns.RR_Header{Name: q.Name, Rrtype: mdns.TypeA, Class: mdns.ClassINET, Ttl: 60},
					A: net.IPv4(198, 51, 100, byte(i+1))})
			}
		case "slow.example.":
			return
		default:
			m.Rcode = mdns.RcodeNameError
		}
		_ = w.WriteMsg(m)
	})
	servers := []*mdns.Server{{PacketConn: pc, Handler: h}, {Listener: ln, Handler: h}}
	var wg sync.WaitGroup
	for _, s := range servers {
		started := make(chan struct{})
		s.NotifyStartedFunc = func() { close(started) }
		wg.Go(func() { _ = s.ActivateAndServe() })
		<-started
	}
	t.Cleanup(func() {
		for _, s := range servers {
			_ = s.Shutdown()
		}
		wg.Wait()
	})
	return u
}

// proxy is a running dns.Server on its own loopback address (UDP and TCP).
type proxy struct {
	srv  *dns.Server
	addr string
	reg  *prometheus.Registry
	done chan error
}

func startProxy(t testing.TB, cfg dns.Config, deps dns.Deps) *proxy {
	t.Helper()
	ip := testnet.NextAddr()
	pc, err := net.ListenPacket("udp", net.JoinHostPort(ip.String(), "0"))
	require.NoError(t, err)
	port := pc.LocalAddr().(*net.UDPAddr).Port
	ln, err := net.Listen("tcp", net.JoinHostPort(ip.String(), strconv.Itoa(port)))
	require.NoError(t, err)
	p := &proxy{addr: pc.LocalAddr().String(), reg: prometheus.NewRegistry(), done: make(chan error, 1)}
	if deps.Metrics == nil {
		deps.Metrics, err = dns.NewMetrics(p.reg)
		require.NoError(t, err)
	}
	deps.PacketConns, deps.Listeners = []net.PacketConn{pc}, []net.Listener{ln}
	p.srv, err = dns.New(cfg, deps)
	require.NoError(t, err)
	go func() { p.done <- p.srv.Run(context.Background()) }()
	t.Cleanup(func() {
		require.NoError(t, p.srv.Close())
		require.NoError(t, <-p.done)
	})
	return p
}

// exchange sends one query from the source address src (so the proxy can
// tell the client) over net ("udp" or "tcp"); edns > 0 adds an OPT record
// with that buffer size.
func exchange(t testing.TB, net_, server string, src netip.Addr, name string, qtype uint16, edns uint16) *mdns.Msg {
	t.Helper()
	r, err := tryExchange(net_, server, src, name, qtype, edns)
	require.NoError(t, err, "%s %s", name, mdns.TypeToString[qtype])
	return r
}

func tryExchange(net_, server string, src netip.Addr, name string, qtype uint16, edns uint16) (*mdns.Msg, error) {
	return tryExchangeTimeout(net_, server, src, name, qtype, edns, 10*time.Second)
}

func tryExchangeTimeout(net_, server string, src netip.Addr, name string, qtype uint16, edns uint16, timeout time.Duration) (*mdns.Msg, error) {
	var local net.Addr = &net.UDPAddr{IP: src.AsSlice()}
	if net_ == "tcp" {
		local = &net.TCPAddr{IP: src.AsSlice()}
	}
	c := &mdns.Client{Net: net_, Timeout: timeout, Dialer: &net.Dialer{LocalAddr: local, Timeout: timeout}}
	m := new(mdns.Msg)
	m.SetQuestion(name, qtype)
	if edns > 0 {
		m.SetEdns0(edns, false)
	}
	r, _, err := c.Exchange(m, server)
	if err == nil && r.Id != m.Id {
		err = errors.New("id mismatch")
	}
	return r, err
}

// addrs returns the A/AAAA addresses of an answer and checks every TTL is ttl.
func addrs(t testing.TB, r *mdns.Msg, ttl uint32) []netip.Addr {
	t.Helper()
	var out []netip.Addr
	for _, rr := range r.Answer {
		require.Equal(t, ttl, rr.Header().Ttl, rr.String())
		switch rr := rr.(type) {
		case *mdns.A:
			a, _ := netip.AddrFromSlice(rr.A.To4())
			out = append(out, a)
		case *mdns.AAAA:
			a, _ := netip.AddrFromSlice(rr.AAAA)
			out = append(out, a)
		}
	}
	return out
}
