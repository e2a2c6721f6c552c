package dns_test

import (
	"context"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	mdns "github.com/miekg/dns"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/ztunnel/dns"
	"github.com/isthmus-mesh/isthmus/ztunnel/internal/testnet"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

func meshDeps(m *mesh) dns.Deps {
	return dns.Deps{Catalog: m.catalog, Client: m.catalog.ClientFor}
}

func count(t *testing.T, p *proxy, kind dns.Kind) float64 {
	t.Helper()
	mfs, err := p.reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "isthmus_dns_queries_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if m.GetLabel()[0].GetValue() == string(kind) {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

// TestMeshNames proves the names the mesh answers, over UDP and TCP, with
// the mesh TTL, the authoritative bit, and no query reaching the upstream.
func TestMeshNames(t *testing.T) {
	m, up := newMesh(), startUpstream(t)
	p := startProxy(t, dns.Config{Upstreams: []string{up.addr}, TTL: 17 * time.Second}, meshDeps(m))
	none := []netip.Addr(nil)
	cases := []struct {
		name  string
		from  netip.Addr
		qtype uint16
		want  []netip.Addr
	}{
		{"echo.demo.svc.cluster.local.", m.client, mdns.TypeA, []netip.Addr{echoVIP}},
		{"ECHO.Demo.svc.cluster.local.", m.client, mdns.TypeAAAA, []netip.Addr{echoVIP6}},
		{"echo.demo.svc.cluster.local.", m.client, mdns.TypeANY, []netip.Addr{echoVIP, echoVIP6}},
		{"echo.", m.client, mdns.TypeA, []netip.Addr{echoVIP}},         // search path: client's namespace
		{"echo.demo.", m.other, mdns.TypeA, []netip.Addr{echoVIP}},     // <svc>.<ns> from another namespace
		{"echo.demo.svc.", m.other, mdns.TypeA, []netip.Addr{echoVIP}}, // <svc>.<ns>.svc
		{"echo.demo.svc.clusterset.local.", m.other, mdns.TypeA, []netip.Addr{echoVIP}},
		{"remote.demo.svc.cluster.local.", m.client, mdns.TypeA, []netip.Addr{remoteVIP}}, // allocated: no VIP in n1
		{"remote.demo.svc.cluster.local.", m.client, mdns.TypeAAAA, []netip.Addr{remoteVIP6}},
		{"db.demo.svc.cluster.local.", m.client, mdns.TypeA, []netip.Addr{m.db0, m.db1}}, // ready same-network endpoints
		{"db.demo.svc.cluster.local.", m.client, mdns.TypeAAAA, none},                    // NODATA
		{"db-1.db.demo.svc.cluster.local.", m.client, mdns.TypeA, []netip.Addr{m.db1}},
		{"db-2.db.demo.svc.cluster.local.", m.client, mdns.TypeA, []netip.Addr{m.db2}},       // a pod name exists while not ready
		{"db-7.db.demo.svc.cluster.local.", m.client, mdns.TypeA, []netip.Addr{headlessVIP}}, // a pod on n2: gateway path
		{"far.demo.svc.cluster.local.", m.client, mdns.TypeA, []netip.Addr{headlessVIP}},     // headless, endpoints on n2 only
		{"far.demo.svc.clusterset.local.", m.client, mdns.TypeA, []netip.Addr{headlessVIP}},
		{"shared.demo.svc.clusterset.local.", m.client, mdns.TypeA, []netip.Addr{clusterSet}}, // the ServiceImport IP
		{"shared.demo.svc.cluster.local.", m.client, mdns.TypeA, []netip.Addr{sharedVIP}},     // the local ClusterIP
		{"shared.", m.client, mdns.TypeA, []netip.Addr{sharedVIP}},
		{"db-1.c1.db.demo.svc.clusterset.local.", m.client, mdns.TypeA, nil}, // db is not exported: checked below as NXDOMAIN
		{"demo.svc.cluster.local.", m.client, mdns.TypeA, none},              // empty non-terminal
		{"echo.demo.svc.cluster.local.", m.client, mdns.TypeMX, none},        // other types: NODATA
	}
	for _, c := range cases {
		for _, tr := range []string{"udp", "tcp"} {
			r := exchange(t, tr, p.addr, c.from, c.name, c.qtype, 0)
			if c.name == "db-1.c1.db.demo.svc.clusterset.local." {
				require.Equal(t, mdns.RcodeNameError, r.Rcode)
				continue
			}
			require.Equal(t, mdns.RcodeSuccess, r.Rcode, "%s %s", c.name, tr)
			require.True(t, r.Authoritative, c.name)
			require.ElementsMatch(t, c.want, addrs(t, r, 17), "%s %s %s", c.name, mdns.TypeToString[c.qtype], tr)
			require.Equal(t, c.name, r.Question[0].Name)
			if len(c.want) == 0 {
				require.Len(t, r.Ns, 1, "NODATA carries the SOA")
				require.Equal(t, uint32(5), r.Ns[0].(*mdns.SOA).Minttl, "negative TTL")
			}
		}
	}
	require.Zero(t, up.udp.Load()+up.tcp.Load(), "no mesh name reaches the upstream")
	require.Equal(t, float64(2*(len(cases)-1)), count(t, p, dns.KindMesh))
}

// TestNXDomainAtOnce proves a name in the mesh zones that the mesh does not
// know is denied without asking the upstream, with the zone's SOA; and that
// before the catalog is ready such names are forwarded instead.
func TestNXDomainAtOnce(t *testing.T) {
	m, up := newMesh(), startUpstream(t)
	var ready atomic.Bool
	deps := meshDeps(m)
	deps.Ready = ready.Load
	p := startProxy(t, dns.Config{Upstreams: []string{up.addr}}, deps)

	r := exchange(t, "udp", p.addr, m.client, "nope.demo.svc.cluster.local.", mdns.TypeA, 0)
	require.Equal(t, mdns.RcodeNameError, r.Rcode)
	require.False(t, r.Authoritative, "not ready: the upstream answered")
	require.Equal(t, int64(1), up.udp.Load())

	ready.Store(true)
	for _, name := range []string{
		"nope.demo.svc.cluster.local.",
		"a.b.c.d.svc.cluster.local.",            // too deep
		"echo.demo.demo.svc.cluster.local.",     // search path applied to a qualified name: pod "echo" of service demo
		"remote.demo.svc.clusterset.local.",     // not exported
		"db-0.c1.db.demo.svc.clusterset.local.", // not exported
		"echo.demo.svc.cluster.local.demo.svc.cluster.local.",
	} {
		r := exchange(t, "udp", p.addr, m.client, name, mdns.TypeA, 0)
		require.Equal(t, mdns.RcodeNameError, r.Rcode, name)
		require.True(t, r.Authoritative, name)
		require.Len(t, r.Ns, 1, name)
		require.Equal(t, mdns.TypeSOA, r.Ns[0].Header().Rrtype, name)
	}
	require.Equal(t, int64(1), up.udp.Load(), "denied without the upstream")
	require.Equal(t, float64(6), count(t, p, dns.KindNXDomain))

	// SRV-style names are kube-dns' records: forwarded.
	r = exchange(t, "udp", p.addr, m.client, "_http._tcp.echo.demo.svc.cluster.local.", mdns.TypeSRV, 0)
	require.False(t, r.Authoritative)
	require.Equal(t, int64(2), up.udp.Load())

	// A service without any address (an ExternalName service: kube-dns
	// answers its CNAME) is forwarded, by its full and its short name.
	m.store.Update(func(tx *state.Tx) {
		tx.UpsertService(&state.Service{Name: "ext", Namespace: "demo", Ports: []uint16{443}})
	})
	r = exchange(t, "udp", p.addr, m.client, "ext.demo.svc.cluster.local.", mdns.TypeA, 0)
	require.False(t, r.Authoritative)
	r = exchange(t, "udp", p.addr, m.client, "ext.", mdns.TypeA, 0)
	require.False(t, r.Authoritative)
	require.Equal(t, int64(4), up.udp.Load())
	r = exchange(t, "udp", p.addr, m.client, "ext.demo.svc.clusterset.local.", mdns.TypeA, 0)
	require.True(t, r.Authoritative, "clusterset.local is the mesh's alone: NODATA")
	require.Equal(t, mdns.RcodeSuccess, r.Rcode)
	require.Empty(t, r.Answer)
	require.Equal(t, int64(4), up.udp.Load())
}

// TestForwarding proves other names are forwarded with the upstream's
// TTL; unknown short names too; the client's transport is used.
func TestForwarding(t *testing.T) {
	m, up := newMesh(), startUpstream(t)
	p := startProxy(t, dns.Config{Upstreams: []string{up.addr}}, meshDeps(m))

	r := exchange(t, "udp", p.addr, m.client, "ext.example.", mdns.TypeA, 0)
	require.Equal(t, []netip.Addr{extAddr}, addrs(t, r, 1234), "upstream TTL kept")
	require.Equal(t, int64(1), up.udp.Load())
	r = exchange(t, "tcp", p.addr, m.client, "ext.example.", mdns.TypeA, 0)
	require.Equal(t, []netip.Addr{extAddr}, addrs(t, r, 1234))
	require.Equal(t, int64(1), up.tcp.Load(), "a TCP query is forwarded over TCP")

	// A single label that is no service of the client's namespace is
	// forwarded.
	r = exchange(t, "udp", p.addr, m.client, "nosuch.", mdns.TypeA, 0)
	require.Equal(t, mdns.RcodeNameError, r.Rcode)
	require.Equal(t, int64(2), up.udp.Load())
	require.Equal(t, float64(3), count(t, p, dns.KindForwarded))
}

func refusedCount(t *testing.T, p *proxy) float64 {
	t.Helper()
	mfs, err := p.reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "isthmus_dns_refused_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if m.GetLabel()[0].GetValue() == dns.RefusedUnknownClient {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

// TestStrangersGetNoAnswer: a node's DNS proxy answers only the node's
// pods. An address the mesh does not know, a pod of another node and a
// hostNetwork workload (the node's address) ask, over UDP and TCP, for a
// mesh name, an external name (which an open resolver would forward and
// reflect) and with a malformed query: none gets any answer (the client
// times out), nothing reaches the upstream, and each is counted.
func TestStrangersGetNoAnswer(t *testing.T) {
	m, up := newMesh(), startUpstream(t)
	elsewhere, host := testnet.NextAddr(), testnet.NextAddr()
	m.store.Update(func(tx *state.Tx) {
		tx.UpsertWorkload(&state.Workload{UID: "c1/demo/elsewhere", Name: "elsewhere", Namespace: "demo",
			Addresses: []netip.Addr{elsewhere}, Network: "n1", Cluster: "c1", Node: "node-2", Status: state.StatusReady})
		tx.UpsertWorkload(&state.Workload{UID: "c1/kube-system/host", Name: "host", Namespace: "kube-system",
			Addresses: []netip.Addr{host}, Network: "n1", Cluster: "c1", Node: testNode, HostNetwork: true, Status: state.StatusReady})
	})
	p := startProxy(t, dns.Config{Upstreams: []string{up.addr}}, meshDeps(m))
	refused := 0.0
	for _, src := range []netip.Addr{testnet.NextAddr(), elsewhere, host} {
		for _, proto := range []string{"udp", "tcp"} {
			for _, name := range []string{"echo.demo.svc.cluster.local.", "ext.example."} {
				_, err := tryExchangeTimeout(proto, p.addr, src, name, mdns.TypeA, 1232, 300*time.Millisecond)
				require.Error(t, err, "%s asked %s over %s", src, name, proto)
				refused++
			}
		}
		c, err := (&net.Dialer{LocalAddr: &net.UDPAddr{IP: src.AsSlice()}}).Dial("udp", p.addr)
		require.NoError(t, err)
		_, err = c.Write([]byte{0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0, 5, 'e', 'c'})
		require.NoError(t, err)
		require.NoError(t, c.SetReadDeadline(time.Now().Add(300*time.Millisecond)))
		_, err = c.Read(make([]byte, 512))
		require.ErrorIs(t, err, os.ErrDeadlineExceeded, "not even FORMERR for %s", src)
		c.Close()
		refused++
	}
	require.Equal(t, int64(0), up.udp.Load()+up.tcp.Load(), "nothing forwarded for strangers")
	require.Equal(t, refused, refusedCount(t, p))
	require.Equal(t, float64(0), count(t, p, dns.KindFormErr))
	r := exchange(t, "udp", p.addr, m.client, "echo.demo.svc.cluster.local.", mdns.TypeA, 0)
	require.Equal(t, []netip.Addr{echoVIP}, addrs(t, r, 30), "the node's pods are answered")
}

// TestTruncation proves a truncated UDP answer from the upstream is asked
// again over TCP, and that the client gets what fits its buffer: all of it
// with a 1232-byte EDNS0 buffer, a truncated answer (TC) without EDNS0,
// after which its TCP retry gets all of it.
func TestTruncation(t *testing.T) {
	m, up := newMesh(), startUpstream(t)
	p := startProxy(t, dns.Config{Upstreams: []string{up.addr}}, meshDeps(m))

	r := exchange(t, "udp", p.addr, m.client, "big.example.", mdns.TypeA, 1232)
	require.False(t, r.Truncated)
	require.Len(t, r.Answer, 60)
	require.Equal(t, int64(1), up.udp.Load())
	require.Equal(t, int64(1), up.tcp.Load(), "TC from the upstream: retried over TCP")

	r = exchange(t, "udp", p.addr, m.client, "big.example.", mdns.TypeA, 0)
	require.True(t, r.Truncated, "60 A records exceed 512 bytes")
	require.Less(t, len(r.Answer), 60)
	r = exchange(t, "tcp", p.addr, m.client, "big.example.", mdns.TypeA, 0)
	require.False(t, r.Truncated)
	require.Len(t, r.Answer, 60)
}

// TestUpstreamFailure proves a silent upstream is skipped for the next one,
// and that the client gets SERVFAIL, not a timeout, when none answers.
func TestUpstreamFailure(t *testing.T) {
	m, up := newMesh(), startUpstream(t)
	silent, err := net.ListenPacket("udp", "127.0.0.1:0") // bound, never read
	require.NoError(t, err)
	t.Cleanup(func() { _ = silent.Close() })

	p := startProxy(t, dns.Config{Upstreams: []string{silent.LocalAddr().String(), up.addr}, UpstreamTimeout: 300 * time.Millisecond}, meshDeps(m))
	r := exchange(t, "udp", p.addr, m.client, "ext.example.", mdns.TypeA, 0)
	require.Equal(t, []netip.Addr{extAddr}, addrs(t, r, 1234), "the second upstream answered")

	r = exchange(t, "udp", p.addr, m.client, "slow.example.", mdns.TypeA, 0)
	require.Equal(t, mdns.RcodeServerFailure, r.Rcode)
	r = exchange(t, "tcp", p.addr, m.client, "slow.example.", mdns.TypeA, 0)
	require.Equal(t, mdns.RcodeServerFailure, r.Rcode)
	require.Equal(t, float64(2), count(t, p, dns.KindServFail))
}

// TestMalformed proves malformed and unsupported queries get FORMERR or
// NOTIMP and are counted, and the server keeps serving.
func TestMalformed(t *testing.T) {
	m, up := newMesh(), startUpstream(t)
	p := startProxy(t, dns.Config{Upstreams: []string{up.addr}}, meshDeps(m))
	c, err := (&net.Dialer{LocalAddr: &net.UDPAddr{IP: m.client.AsSlice()}}).Dial("udp", p.addr)
	require.NoError(t, err)
	defer c.Close()
	send := func(b []byte) *mdns.Msg {
		t.Helper()
		_, err := c.Write(b)
		require.NoError(t, err)
		require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
		buf := make([]byte, 1500)
		n, err := c.Read(buf)
		require.NoError(t, err)
		r := new(mdns.Msg)
		require.NoError(t, r.Unpack(buf[:n]))
		return r
	}
	// A header announcing one question, followed by a truncated name.
	r := send([]byte{0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0, 5, 'e', 'c'})
	require.Equal(t, mdns.RcodeFormatError, r.Rcode)
	require.Equal(t, uint16(0x1234), r.Id)
	// Two questions.
	q := new(mdns.Msg)
	q.SetQuestion("echo.demo.svc.cluster.local.", mdns.TypeA)
	q.Question = append(q.Question, q.Question[0])
	b, err := q.Pack()
	require.NoError(t, err)
	require.Equal(t, mdns.RcodeFormatError, send(b).Rcode)
	// A dynamic update.
	q.SetUpdate("cluster.local.")
	b, err = q.Pack()
	require.NoError(t, err)
	require.Equal(t, mdns.RcodeNotImplemented, send(b).Rcode)
	// A NOTIFY passes miekg's accept filter; the handler refuses it.
	q = new(mdns.Msg)
	q.SetNotify("cluster.local.")
	b, err = q.Pack()
	require.NoError(t, err)
	require.Equal(t, mdns.RcodeNotImplemented, send(b).Rcode)

	require.Equal(t, float64(4), count(t, p, dns.KindFormErr))
	r = exchange(t, "udp", p.addr, m.client, "echo.demo.svc.cluster.local.", mdns.TypeA, 0)
	require.Equal(t, []netip.Addr{echoVIP}, addrs(t, r, 30), "still serving")
}

// TestStoreUpdates proves answers follow the store: a new service resolves
// on the next query, a removed one is denied.
func TestStoreUpdates(t *testing.T) {
	m, up := newMesh(), startUpstream(t)
	p := startProxy(t, dns.Config{Upstreams: []string{up.addr}}, meshDeps(m))
	name := "late.demo.svc.cluster.local."
	require.Equal(t, mdns.RcodeNameError, exchange(t, "udp", p.addr, m.client, name, mdns.TypeA, 0).Rcode)
	vip := netip.MustParseAddr("10.96.0.99")
	m.store.Update(func(tx *state.Tx) {
		tx.UpsertService(&state.Service{Name: "late", Namespace: "demo", VIPs: []netip.Addr{vip}, Ports: []uint16{80}})
	})
	require.Equal(t, []netip.Addr{vip}, addrs(t, exchange(t, "udp", p.addr, m.client, name, mdns.TypeA, 0), 30))
	m.store.Update(func(tx *state.Tx) { tx.RemoveService("demo/late.demo.svc.cluster.local") })
	require.Equal(t, mdns.RcodeNameError, exchange(t, "udp", p.addr, m.client, name, mdns.TypeA, 0).Rcode)
}

// TestCustomDomain proves the cluster domain is configurable.
func TestCustomDomain(t *testing.T) {
	m, up := newMesh(), startUpstream(t)
	m.store.Update(func(tx *state.Tx) {
		tx.UpsertService(&state.Service{Name: "echo", Namespace: "demo", Hostname: "echo.demo.svc.corp.example",
			VIPs: []netip.Addr{netip.MustParseAddr("10.97.0.1")}, Ports: []uint16{80}})
	})
	m.catalog.Domain = "corp.example"
	p := startProxy(t, dns.Config{Upstreams: []string{up.addr}, Domain: "corp.example."}, meshDeps(m))
	r := exchange(t, "udp", p.addr, m.client, "echo.demo.svc.corp.example.", mdns.TypeA, 0)
	require.Equal(t, []netip.Addr{netip.MustParseAddr("10.97.0.1")}, addrs(t, r, 30))
	r = exchange(t, "udp", p.addr, m.client, "x.demo.svc.corp.example.", mdns.TypeA, 0)
	require.Equal(t, mdns.RcodeNameError, r.Rcode)
	r = exchange(t, "udp", p.addr, m.client, "x.demo.svc.cluster.local.", mdns.TypeA, 0)
	require.False(t, r.Authoritative, "cluster.local is not this mesh's domain: forwarded")
}

// TestFixedClient proves an in-pod listener can name its pod for every
// query, whatever the source address.
func TestFixedClient(t *testing.T) {
	m, up := newMesh(), startUpstream(t)
	deps := dns.Deps{Catalog: m.catalog, Client: func(netip.Addr) (dns.Client, bool) {
		return dns.Client{Namespace: "demo", Network: "n1"}, true
	}}
	p := startProxy(t, dns.Config{Upstreams: []string{up.addr}}, deps)
	r := exchange(t, "udp", p.addr, netip.MustParseAddr("127.0.0.1"), "echo.", mdns.TypeA, 0)
	require.Equal(t, []netip.Addr{echoVIP}, addrs(t, r, 30))
}

// TestLifecycle proves Close is idempotent before, during and after Run,
// that Run after Close fails, that a cancelled context stops Run, and that
// no goroutine is left (TestMain's goleak).
func TestLifecycle(t *testing.T) {
	m := newMesh()
	mk := func() *dns.Server {
		pc, err := net.ListenPacket("udp", "127.0.0.1:0")
		require.NoError(t, err)
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		s, err := dns.New(dns.Config{Upstreams: []string{"127.0.0.1:53"}},
			dns.Deps{Catalog: m.catalog, Client: m.catalog.ClientFor, PacketConns: []net.PacketConn{pc}, Listeners: []net.Listener{ln}})
		require.NoError(t, err)
		return s
	}
	s := mk()
	require.NoError(t, s.Close())
	require.NoError(t, s.Close())
	require.ErrorIs(t, s.Run(context.Background()), dns.ErrClosed)

	s = mk()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	cancel()
	require.NoError(t, <-done)
	require.NoError(t, s.Close())

	s = mk()
	go func() { done <- s.Run(context.Background()) }()
	go func() { _ = s.Close() }()
	require.NoError(t, s.Close())
	if err := <-done; err != nil { // Close may win the race with Run's start
		require.ErrorIs(t, err, dns.ErrClosed)
	}
	require.ErrorIs(t, s.Run(context.Background()), dns.ErrClosed)

	_, err := dns.New(dns.Config{Upstreams: []string{"not-an-ip"}}, dns.Deps{})
	require.ErrorContains(t, err, "Catalog is required")
	require.ErrorContains(t, err, "Client is required")
	require.ErrorContains(t, err, "not an IP address")
	require.ErrorContains(t, err, "nothing to serve")
	_, err = dns.New(dns.Config{ResolvConf: "/nonexistent/resolv.conf"}, dns.Deps{})
	require.ErrorContains(t, err, "/nonexistent/resolv.conf")
}

// TestResolvConf proves the default upstreams are the nameservers of the
// resolv.conf file.
func TestResolvConf(t *testing.T) {
	m, up := newMesh(), startUpstreamOn(t, "53") // resolv.conf has no port: 53 on its own loopback address
	host, _, _ := net.SplitHostPort(up.addr)
	f := filepath.Join(t.TempDir(), "resolv.conf")
	require.NoError(t, os.WriteFile(f, []byte("search demo.svc.cluster.local svc.cluster.local\nnameserver "+host+"\noptions ndots:5\n"), 0o600))
	p := startProxy(t, dns.Config{ResolvConf: f}, meshDeps(m))
	r := exchange(t, "udp", p.addr, m.client, "ext.example.", mdns.TypeA, 0)
	require.Equal(t, []netip.Addr{extAddr}, addrs(t, r, 1234))
}
