package proxy

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/internal/sni"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/internal/testca"
	"github.com/isthmus-mesh/isthmus/ztunnel/internal/testnet"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

const (
	securePort, secureTarget = 19443, 19444
	secureHost               = "secure.default.svc.cluster.local"
	localHost                = "local.default.svc.cluster.local"
)

// mtlsApp is a destination workload's own mTLS server (as an Envoy sidecar
// or a gRPC server with xDS security would be): it presents the echo
// identity, requires a client certificate of the mesh, and echoes.
type mtlsApp struct {
	addr     netip.AddrPort
	mu       sync.Mutex
	peers    []identity.Identity
	rejected []error
}

func (a *mtlsApp) serve(t testing.TB, m *mesh, addr netip.AddrPort) {
	a.addr = addr
	cert, err := m.certs.Certificate(context.Background(), workloadID("echo"))
	require.NoError(t, err)
	cfg := &tls.Config{
		Certificates: []tls.Certificate{*cert}, MinVersion: tls.VersionTLS13, ClientAuth: tls.RequireAnyClientCert,
		VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
			id, err := verifyRaw(raw, identity.PeerPolicy{Bundle: m.certs.TrustBundle()})
			a.mu.Lock()
			defer a.mu.Unlock()
			if err != nil {
				a.rejected = append(a.rejected, err)
				return err
			}
			a.peers = append(a.peers, id)
			return nil
		},
	}
	testnet.Serve(t, addr.String(), func(c *net.TCPConn) {
		tc := tls.Server(c, cfg)
		_ = tc.SetDeadline(time.Now().Add(10 * time.Second))
		if tc.Handshake() != nil {
			return
		}
		_, _ = io.Copy(tc, tc)
		_ = tc.CloseWrite()
	})
}

func (a *mtlsApp) seen() ([]identity.Identity, []error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]identity.Identity(nil), a.peers...), append([]error(nil), a.rejected...)
}

func verifyRaw(raw [][]byte, p identity.PeerPolicy) (identity.Identity, error) {
	chain := make([]*x509.Certificate, 0, len(raw))
	for _, r := range raw {
		c, err := x509.ParseCertificate(r)
		if err != nil {
			return identity.Identity{}, err
		}
		chain = append(chain, c)
	}
	return identity.VerifyPeer(chain, p, time.Now())
}

// envoyDial does what an Envoy sidecar does for an endpoint behind a
// remote network's gateway: mutual TLS to gw with Istio's SNI, presenting
// cert and verifying the destination's identity; it echoes msg and
// returns the answer.
func envoyDial(gw netip.AddrPort, serverName string, cert *tls.Certificate, bundle identity.PeerPolicy, msg string) (string, error) {
	tc, err := envoyConn(gw, serverName, cert, bundle)
	if err != nil {
		return "", err
	}
	defer tc.Close()
	_ = tc.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := tc.Write([]byte(msg)); err != nil {
		return "", err
	}
	if err := tc.CloseWrite(); err != nil {
		return "", err
	}
	b, err := io.ReadAll(tc)
	if err != nil && !errors.Is(err, io.EOF) {
		return string(b), err
	}
	return string(b), nil
}

// envoyConn opens and handshakes envoyDial's connection.
func envoyConn(gw netip.AddrPort, serverName string, cert *tls.Certificate, bundle identity.PeerPolicy) (*tls.Conn, error) {
	d := net.Dialer{Timeout: 5 * time.Second}
	c, err := d.Dial("tcp", gw.String())
	if err != nil {
		return nil, err
	}
	tc := tls.Client(c, &tls.Config{
		ServerName: serverName, Certificates: []tls.Certificate{*cert}, MinVersion: tls.VersionTLS13,
		InsecureSkipVerify: true, // verified below, by SPIFFE identity (as Envoy's SAN match)
		VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
			_, err := verifyRaw(raw, bundle)
			return err
		},
	})
	_ = tc.SetDeadline(time.Now().Add(10 * time.Second))
	if err := tc.Handshake(); err != nil {
		c.Close()
		return nil, err
	}
	_ = tc.SetDeadline(time.Time{})
	return tc, nil
}

// tlsMesh is the two-network mesh with the gateway serving SNI
// passthrough on gw:15443 and, on node C, workload d1 serving
// secure.default (global) and local.default (cluster-local) with its own
// mTLS app.
func tlsMesh(t testing.TB) (*mesh, netip.AddrPort, *mtlsApp) {
	m := newMesh(t, nil)
	d1 := nextAddr()
	m.n2.Update(func(tx *state.Tx) {
		tx.UpsertService(&state.Service{Name: "secure", Namespace: "default", Hostname: secureHost, Ports: []uint16{securePort}})
		tx.UpsertService(&state.Service{Name: "local", Namespace: "default", Hostname: localHost, Ports: []uint16{securePort}, ClusterLocal: true})
		w := pod("d1", d1, "node-c", "n2", "c2", "echo")
		w.Services = map[string]state.PortMap{"default/" + secureHost: {securePort: secureTarget}, "default/" + localHost: {securePort: secureTarget}}
		tx.UpsertWorkload(w)
	})
	app := &mtlsApp{}
	app.serve(t, m, netip.AddrPortFrom(d1, secureTarget))
	gwTLS := netip.AddrPortFrom(m.gwAddr, 15443)
	ln, err := net.Listen("tcp", gwTLS.String())
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- m.gw.ServeTLS(ln) }()
	t.Cleanup(func() {
		ln.Close()
		require.NoError(t, <-done)
	})
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		hc, err := net.Dial("tcp", netip.AddrPortFrom(d1, 15008).String())
		require.NoError(c, err)
		hc.Close()
	}, 5*time.Second, 10*time.Millisecond, "node C's inbound serves d1")
	return m, gwTLS, app
}

// TestGatewaySNIPassthrough: a client speaking what Envoy speaks (mTLS with
// Istio's SNI to the gateway's 15443) from network n1 reaches a service
// that exists only in network n2; its TLS ends at the destination
// workload, which sees the client's own identity (the gateway never
// terminates it). A wrong SNI, an unknown service, an undeclared port and
// a cluster-local service are refused by the gateway with their reasons;
// a foreign certificate is refused by the destination, end to end.
func TestGatewaySNIPassthrough(t *testing.T) {
	m, gw, app := tlsMesh(t)
	ctx := context.Background()
	clientCert, err := m.certs.Certificate(ctx, workloadID("client"))
	require.NoError(t, err)
	want := identity.PeerPolicy{Bundle: m.certs.TrustBundle(), Allowed: []identity.Identity{workloadID("echo")}}

	got, err := envoyDial(gw, sni.Outbound(secureHost, securePort), clientCert, want, "hello secure")
	require.NoError(t, err)
	require.Equal(t, "hello secure", got)
	peers, _ := app.seen()
	require.Equal(t, []identity.Identity{workloadID("client")}, peers, "the destination terminates the client's own mTLS")
	require.Equal(t, 1.0, m.mGW.OpenedCount(metrics.ReporterGateway))
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.Equal(c, 1.0, m.mGW.ClosedCount(metrics.ReporterGateway))
	}, 5*time.Second, 10*time.Millisecond)

	for _, tc := range []struct {
		name, serverName, reason string
	}{
		{"wrong SNI", "echo.default.svc.cluster.local", ReasonBadSNI},
		{"subset SNI", "outbound_.19443_.v1_." + secureHost, ReasonBadSNI},
		{"unknown service", sni.Outbound("nope.default.svc.cluster.local", securePort), ReasonUnknownService},
		{"undeclared port", sni.Outbound(secureHost, secureTarget), ReasonUnknownPort},
		{"cluster-local service", sni.Outbound(localHost, securePort), ReasonNotVisible},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := m.mGW.RefusedCount(metrics.ReporterGateway, tc.reason)
			_, err := envoyDial(gw, tc.serverName, clientCert, want, "x")
			require.Error(t, err)
			require.Equal(t, before+1, m.mGW.RefusedCount(metrics.ReporterGateway, tc.reason))
		})
	}

	t.Run("foreign certificate", func(t *testing.T) {
		foreign, err := testca.New(trustDomain) // same trust domain, another root
		require.NoError(t, err)
		fc, err := foreign.Certificate(ctx, workloadID("client"))
		require.NoError(t, err)
		_, err = envoyDial(gw, sni.Outbound(secureHost, securePort), fc, want, "x")
		require.Error(t, err)
		_, rejected := app.seen()
		require.Len(t, rejected, 1)
		require.ErrorIs(t, rejected[0], identity.ErrUntrustedPeer)
	})

	t.Run("not a TLS client", func(t *testing.T) {
		before := m.mGW.RefusedCount(metrics.ReporterGateway, ReasonBadClientHello)
		c, err := net.Dial("tcp", gw.String())
		require.NoError(t, err)
		defer c.Close()
		_, err = c.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
		require.NoError(t, err)
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		n, err := c.Read(make([]byte, 64))
		require.Zero(t, n, "nothing is answered")
		require.ErrorIs(t, err, io.EOF)
		require.Equal(t, before+1, m.mGW.RefusedCount(metrics.ReporterGateway, ReasonBadClientHello))
	})
}

// BenchmarkGatewaySNIPassthrough measures single-stream echo throughput of
// a client speaking what Envoy speaks (mTLS with Istio's SNI) through the
// gateway's 15443 to the destination workload's own mTLS server (gateway:
// SNI peek, HBONE to the destination ztunnel, plaintext to the app), and,
// in the same run, of the same client straight to that server.
func BenchmarkGatewaySNIPassthrough(b *testing.B) {
	m, gw, app := tlsMesh(b)
	cert, err := m.certs.Certificate(context.Background(), workloadID("client"))
	require.NoError(b, err)
	want := identity.PeerPolicy{Bundle: m.certs.TrustBundle(), Allowed: []identity.Identity{workloadID("echo")}}
	name := sni.Outbound(secureHost, securePort)
	chunk, back := make([]byte, 64<<10), make([]byte, 64<<10)
	const roundBytes = 16 << 20
	round := func(addr netip.AddrPort) time.Duration {
		c, err := envoyConn(addr, name, cert, want)
		require.NoError(b, err)
		defer c.Close()
		start := time.Now()
		for sent := 0; sent < roundBytes; sent += len(chunk) {
			if _, err := c.Write(chunk); err != nil {
				b.Fatal(err)
			}
			if _, err := io.ReadFull(c, back); err != nil {
				b.Fatal(err)
			}
		}
		return time.Since(start)
	}
	round(gw) // warm up
	b.SetBytes(roundBytes)
	var path, direct time.Duration
	for b.Loop() {
		path += round(gw)
		b.StopTimer()
		direct += round(app.addr)
		b.StartTimer()
	}
	mb := float64(b.N) * roundBytes / 1e6
	b.ReportMetric(mb/path.Seconds(), "MB/s_path")
	b.ReportMetric(mb/direct.Seconds(), "MB/s_direct")
	b.ReportMetric(direct.Seconds()/path.Seconds(), "x_direct")
}
