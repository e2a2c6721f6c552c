package proxy

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/internal/spiffe"
	"github.com/isthmus-mesh/isthmus/ztunnel/hbone"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/internal/testca"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// fedNet is one network of a federation test: its own trust domain and
// root CA, a client pod, an echo pod with its node's inbound, and an
// east-west gateway, each on its own loopback address.
type fedNet struct {
	name, cluster, td string
	ca                *testca.CA
	certs             *identity.Cache
	store             *state.Store
	client, echo, gw  netip.Addr
	socks             netip.AddrPort
	mOut, mIn, mGW    *metrics.Metrics
}

func (n *fedNet) hostname() string { return state.Hostname("echo-"+n.name, "default") }

func (n *fedNet) gwID() identity.Identity {
	return identity.Identity{TrustDomain: n.td, Namespace: "isthmus-system", ServiceAccount: "eastwest"}
}

func (n *fedNet) echoID() identity.Identity {
	return identity.Identity{TrustDomain: n.td, Namespace: "default", ServiceAccount: "echo"}
}

func (n *fedNet) service() *state.Service {
	return &state.Service{Name: "echo-" + n.name, Namespace: "default", Hostname: n.hostname(), Ports: []uint16{svcPort}}
}

// newFedNet makes network name with trust domain td and its own root.
func newFedNet(t *testing.T, name, td string) *fedNet {
	ca, err := testca.New(td)
	require.NoError(t, err)
	n := &fedNet{name: name, cluster: "c-" + name, td: td, ca: ca, store: state.NewStore(),
		client: nextAddr(), echo: nextAddr(), gw: nextAddr(),
		mOut: newMetrics(t), mIn: newMetrics(t), mGW: newMetrics(t)}
	n.certs = identity.NewCache(ca)
	n.socks = netip.AddrPortFrom(nextAddr(), 15080)
	return n
}

// federation builds the networks' views: each sees its own pods and
// service, and every other network's service as one workload behind that
// network's gateway, with the remote trust domain's identities (what pilot
// sends). It starts every ztunnel and echo app.
func federation(t *testing.T, nets ...*fedNet) {
	for _, n := range nets {
		n.store.Update(func(tx *state.Tx) {
			client := &state.Workload{UID: n.name + "/client", Name: "client", Namespace: "default", Addresses: []netip.Addr{n.client},
				Network: n.name, Cluster: n.cluster, Node: "node-client-" + n.name, TrustDomain: n.td, ServiceAccount: "client",
				Protocol: state.TunnelHBONE, Status: state.StatusReady}
			tx.UpsertWorkload(client)
			tx.UpsertService(n.service())
			tx.UpsertWorkload(&state.Workload{UID: n.name + "/echo", Name: "echo", Namespace: "default", Addresses: []netip.Addr{n.echo},
				Network: n.name, Cluster: n.cluster, Node: "node-echo-" + n.name, TrustDomain: n.td, ServiceAccount: "echo",
				Protocol: state.TunnelHBONE, Status: state.StatusReady,
				Services: map[string]state.PortMap{"default/" + n.hostname(): {svcPort: appPort}}})
			for _, o := range nets {
				if o == n {
					continue
				}
				tx.UpsertService(o.service())
				gw := &state.NetworkGateway{Network: o.name, Address: o.gw, HBONEPort: 15008, Identities: []identity.Identity{o.gwID()}}
				tx.UpsertWorkload(&state.Workload{UID: o.name + "/echo", Name: "echo", Namespace: "default", Network: o.name,
					TrustDomain: o.td, Protocol: state.TunnelHBONE, Identities: []identity.Identity{o.echoID()},
					Gateways: []*state.NetworkGateway{gw}, Status: state.StatusReady, Capacity: 1,
					Services: map[string]state.PortMap{"default/" + o.hostname(): {svcPort: appPort}}})
			}
		})
		startEcho(t, n.echo)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var closers []func() error
	for _, n := range nets {
		cfg := func(node string) Config {
			return Config{Node: node, Server: hbone.ServerConfig{HandshakeTimeout: 2 * time.Second}}
		}
		in, err := NewInbound(cfg("node-echo-"+n.name), Deps{Store: n.store, Certs: n.certs, Metrics: n.mIn, Log: testLog(t)})
		require.NoError(t, err)
		wg.Go(func() { _ = in.Run(ctx) })
		gw, err := NewGateway(GatewayConfig{Config: cfg("node-gw-" + n.name), Network: n.name, Cluster: n.cluster, Identity: n.gwID()},
			Deps{Store: n.store, Certs: n.certs, Metrics: n.mGW, Log: testLog(t)}, state.Selector{})
		require.NoError(t, err)
		gln, err := net.Listen("tcp", netip.AddrPortFrom(n.gw, 15008).String())
		require.NoError(t, err)
		wg.Go(func() { _ = gw.Serve(gln) })
		out, err := NewOutbound(cfg("node-client-"+n.name), Deps{Store: n.store, Certs: n.certs, Metrics: n.mOut, Log: testLog(t)}, state.Selector{})
		require.NoError(t, err)
		sln, err := net.Listen("tcp", n.socks.String())
		require.NoError(t, err)
		wg.Go(func() { _ = out.ServeSOCKS5(sln) })
		closers = append(closers, out.Close, gw.Close)
		require.EventuallyWithT(t, func(c *assert.CollectT) { require.True(c, in.Ready()) }, 5*time.Second, 10*time.Millisecond)
	}
	t.Cleanup(func() {
		cancel()
		for _, c := range closers {
			require.NoError(t, c())
		}
		wg.Wait()
	})
}

// echoFrom opens a connection from from's client pod to to's service and
// returns the SOCKS reply code, and on success checks an echo round trip.
func echoFrom(t *testing.T, from, to *fedNet) byte {
	c, code := socksDial(t, from.socks, from.client, to.hostname(), svcPort)
	defer c.Close()
	if code == 0 {
		msg := "hello from " + from.name + " to " + to.name
		got, err := echoOnce(c, msg)
		require.NoError(t, err)
		require.Equal(t, msg, got)
	}
	return code
}

// TestTrustDomainFederation is issue 20's acceptance for trust domains:
// network-1 (cluster.local) and network-2 (its own trust domain and root)
// trust each other through a bundle that maps each domain to its own root,
// and talk through each other's east-west gateway in both directions
// (outer HBONE to the gateway and inner end-to-end TLS, each side verifying
// the other against the roots of the peer's own domain). A third domain,
// which trusts both but which neither trusts, is refused by name at each
// verifier: the gateway (outer, server side), the destination (inner,
// server side) and the client (outer, client side).
func TestTrustDomainFederation(t *testing.T) {
	n1 := newFedNet(t, "network-1", "cluster.local")
	n2 := newFedNet(t, "network-2", "network-2.example")
	n3 := newFedNet(t, "network-3", "rogue.example")
	require.NoError(t, n1.ca.Federate(n2.ca))
	require.NoError(t, n2.ca.Federate(n1.ca))
	require.NoError(t, n3.ca.Federate(n1.ca, n2.ca)) // n3 trusts them; they do not trust n3
	require.Equal(t, []string{"cluster.local", "network-2.example"}, n1.certs.TrustBundle().Domains())
	federation(t, n1, n2, n3)

	t.Run("network-1 to network-2 through network-2's gateway", func(t *testing.T) {
		require.Equal(t, byte(0), echoFrom(t, n1, n2))
		require.Equal(t, 1.0, n2.mGW.OpenedCount(metrics.ReporterGateway))
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			require.Equal(c, 1.0, n2.mIn.OpenedCount(metrics.ReporterDestination))
		}, 5*time.Second, 10*time.Millisecond)
	})
	t.Run("network-2 to network-1 through network-1's gateway", func(t *testing.T) {
		require.Equal(t, byte(0), echoFrom(t, n2, n1))
		require.Equal(t, 1.0, n1.mGW.OpenedCount(metrics.ReporterGateway))
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			require.Equal(c, 1.0, n1.mIn.OpenedCount(metrics.ReporterDestination))
		}, 5*time.Second, 10*time.Millisecond)
	})

	t.Run("unfederated network-3 is refused by network-1's gateway", func(t *testing.T) {
		require.NotEqual(t, byte(0), echoFrom(t, n3, n1))
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			// At least once: the client may retry its gateway.
			require.GreaterOrEqual(c, n1.mGW.HandshakeErrorCount(metrics.ReporterGateway, hbone.ReasonWrongTrustDomain), 1.0)
		}, 5*time.Second, 10*time.Millisecond)
		require.Equal(t, 1.0, n1.mGW.OpenedCount(metrics.ReporterGateway), "nothing more went through")
	})
	t.Run("network-1 refuses network-3's gateway", func(t *testing.T) {
		require.NotEqual(t, byte(0), echoFrom(t, n1, n3))
		require.GreaterOrEqual(t, n1.mOut.RefusedCount(metrics.ReporterSource, ReasonPeerTrustDomain), 1.0)
		require.Zero(t, n3.mGW.OpenedCount(metrics.ReporterGateway))
	})
	t.Run("unfederated network-3 is refused end to end by network-2's destination", func(t *testing.T) {
		cert, err := n3.certs.Certificate(t.Context(), identity.Identity{TrustDomain: n3.td, Namespace: "default", ServiceAccount: "client"})
		require.NoError(t, err)
		cc, err := rawHBONE(t, netip.AddrPortFrom(n2.echo, 15008), cert)
		if err == nil {
			_, err = roundTrip(cc, http.MethodConnect, netip.AddrPortFrom(n2.echo, appPort).String(), nil)
		}
		require.Error(t, err)
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			require.Equal(c, 1.0, n2.mIn.HandshakeErrorCount(metrics.ReporterDestination, hbone.ReasonWrongTrustDomain))
		}, 5*time.Second, 10*time.Millisecond)
	})
}

// TestTrustDomainRootsAreNotPooled: a federated root vouches for its own
// domain only. Network-2's CA, which network-1 trusts for
// network-2.example, mints network-1 identities; network-1's gateway and
// destination (server side) and client (client side) refuse them as
// untrusted. With the roots pooled, each would have been accepted.
func TestTrustDomainRootsAreNotPooled(t *testing.T) {
	n1 := newFedNet(t, "network-1", "cluster.local")
	n2 := newFedNet(t, "network-2", "network-2.example")
	require.NoError(t, n1.ca.Federate(n2.ca))
	require.NoError(t, n2.ca.Federate(n1.ca))
	// n2's gateway answers with a forged certificate of n2's identity
	// signed by n1's CA (a root n1 trusts, but for cluster.local only).
	forgedGW := &forger{ca: n1.ca, bundle: n2.ca.TrustBundle()}
	n2.certs = identity.NewCache(forgedGW)
	federation(t, n1, n2)

	for _, dst := range []struct {
		name     string
		addr     netip.Addr
		m        *metrics.Metrics
		reporter string
	}{
		{"gateway", n1.gw, n1.mGW, metrics.ReporterGateway},
		{"destination", n1.echo, n1.mIn, metrics.ReporterDestination},
	} {
		t.Run("network-1's "+dst.name+" refuses a network-1 identity signed by network-2's root", func(t *testing.T) {
			forged, err := n2.ca.Sign(identity.Identity{TrustDomain: n1.td, Namespace: "default", ServiceAccount: "client"})
			require.NoError(t, err)
			_, err = n1.certs.TrustBundle().Verify(chainOf(t, forged), time.Now())
			require.ErrorIs(t, err, spiffe.ErrUntrusted)
			cc, err := rawHBONE(t, netip.AddrPortFrom(dst.addr, 15008), forged)
			if err == nil {
				_, err = roundTrip(cc, http.MethodConnect, netip.AddrPortFrom(n1.echo, appPort).String(), nil)
			}
			require.Error(t, err)
			require.EventuallyWithT(t, func(c *assert.CollectT) {
				require.Equal(c, 1.0, dst.m.HandshakeErrorCount(dst.reporter, hbone.ReasonUntrustedCert))
			}, 5*time.Second, 10*time.Millisecond)
		})
	}
	t.Run("network-1's client refuses network-2's gateway signed by network-1's root", func(t *testing.T) {
		require.NotEqual(t, byte(0), echoFrom(t, n1, n2))
		require.GreaterOrEqual(t, n1.mOut.RefusedCount(metrics.ReporterSource, ReasonPeerUntrusted), 1.0)
		require.Zero(t, n2.mGW.OpenedCount(metrics.ReporterGateway))
	})
}

func chainOf(t *testing.T, c *tls.Certificate) []*x509.Certificate {
	var out []*x509.Certificate
	for _, der := range c.Certificate {
		x, err := x509.ParseCertificate(der)
		require.NoError(t, err)
		out = append(out, x)
	}
	return out
}

// forger issues certificates for any identity from one CA's root, and
// trusts bundle: a CA that oversteps its trust domain.
type forger struct {
	ca     *testca.CA
	bundle *spiffe.TrustBundle
}

func (f *forger) Certificate(_ context.Context, id identity.Identity) (*tls.Certificate, error) {
	return f.ca.Sign(id)
}

func (f *forger) TrustBundle() *spiffe.TrustBundle { return f.bundle }
