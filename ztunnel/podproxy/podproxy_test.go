//go:build linux

package podproxy

import (
	"bufio"
	"cmp"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	mdns "github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/isthmus-mesh/isthmus/cni/redirect"
	"github.com/isthmus-mesh/isthmus/internal/promread"
	"github.com/isthmus-mesh/isthmus/ztunnel/dns"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/inpod"
	"github.com/isthmus-mesh/isthmus/ztunnel/internal/testca"
	"github.com/isthmus-mesh/isthmus/ztunnel/internal/testnet"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns/netnstest"
	"github.com/isthmus-mesh/isthmus/ztunnel/proxy"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const (
	td      = "cluster.local"
	appPort = 8080
	svcPort = 80
	host    = "b.app.svc.cluster.local"
	svcKey  = "app/" + host
)

var (
	a4       = netip.MustParseAddr("10.250.1.2")
	b4       = netip.MustParseAddr("10.250.2.2")
	nodeB    = netip.MustParseAddr("10.250.2.1")
	vip      = netip.MustParseAddr("10.96.0.50")
	dnsVIP   = netip.MustParseAddr("10.96.0.10")
	clientID = identity.Identity{TrustDomain: td, Namespace: "app", ServiceAccount: "client"}
)

// env is a node namespace with two enrolled pods behind veths, A (a
// client, 10.250.1.2) and B (a server, 10.250.2.2, backing the service
// b.app with VIP 10.96.0.50:80 -> 8080), the pods' redirect rules as the
// CNI agent writes them, a state store as xDS would fill it, and a test CA.
type env struct {
	node, a, b *os.File
	store      *state.Store
	certs      *identity.Cache
	reg        *prometheus.Registry
	m          *metrics.Metrics
	dnsM       *dns.Metrics
	permissive atomic.Bool
	// upstream is the pods' DNS upstream (host:port); nothing answers by
	// default.
	upstream string
	seen     chan netip.AddrPort // remote address of each connection B's app saw
}

func newEnv(t testing.TB) *env {
	t.Helper()
	e := &env{node: netnstest.New(t), a: netnstest.New(t), b: netnstest.New(t), store: state.NewStore(),
		reg: prometheus.NewRegistry(), seen: make(chan netip.AddrPort, 1024)}
	mp := netip.MustParsePrefix
	netnstest.Veth(t, e.node, "va", mp("10.250.1.1/24"), e.a, "eth0", mp("10.250.1.2/24"))
	netnstest.Veth(t, e.node, "vb", mp("10.250.2.1/24"), e.b, "eth0", mp("10.250.2.2/24"))
	netnstest.Route(t, e.a, mp("0.0.0.0/0"), netip.MustParseAddr("10.250.1.1"))
	netnstest.Route(t, e.b, mp("0.0.0.0/0"), netip.MustParseAddr("10.250.2.1"))
	netnstest.Sysctl(t, e.node, "net/ipv4/ip_forward", "1")
	for _, ns := range []*os.File{e.a, e.b} {
		require.NoError(t, redirect.Apply(ns, redirect.Options{RedirectDNS: true, MarkOnly: true}))
	}
	ca, err := testca.New(td)
	require.NoError(t, err)
	e.certs = identity.NewCache(ca)
	e.m, err = metrics.New(e.reg)
	require.NoError(t, err)
	e.dnsM, err = dns.NewMetrics(e.reg)
	require.NoError(t, err)
	e.store.Update(func(tx *state.Tx) {
		tx.UpsertService(&state.Service{Name: "b", Namespace: "app", VIPs: []netip.Addr{vip}, Ports: []uint16{svcPort}})
		tx.UpsertWorkload(&state.Workload{UID: "c1/app/a", Name: "a", Namespace: "app", Addresses: []netip.Addr{a4},
			Network: "n1", Cluster: "c1", Node: "node-1", TrustDomain: td, ServiceAccount: "client",
			Protocol: state.TunnelHBONE, Status: state.StatusReady})
		tx.UpsertWorkload(&state.Workload{UID: "c1/app/b", Name: "b", Namespace: "app", Addresses: []netip.Addr{b4},
			Network: "n1", Cluster: "c1", Node: "node-1", TrustDomain: td, ServiceAccount: "server",
			Protocol: state.TunnelHBONE, Status: state.StatusReady,
			Services: map[string]state.PortMap{svcKey: {svcPort: appPort}}})
	})
	// B's application: it answers each line with the address it saw.
	ln, err := netns.Listen(context.Background(), e.b, "tcp", netip.AddrPortFrom(b4, appPort).String(), nil)
	require.NoError(t, err)
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() {
				defer c.Close()
				remote := netip.MustParseAddrPort(c.RemoteAddr().String())
				select {
				case e.seen <- netip.AddrPortFrom(remote.Addr().Unmap(), remote.Port()):
				default:
				}
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					if _, err := fmt.Fprintf(c, "b saw %s: %s", remote.Addr().Unmap(), line); err != nil {
						return
					}
				}
			})
		}
	})
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	return e
}

// dup returns a new descriptor of f: AddPod takes ownership of its file.
func dup(t testing.TB, f *os.File) *os.File {
	fd, err := unix.Dup(int(f.Fd()))
	require.NoError(t, err)
	return os.NewFile(uintptr(fd), f.Name())
}

// start runs a Manager (a ztunnel) serving A and B, as the agent would
// hand them over.
func (e *env) start(t testing.TB) *Manager {
	t.Helper()
	m, err := New(Config{Proxy: proxy.Config{Node: "node-1"}, Cluster: "c1", Network: "n1",
		Mark: redirect.Mark, DNS: dns.Config{Upstreams: []string{cmp.Or(e.upstream, "127.0.0.1:1")}}},
		Deps{Store: e.store, Certs: e.certs, Metrics: e.m, DNSMetrics: e.dnsM, Log: testLog(t),
			Plaintext: func(*state.Workload, netip.AddrPort, netip.AddrPort) bool { return e.permissive.Load() }})
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, m.AddPod(ctx, inpod.Pod{UID: "uid-a", Name: "a", Namespace: "app", ServiceAccount: "client", IPs: []netip.Addr{a4}}, dup(t, e.a)))
	require.NoError(t, m.AddPod(ctx, inpod.Pod{UID: "uid-b", Name: "b", Namespace: "app", ServiceAccount: "server", IPs: []netip.Addr{b4}}, dup(t, e.b)))
	require.NoError(t, m.Snapshot(ctx, []string{"uid-a", "uid-b"}))
	t.Cleanup(func() { m.Close() })
	return m
}

// dialFrom connects from inside ns as an unmodified application would: a
// plain socket, no mark, no proxy settings.
func dialFrom(ns *os.File, dst netip.AddrPort) (net.Conn, error) {
	d := &netns.Dialer{NetNS: ns, Timeout: 5 * time.Second}
	return d.DialContext(context.Background(), "tcp", dst.String())
}

// exchange sends one line and returns the reply line.
func exchange(c net.Conn, msg string) (string, error) {
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := fmt.Fprintf(c, "%s\n", msg); err != nil {
		return "", err
	}
	return bufio.NewReader(c).ReadString('\n')
}

func request(ns *os.File, dst netip.AddrPort, msg string) (string, error) {
	c, err := dialFrom(ns, dst)
	if err != nil {
		return "", err
	}
	defer c.Close()
	return exchange(c, msg)
}

// counter sums a counter family over the series whose labels include want.
func counter(t testing.TB, g prometheus.Gatherer, name string, want map[string]string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	require.NoError(t, err)
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, mm := range mf.GetMetric() {
			if hasLabels(mm, want) {
				sum += mm.GetCounter().GetValue()
			}
		}
	}
	return sum
}

func hasLabels(m *dto.Metric, want map[string]string) bool {
	n := 0
	for _, l := range m.GetLabel() {
		if v, ok := want[l.GetName()]; ok && v == l.GetValue() {
			n++
		}
	}
	return n == len(want)
}

// TestCapturedTraffic: an unmodified client in pod A connects to pod B's
// address and to B's service VIP; both are captured in A, carried over
// HBONE with A's identity (taken from its enrolment), and arrive at B's
// application through ztunnel's inbound inside B. The pod's loopback is
// not captured.
func TestCapturedTraffic(t *testing.T) {
	e := newEnv(t)
	e.start(t)
	for _, dst := range []netip.AddrPort{netip.AddrPortFrom(b4, appPort), netip.AddrPortFrom(vip, svcPort)} {
		got, err := request(e.a, dst, "hello "+dst.String())
		require.NoError(t, err, dst)
		// ztunnel's inbound connects to the app from inside B.
		require.Equal(t, fmt.Sprintf("b saw %s: hello %s\n", b4, dst), got)
	}
	require.Equal(t, 2.0, counter(t, e.reg, "isthmus_tcp_connections_opened_total",
		map[string]string{"reporter": "destination", "source_principal": clientID.String()}), "HBONE with A's identity")
	require.Equal(t, 2.0, counter(t, e.reg, "isthmus_captured_connections_total", map[string]string{"direction": "outbound"}))
	require.Equal(t, 2.0, counter(t, e.reg, "isthmus_captured_connections_total", map[string]string{"direction": "inbound_hbone"}))

	// A's own loopback is not captured.
	lo, err := netns.Listen(context.Background(), e.a, "tcp", "127.0.0.1:9999", nil)
	require.NoError(t, err)
	defer lo.Close()
	go func() {
		c, err := lo.Accept()
		if err == nil {
			_, _ = io.WriteString(c, "loopback\n")
			c.Close()
		}
	}()
	c, err := dialFrom(e.a, netip.MustParseAddrPort("127.0.0.1:9999"))
	require.NoError(t, err)
	got, err := bufio.NewReader(c).ReadString('\n')
	c.Close()
	require.NoError(t, err)
	require.Equal(t, "loopback\n", got)
	require.Equal(t, 2.0, counter(t, e.reg, "isthmus_captured_connections_total", map[string]string{"direction": "outbound"}))
}

// TestPlaintextInbound: plaintext to an enrolled pod (from outside the
// mesh) is refused by default (STRICT) and never reaches the application;
// with PERMISSIVE it does.
func TestPlaintextInbound(t *testing.T) {
	e := newEnv(t)
	e.start(t)
	_, err := request(e.node, netip.AddrPortFrom(b4, appPort), "plaintext")
	require.Error(t, err, "refused")
	require.Equal(t, 1.0, counter(t, e.reg, "isthmus_hbone_refused_total", map[string]string{"reason": proxy.ReasonPlaintextRefused}))
	select {
	case r := <-e.seen:
		t.Fatalf("the app saw a plaintext connection from %s", r)
	default:
	}
	e.permissive.Store(true)
	got, err := request(e.node, netip.AddrPortFrom(b4, appPort), "plaintext")
	require.NoError(t, err)
	require.Equal(t, fmt.Sprintf("b saw %s: plaintext\n", b4), got)
	require.Equal(t, 2.0, counter(t, e.reg, "isthmus_captured_connections_total", map[string]string{"direction": "inbound_plaintext"}))
}

// TestZtunnelRestartFailsClosed: while no ztunnel serves the pods, their
// rules stay: A's connections fail, and plaintext to B from outside never
// reaches B's application; once a ztunnel serves them again, traffic
// works.
func TestZtunnelRestartFailsClosed(t *testing.T) {
	e := newEnv(t)
	m := e.start(t)
	_, err := request(e.a, netip.AddrPortFrom(b4, appPort), "before")
	require.NoError(t, err)
	<-e.seen
	require.NoError(t, m.Close())
	_, err = request(e.a, netip.AddrPortFrom(b4, appPort), "during")
	require.Error(t, err)
	e.permissive.Store(true) // even a permissive pod is not reached around ztunnel
	_, err = request(e.node, netip.AddrPortFrom(b4, appPort), "around")
	require.Error(t, err)
	select {
	case r := <-e.seen:
		t.Fatalf("the app saw a connection from %s while ztunnel was away", r)
	default:
	}
	e.start(t)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		got, err := request(e.a, netip.AddrPortFrom(b4, appPort), "after")
		require.NoError(c, err)
		require.Equal(c, fmt.Sprintf("b saw %s: after\n", b4), got)
	}, 10*time.Second, 50*time.Millisecond)
}

// TestPodDNS: a plain DNS query from pod A to its nameserver's address is
// captured and answered by ztunnel with the service's address, over UDP
// and TCP; an unknown name in the mesh domain gets NXDOMAIN at once.
func TestPodDNS(t *testing.T) {
	e := newEnv(t)
	e.store.Update(func(tx *state.Tx) {
		// Known to the mesh without any address (an ExternalName Service).
		tx.UpsertService(&state.Service{Name: "ext", Namespace: "app", Ports: []uint16{svcPort}})
	})
	upstream, asked := startUpstream(t, map[string]netip.Addr{
		"example.org.":               netip.MustParseAddr("192.0.2.7"),
		"ext.app.svc.cluster.local.": netip.MustParseAddr("192.0.2.8"),
	})
	e.upstream = upstream
	e.start(t)
	for _, proto := range []string{"udp", "tcp"} {
		c := &mdns.Client{Net: proto, Timeout: 5 * time.Second, Dialer: &net.Dialer{}}
		var conn net.Conn
		var err error
		if proto == "udp" {
			err = netns.Do(e.a, func() (err error) {
				conn, err = net.Dial("udp", netip.AddrPortFrom(dnsVIP, 53).String())
				return err
			})
		} else {
			conn, err = dialFrom(e.a, netip.AddrPortFrom(dnsVIP, 53))
		}
		require.NoError(t, err, proto)
		ask := func(name string) *mdns.Msg {
			q := new(mdns.Msg)
			q.SetQuestion(name, mdns.TypeA)
			r, _, err := c.ExchangeWithConn(q, &mdns.Conn{Conn: conn})
			require.NoError(t, err, proto+" "+name)
			return r
		}
		answer := func(r *mdns.Msg) string {
			require.Len(t, r.Answer, 1, proto)
			return r.Answer[0].(*mdns.A).A.String()
		}
		require.Equal(t, vip.String(), answer(ask("b.app.svc.cluster.local.")))
		require.Equal(t, vip.String(), answer(ask("b."))) // a short name, in the pod's namespace app
		require.Equal(t, mdns.RcodeNameError, ask("nope.app.svc.cluster.local.").Rcode)
		// Names outside the mesh, and mesh services without an address, are
		// the upstream's to answer.
		require.Equal(t, "192.0.2.7", answer(ask("example.org.")))
		require.Equal(t, "192.0.2.8", answer(ask("ext.app.svc.cluster.local.")))
		conn.Close()
	}
	require.GreaterOrEqual(t, counter(t, e.reg, "isthmus_dns_queries_total", map[string]string{"kind": "mesh"}), 4.0)
	require.Equal(t, []string{"example.org.", "ext.app.svc.cluster.local.", "example.org.", "ext.app.svc.cluster.local."}, asked(),
		"only the names the mesh does not answer reached the upstream, over UDP and TCP")
}

// startUpstream serves DNS on a fresh loopback address (UDP and TCP) in the
// test's namespace, where the pods' DNS proxies forward: it answers the
// A records in names, NXDOMAIN otherwise. asked lists the names queried.
func startUpstream(t *testing.T, names map[string]netip.Addr) (addr string, asked func() []string) {
	t.Helper()
	var mu sync.Mutex
	var got []string
	h := mdns.HandlerFunc(func(w mdns.ResponseWriter, r *mdns.Msg) {
		m := new(mdns.Msg)
		m.SetReply(r)
		q := r.Question[0]
		mu.Lock()
		got = append(got, q.Name)
		mu.Unlock()
		if a, ok := names[q.Name]; ok {
			m.Answer = append(m.Answer, &mdns.A{Hdr: mdns.RR_Header{Name: q.Name, Rrtype: mdns.TypeA, Class: mdns.ClassINET, Ttl: 60}, A: a.AsSlice()})
		} else {
			m.Rcode = mdns.RcodeNameError
		}
		_ = w.WriteMsg(m)
	})
	ip := testnet.NextAddr()
	pc, err := net.ListenPacket("udp", netip.AddrPortFrom(ip, 0).String())
	require.NoError(t, err)
	ln, err := net.Listen("tcp", pc.LocalAddr().String())
	require.NoError(t, err)
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
	return pc.LocalAddr().String(), func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(got)
	}
}

// TestUnknownPodIsRefused: a pod whose workload xDS does not (yet) know
// gets no identity: its captured connections are refused, never sent as
// another workload.
func TestUnknownPodIsRefused(t *testing.T) {
	e := newEnv(t)
	e.store.Update(func(tx *state.Tx) { tx.RemoveWorkload("c1/app/a") })
	e.start(t)
	_, err := request(e.a, netip.AddrPortFrom(b4, appPort), "who am I")
	require.Error(t, err)
	require.Equal(t, 1.0, counter(t, e.reg, "isthmus_hbone_refused_total", map[string]string{"reason": proxy.ReasonUnknownSource}))
}

func testLog(t testing.TB) *slog.Logger {
	if _, bench := t.(*testing.B); bench {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// TestActiveProxyCount: workload_manager_active_proxy_count is the number
// of pods served, as the agent adds and removes them.
func TestActiveProxyCount(t *testing.T) {
	e := newEnv(t)
	m := e.start(t)
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(m.Collector()))
	active := func() float64 {
		v, err := promread.Value(reg, ActiveProxyCount, nil)
		require.NoError(t, err)
		return v
	}
	require.Equal(t, 2.0, active())
	require.NoError(t, m.DelPod(context.Background(), "uid-a"))
	require.Equal(t, 1.0, active())
	require.NoError(t, m.Close())
	require.Zero(t, active())
}
