package node_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"

	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
	"github.com/isthmus-mesh/isthmus/ztunnel/caclient"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/internal/catest"
	"github.com/isthmus-mesh/isthmus/ztunnel/node"
)

// TestGatewayMode proves a ztunnel in gateway mode connects to xDS over
// mTLS (pilot verified against the mesh root, the ztunnel presenting its
// own CA-issued certificate), becomes ready without any local workload,
// and serves HBONE on its gateway address with its own identity (the
// ztunnel ServiceAccount, never impersonated) from a certificate the CA
// issued. Asked to, it also serves SNI passthrough on the same host's
// 15443, with the production timeouts: a ClientHello naming echo (which
// has no endpoint on the gateway's network) is read and refused for that
// reason.
func TestGatewayMode(t *testing.T) {
	pilotAddr := nextAddr() // the CA's serving certificate names this IP
	ca := catest.Start(t, catest.Options{ConfigCluster: "c2", Listen: netip.AddrPortFrom(pilotAddr, 0).String()})
	ca.AddNode(t, "token-gw", "c2", "node-gw")
	xc := cache.NewLinearCache(workloadv1.TypeURL, cache.WithInitialResources(map[string]types.Resource{
		echoKey: service("echo", netip.MustParseAddr("10.96.0.10")),
	}))
	var (
		mu      sync.Mutex
		xdsPeer []identity.Identity
	)
	cb := serverv3.CallbackFuncs{DeltaStreamOpenFunc: func(ctx context.Context, _ int64, _ string) error {
		p, ok := peer.FromContext(ctx)
		if !ok {
			return errors.New("no peer")
		}
		info, ok := p.AuthInfo.(credentials.TLSInfo)
		if !ok || len(info.State.PeerCertificates) == 0 {
			return errors.New("xDS client presented no certificate")
		}
		id, err := identity.FromCertificate(info.State.PeerCertificates[0])
		mu.Lock()
		xdsPeer = append(xdsPeer, id)
		mu.Unlock()
		return err
	}}
	xdsAddr := startXDS(t, xc, pilotAddr, cb, grpc.Creds(credentials.NewTLS(ca.CA.ServerTLSConfig())))
	host := nextAddr()
	at := func(port uint16) string { return netip.AddrPortFrom(host, port).String() }
	n, err := node.New(node.Config{
		NodeName: "node-gw", ClusterID: "c2", Network: "n2", Mode: node.ModeGateway,
		XDSAddress: xdsAddr, CAAddress: ca.Addr, GatewayListen: at(15008), GatewayTLSListen: at(15443),
		AdminListen: node.Disabled, MetricsListen: at(15020), ReadinessListen: at(15021),
	}, node.Deps{
		Token: caclient.StaticToken("token-gw"), RootsPEM: ca.RootsPEM,
		Log: slog.New(slog.NewTextHandler(t.Output(), nil)),
	})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- n.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		code, _ := httpGet(c, "http://"+at(15021)+"/healthz/ready")
		require.Equal(c, http.StatusOK, code)
	}, 15*time.Second, 20*time.Millisecond)

	// SNI passthrough: the ClientHello is read (not timed out at once) and
	// refused because echo has no endpoint on n2; nothing is answered.
	sni, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", at(15443), &tls.Config{
		ServerName: "outbound_.80_._." + echoHost, MinVersion: tls.VersionTLS13, InsecureSkipVerify: true, //nolint:gosec // refused before any certificate
	})
	if err == nil {
		sni.Close()
	}
	require.Error(t, err)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		_, body := httpGet(c, "http://"+at(15020)+"/metrics")
		require.Contains(c, body, `isthmus_hbone_refused_total{reason="no_local_endpoint",reporter="gateway"} 1`)
	}, 5*time.Second, 20*time.Millisecond)

	roots, err := caclient.RootsFromPEM(ca.RootsPEM)
	require.NoError(t, err)
	var peer identity.Identity
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", at(15008), &tls.Config{
		MinVersion: tls.VersionTLS13, NextProtos: []string{"h2"},
		InsecureSkipVerify: true, //nolint:gosec // verified below against the CA roots
		VerifyConnection: func(cs tls.ConnectionState) error {
			inter := x509.NewCertPool()
			for _, c := range cs.PeerCertificates[1:] {
				inter.AddCert(c)
			}
			if _, err := cs.PeerCertificates[0].Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
				return err
			}
			peer, err = identity.FromCertificate(cs.PeerCertificates[0])
			return err
		},
	})
	require.NoError(t, err)
	conn.Close()
	require.Equal(t, n.Identity(), peer)
	require.Equal(t, "spiffe://cluster.local/ns/isthmus-system/sa/ztunnel", peer.String())
	for _, r := range ca.Requests() {
		require.Empty(t, r.Impersonated)
	}
	mu.Lock()
	defer mu.Unlock()
	require.NotEmpty(t, xdsPeer)
	require.Equal(t, n.Identity(), xdsPeer[0], "xDS client certificate")
}

// TestGatewayDrain: a gateway stopped as SIGTERM stops it is not ready at
// once, keeps accepting for its HandoffWait (clients reaching it while the
// Service's endpoints move are served, and sent a GOAWAY), then stops
// accepting; with no tunnel open it returns without waiting DrainGrace.
func TestGatewayDrain(t *testing.T) {
	pilotAddr := nextAddr()
	ca := catest.Start(t, catest.Options{ConfigCluster: "c2", Listen: netip.AddrPortFrom(pilotAddr, 0).String()})
	ca.AddNode(t, "token-gw", "c2", "node-gw")
	xc := cache.NewLinearCache(workloadv1.TypeURL, cache.WithInitialResources(map[string]types.Resource{
		echoKey: service("echo", netip.MustParseAddr("10.96.0.10")),
	}))
	xdsAddr := startXDS(t, xc, pilotAddr, nil, grpc.Creds(credentials.NewTLS(ca.CA.ServerTLSConfig())))
	host := nextAddr()
	at := func(port uint16) string { return netip.AddrPortFrom(host, port).String() }
	const wait, grace = 2 * time.Second, time.Hour
	n, err := node.New(node.Config{
		NodeName: "node-gw", ClusterID: "c2", Network: "n2", Mode: node.ModeGateway,
		XDSAddress: xdsAddr, CAAddress: ca.Addr, GatewayListen: at(15008),
		AdminListen: node.Disabled, MetricsListen: node.Disabled, ReadinessListen: at(15021),
		HandoffWait: wait, DrainGrace: grace,
	}, node.Deps{Token: caclient.StaticToken("token-gw"), RootsPEM: ca.RootsPEM, Log: slog.New(slog.NewTextHandler(t.Output(), nil))})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- n.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		code, _ := httpGet(c, "http://"+at(15021)+"/healthz/ready")
		require.Equal(c, http.StatusOK, code)
	}, 15*time.Second, 20*time.Millisecond)

	cancel()
	require.Eventually(t, func() bool { return !n.Ready() }, 5*time.Second, 10*time.Millisecond, "not ready once stopping")
	for range 2 { // at once, and half-way through the wait
		conn, err := net.DialTimeout("tcp", at(15008), time.Second)
		require.NoError(t, err, "still accepting within the handoff wait")
		conn.Close()
		time.Sleep(wait / 2)
	}
	select {
	case err := <-done:
		require.NoError(t, err)
		done <- nil // for the cleanup
	case <-time.After(time.Minute):
		t.Fatal("the gateway did not stop after its handoff wait with no tunnel open")
	}
	_, err = net.DialTimeout("tcp", at(15008), time.Second)
	require.Error(t, err, "not accepting once stopped")
}

// TestLifecycle proves Close is idempotent and safe before Run (Run then
// returns at once), that a second Run is refused, and that a listener that
// cannot be bound fails Run with an error naming it.
func TestLifecycle(t *testing.T) {
	ca := catest.Start(t, catest.Options{Listen: netip.AddrPortFrom(nextAddr(), 0).String()})
	cfg := node.Config{
		NodeName: "n", ClusterID: "c1", XDSAddress: "127.0.0.1:1", CAAddress: ca.Addr,
		OutboundListen: node.Disabled, SOCKS5Listen: node.Disabled, AdminListen: node.Disabled,
		ReadinessListen: node.Disabled, MetricsListen: node.Disabled,
	}
	deps := node.Deps{Token: caclient.StaticToken("t"), RootsPEM: ca.RootsPEM}

	n, err := node.New(cfg, deps)
	require.NoError(t, err)
	require.NoError(t, n.Close())
	require.NoError(t, n.Close())
	require.NoError(t, n.Run(context.Background()))

	busy, err := net.Listen("tcp", netip.AddrPortFrom(nextAddr(), 0).String())
	require.NoError(t, err)
	defer busy.Close()
	cfg.AdminListen = busy.Addr().String()
	n, err = node.New(cfg, deps)
	require.NoError(t, err)
	require.ErrorContains(t, n.Run(context.Background()), "listen admin on "+busy.Addr().String())
	require.ErrorContains(t, n.Run(context.Background()), "Run called twice")
	require.NoError(t, n.Close())

	_, err = node.New(node.Config{NodeName: "n", ClusterID: "c1", XDSAddress: "x:1", CAAddress: "x:1"}, node.Deps{Token: deps.Token, RootsPEM: []byte("junk")})
	require.ErrorContains(t, err, "no CERTIFICATE")
}
