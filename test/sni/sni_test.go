package sni_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	xdscreds "google.golang.org/grpc/credentials/xds"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/peer"
	grpcxds "google.golang.org/grpc/xds"

	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/pilot/xds"
	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/test/meshtest"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/node"
)

// The child process's inputs.
const (
	envBootstrap = "SNI_TEST_GRPC_BOOTSTRAP"
	envTarget    = "SNI_TEST_GRPC_TARGET"
	envWait      = "SNI_TEST_GRPC_WAIT"
)

// grpcClientMain is the child process: a grpc-go xDS client with xDS
// credentials (its certificate and roots from the bootstrap's file_watcher
// provider "default") calls target until a call succeeds (exit 0) or wait
// passes (exit 1), printing each failure.
func grpcClientMain(bootstrapFile, target string, wait time.Duration) int {
	b, err := os.ReadFile(bootstrapFile)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bootstrap:", err)
		return 2
	}
	rb, err := grpcxds.NewXDSResolverWithConfigForTesting(b)
	if err != nil {
		fmt.Fprintln(os.Stderr, "resolver:", err)
		return 2
	}
	creds, err := xdscreds.NewClientCredentials(xdscreds.ClientOptions{FallbackCreds: insecure.NewCredentials()})
	if err != nil {
		fmt.Fprintln(os.Stderr, "credentials:", err)
		return 2
	}
	cc, err := grpc.NewClient(target, grpc.WithResolvers(rb), grpc.WithTransportCredentials(creds))
	if err != nil {
		fmt.Fprintln(os.Stderr, "client:", err)
		return 2
	}
	defer cc.Close()
	until := time.Now().Add(wait)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
		cancel()
		if err == nil {
			fmt.Println("call ok")
			return 0
		}
		fmt.Fprintln(os.Stderr, "call:", err)
		if time.Now().After(until) {
			return 1
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// writePEM writes cert's chain, its key and the roots as the files of a
// file_watcher certificate provider.
func writePEM(t *testing.T, dir string, cert *tls.Certificate, roots []byte) (certFile, keyFile, caFile string) {
	t.Helper()
	var chain []byte
	for _, der := range cert.Certificate {
		chain = append(chain, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})...)
	}
	key, err := x509.MarshalPKCS8PrivateKey(cert.PrivateKey)
	require.NoError(t, err)
	certFile, keyFile, caFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem"), filepath.Join(dir, "roots.pem")
	require.NoError(t, os.WriteFile(certFile, chain, 0o600))
	require.NoError(t, os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: key}), 0o600))
	require.NoError(t, os.WriteFile(caFile, roots, 0o600))
	return certFile, keyFile, caFile
}

// mtlsGreeter runs a real gRPC server (health) on addr with mutual TLS:
// cert, client certificates required and verified against the mesh roots;
// it records the identities of its clients.
type mtlsGreeter struct {
	mu    sync.Mutex
	peers []identity.Identity
}

func (g *mtlsGreeter) serve(t *testing.T, addr netip.AddrPort, cert *tls.Certificate, roots *x509.CertPool) {
	lis, err := net.Listen("tcp", addr.String())
	require.NoError(t, err)
	record := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		if p, ok := peer.FromContext(ctx); ok {
			if ti, ok := p.AuthInfo.(credentials.TLSInfo); ok && len(ti.State.PeerCertificates) > 0 {
				if id, err := identity.FromCertificate(ti.State.PeerCertificates[0]); err == nil {
					g.mu.Lock()
					g.peers = append(g.peers, id)
					g.mu.Unlock()
				}
			}
		}
		return h(ctx, req)
	}
	gs := grpc.NewServer(grpc.Creds(credentials.NewTLS(&tls.Config{
		Certificates: []tls.Certificate{*cert}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: roots, MinVersion: tls.VersionTLS12,
	})), grpc.UnaryInterceptor(record))
	healthpb.RegisterHealthServer(gs, health.NewServer())
	done := make(chan struct{})
	go func() { defer close(done); _ = gs.Serve(lis) }()
	t.Cleanup(func() { gs.Stop(); <-done })
}

func (g *mtlsGreeter) seen() []identity.Identity {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]identity.Identity(nil), g.peers...)
}

// TestGRPCThroughGatewaySNI: a real grpc-go xDS client on network 1, with
// xDS security (file_watcher certificates issued by pilot's CA) and gRFC
// A101's SNI from xDS (GRPC_EXPERIMENTAL_XDS_SNI=true), declaring both to
// pilot (ISTHMUS_PROXYLESS_TLS), calls a gRPC service that exists only in
// cluster-2 on network 2: pilot sends it network 2's gateway at 15443 and
// Istio's SNI; the real gateway ztunnel routes the unterminated TLS by
// that SNI to the real destination ztunnel over HBONE; the destination
// server terminates the client's mTLS and sees the client's own identity.
func TestGRPCThroughGatewaySNI(t *testing.T) {
	ctx := context.Background()
	c1, c2 := clusters.Cluster("cluster-1"), clusters.Cluster("cluster-2")
	for _, c := range []*framework.Cluster{c1, c2} {
		require.NoError(t, c.InstallCRDs("../../manifests/base/crds"))
		require.NoError(t, c.EnsureNamespace(ctx, meshtest.Namespace, nil))
		require.NoError(t, c.EnsureNamespace(ctx, "greet", nil))
	}
	a := meshtest.NewAddrs()
	pilotIP, node1, node2, gw2 := a.Next(), a.Next(), a.Next(), a.Next()
	callerIP, greeter := a.Next(), netip.AddrPortFrom(a.Next(), 7070)

	p := meshtest.RunPilot(t, c1, pilotIP, func(c *server.Config) { c.XDSPlaintextAddr = netip.AddrPortFrom(pilotIP, 0).String() })
	require.Eventually(t, func() bool { return p.XDSPlaintextAddr() != "" }, 30*time.Second, 10*time.Millisecond)
	meshtest.RegisterRemote(t, c1, c2, "cluster-2", "network-2", nil)
	meshtest.GatewayService(t, c2, "network-2", gw2)
	_, err := c2.CreateService(ctx, "greet", "greeter", map[string]string{"app": "greeter"}, framework.ServicePort{Name: "grpc", Port: 7070, TargetPort: 7070})
	require.NoError(t, err)
	_, err = c2.CreatePod(ctx, framework.PodOptions{Namespace: "greet", Name: "greeter-0", Labels: map[string]string{"app": "greeter"},
		ServiceAccount: "greeter", Node: "node-2a", IP: greeter.Addr(), Ready: true})
	require.NoError(t, err)
	_, err = c1.CreatePod(ctx, framework.PodOptions{Namespace: "greet", Name: "caller-0", Labels: map[string]string{"app": "caller"},
		ServiceAccount: "caller", Node: "node-1a", IP: callerIP, Ready: true})
	require.NoError(t, err)

	tok1 := meshtest.ProxyPod(t, c1, "ztunnel-node-1a", "node-1a", "ztunnel", node1)
	tok2 := meshtest.ProxyPod(t, c2, "ztunnel-node-2a", "node-2a", "ztunnel", node2)
	tokGW := meshtest.ProxyPod(t, c2, "eastwest-gateway-0", "gw-node-2", "eastwest-gateway", gw2)
	z1 := meshtest.RunZtunnel(t, p, pilotIP, meshtest.ZtunnelOptions{Mode: node.ModeNode, Cluster: "cluster-1", Network: "network-1",
		Node: "node-1a", ServiceAccount: "ztunnel", Token: tok1, IP: node1})
	z2 := meshtest.RunZtunnel(t, p, pilotIP, meshtest.ZtunnelOptions{Mode: node.ModeNode, Cluster: "cluster-2", Network: "network-2",
		Node: "node-2a", ServiceAccount: "ztunnel", Token: tok2, IP: node2})
	gw := meshtest.RunZtunnel(t, p, pilotIP, meshtest.ZtunnelOptions{Mode: node.ModeGateway, Cluster: "cluster-2", Network: "network-2",
		Node: "gw-node-2", ServiceAccount: "eastwest-gateway", Token: tokGW, IP: gw2, TLSPassthrough: true})

	// The workloads' certificates, issued by pilot's CA to their nodes'
	// ztunnels (as an agent would write them for a proxyless client).
	callerID := identity.Identity{TrustDomain: "cluster.local", Namespace: "greet", ServiceAccount: "caller"}
	greeterID := identity.Identity{TrustDomain: "cluster.local", Namespace: "greet", ServiceAccount: "greeter"}
	var callerCert, greeterCert *tls.Certificate
	require.Eventually(t, func() bool {
		callerCert, err = z1.Node.Certs().Certificate(ctx, callerID)
		return err == nil
	}, 30*time.Second, 50*time.Millisecond, "caller certificate: %v", err)
	require.Eventually(t, func() bool {
		greeterCert, err = z2.Node.Certs().Certificate(ctx, greeterID)
		return err == nil
	}, 30*time.Second, 50*time.Millisecond, "greeter certificate: %v", err)
	srv := &mtlsGreeter{}
	srv.serve(t, greeter, greeterCert, p.CA.RootPool())

	dir := t.TempDir()
	certFile, keyFile, caFile := writePEM(t, dir, callerCert, p.CA.Roots())
	bootstrap := filepath.Join(dir, "bootstrap.json")
	require.NoError(t, os.WriteFile(bootstrap, fmt.Appendf(nil, `{
		"xds_servers": [{"server_uri": %q, "channel_creds": [{"type": "insecure"}], "server_features": ["xds_v3"]}],
		"node": {"id": "proxyless~caller-0.greet", "metadata": {"NETWORK": "network-1", "CLUSTER_ID": "cluster-1", "GENERATOR": "grpc", %q: "true"}},
		"certificate_providers": {"default": {"plugin_name": "file_watcher", "config": {
			"certificate_file": %q, "private_key_file": %q, "ca_certificate_file": %q, "refresh_interval": "600s"}}}
	}`, p.XDSPlaintextAddr(), xds.MetadataProxylessTLS, certFile, keyFile, caFile), 0o600))

	client := func(sni bool, wait time.Duration) (string, error) {
		cctx, cancel := context.WithTimeout(ctx, 90*time.Second)
		defer cancel()
		cmd := exec.CommandContext(cctx, os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), envBootstrap+"="+bootstrap, envTarget+"=xds:///greeter.greet.svc.cluster.local:7070", envWait+"="+wait.String())
		if sni {
			cmd.Env = append(cmd.Env, "GRPC_EXPERIMENTAL_XDS_SNI=true")
		}
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	before := meshtest.Counter(t, gw.Metrics, "isthmus_hbone_refused_total", map[string]string{"reason": "bad_sni"})
	out, err := client(true, 45*time.Second)
	require.NoError(t, err, "grpc client through the gateway:\n%s", out)
	require.Contains(t, out, "call ok")
	require.Contains(t, srv.seen(), callerID, "the destination terminates the client's own mTLS")
	require.Positive(t, meshtest.Counter(t, gw.Metrics, "isthmus_tcp_connections_opened_total", map[string]string{"reporter": metrics.ReporterGateway}))
	require.Equal(t, before, meshtest.Counter(t, gw.Metrics, "isthmus_hbone_refused_total", map[string]string{"reason": "bad_sni"}))

	// Without A101's switch grpc-go sends no SNI from xDS: the gateway
	// cannot route the connection and refuses it.
	out, err = client(false, 3*time.Second)
	require.Error(t, err, "without the SNI no call may pass:\n%s", out)
	require.NotContains(t, out, "call ok")
	require.Greater(t, meshtest.Counter(t, gw.Metrics, "isthmus_hbone_refused_total", map[string]string{"reason": "bad_sni"}), before)
}
