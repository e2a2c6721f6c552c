package node_test

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/isthmus-mesh/isthmus/ztunnel/internal/testnet"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
	"github.com/isthmus-mesh/isthmus/ztunnel/admin"
	"github.com/isthmus-mesh/isthmus/ztunnel/caclient"
	"github.com/isthmus-mesh/isthmus/ztunnel/internal/catest"
	"github.com/isthmus-mesh/isthmus/ztunnel/node"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("k8s.io/klog/v2.(*flushDaemon).run.func1"))
}

const (
	td       = "cluster.local"
	appPort  = 18081
	svcPort  = 80
	echoHost = "echo.default.svc.cluster.local"
	echoKey  = "default/" + echoHost
	localKey = "default/local.default.svc.cluster.local"
)

// nextAddr hands out a distinct loopback address (see testnet).
var nextAddr = testnet.NextAddr

func pod(uid, sa, nodeName, cluster string, ip netip.Addr, services map[string]*workloadv1.PortList) *workloadv1.Address {
	return &workloadv1.Address{Type: &workloadv1.Address_Workload{Workload: &workloadv1.Workload{
		Uid: uid, Name: uid, Namespace: "default", Addresses: [][]byte{ip.AsSlice()},
		Network: "n1", ClusterId: cluster, Node: nodeName, TrustDomain: td, ServiceAccount: sa,
		TunnelProtocol: workloadv1.TunnelProtocol_HBONE, Services: services,
	}}}
}

func service(name string, vip netip.Addr) *workloadv1.Address {
	return &workloadv1.Address{Type: &workloadv1.Address_Service{Service: &workloadv1.Service{
		Name: name, Namespace: "default", Hostname: name + ".default.svc.cluster.local",
		Addresses: []*workloadv1.NetworkAddress{{Network: "n1", Address: vip.AsSlice()}},
		Ports:     []*workloadv1.ServicePort{{ServicePort: svcPort}},
	}}}
}

func backs(key string) map[string]*workloadv1.PortList {
	return map[string]*workloadv1.PortList{key: {Ports: []*workloadv1.Port{{ServicePort: svcPort, TargetPort: appPort}}}}
}

// startXDS serves c over delta ADS on addr (plaintext unless opts set
// credentials); cb, if set, sees every stream.
func startXDS(t *testing.T, c *cache.LinearCache, addr netip.Addr, cb serverv3.Callbacks, opts ...grpc.ServerOption) string {
	lis, err := net.Listen("tcp", netip.AddrPortFrom(addr, 0).String())
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	srv := grpc.NewServer(opts...)
	discovery.RegisterAggregatedDiscoveryServiceServer(srv, serverv3.NewServer(ctx, c, cb))
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	t.Cleanup(func() {
		cancel()
		srv.Stop()
		<-done
	})
	return lis.Addr().String()
}

// startEcho serves an echo app on addr:appPort.
func startEcho(t *testing.T, addr netip.Addr) {
	testnet.Serve(t, netip.AddrPortFrom(addr, appPort).String(), testnet.Echo)
}

// ztunnel is one running node with its listen addresses; stop ends its
// Run as SIGTERM does and returns Run's error.
type ztunnel struct {
	n                                  *node.Node
	socks, admin, readyURL, metricsURL string
	stop                               func() error
	// log holds what the node logged (also written to the test's output).
	log *syncBuffer
}

// syncBuffer is a bytes.Buffer safe for concurrent use.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func startNode(t *testing.T, name, cluster, token, xdsAddr string, ca *catest.Server, opts ...func(*node.Config)) *ztunnel {
	t.Helper()
	host := nextAddr()
	at := func(port uint16) string { return netip.AddrPortFrom(host, port).String() }
	z := &ztunnel{
		log:   &syncBuffer{},
		socks: at(15080), admin: at(15000),
		readyURL: "http://" + at(15021) + "/healthz/ready", metricsURL: "http://" + at(15020) + "/metrics",
	}
	cfg := node.Config{
		NodeName: name, ClusterID: cluster, Network: "n1", TrustDomain: td,
		XDSAddress: xdsAddr, CAAddress: ca.Addr, NoAuthorization: true, // the test's xDS server serves workloads only
		OutboundListen: at(15001), SOCKS5Listen: z.socks, AdminListen: z.admin,
		ReadinessListen: at(15021), MetricsListen: at(15020),
	}
	for _, o := range opts {
		o(&cfg)
	}
	n, err := node.New(cfg, node.Deps{
		Token: caclient.StaticToken(token), RootsPEM: ca.RootsPEM, XDSCredentials: insecure.NewCredentials(),
		Log: slog.New(slog.NewTextHandler(io.MultiWriter(t.Output(), z.log), &slog.HandlerOptions{Level: slog.LevelDebug})).With("test_node", name),
	})
	require.NoError(t, err)
	z.n = n
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- n.Run(ctx) }()
	var once sync.Once
	var runErr error
	z.stop = func() error {
		once.Do(func() {
			cancel()
			runErr = <-done
		})
		return runErr
	}
	t.Cleanup(func() {
		require.NoError(t, z.stop())
		require.NoError(t, n.Close())
	})
	return z
}

// socksEcho connects from src through socks to host:port, sends msg,
// half-closes and returns the reply code and what came back.
func socksEcho(t *testing.T, socks string, src netip.Addr, host string, port uint16, msg string) (byte, string) {
	t.Helper()
	tc, code, err := socksConnect(socks, src, host, port)
	require.NoError(t, err)
	defer tc.Close()
	if code != 0 {
		return code, ""
	}
	_, err = tc.Write([]byte(msg))
	require.NoError(t, err)
	require.NoError(t, tc.CloseWrite())
	got, err := io.ReadAll(tc)
	require.NoError(t, err)
	return 0, string(got)
}

// socksConnect opens a SOCKS5 CONNECT from src through socks to host:port
// and returns the connection and the reply code.
func socksConnect(socks string, src netip.Addr, host string, port uint16) (*net.TCPConn, byte, error) {
	d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(src, 0)), Timeout: 5 * time.Second}
	c, err := d.Dial("tcp", socks)
	if err != nil {
		return nil, 0, err
	}
	tc := c.(*net.TCPConn)
	fail := func(err error) (*net.TCPConn, byte, error) {
		tc.Close()
		return nil, 0, err
	}
	if err := tc.SetDeadline(time.Now().Add(10 * time.Second)); err != nil {
		return fail(err)
	}
	if _, err := tc.Write([]byte{5, 1, 0}); err != nil {
		return fail(err)
	}
	var sel [2]byte
	if _, err := io.ReadFull(tc, sel[:]); err != nil {
		return fail(err)
	}
	if sel != [2]byte{5, 0} {
		return fail(fmt.Errorf("socks method selection %v", sel))
	}
	req := []byte{5, 1, 0}
	if a, err := netip.ParseAddr(host); err == nil {
		b := a.As4()
		req = append(append(req, 1), b[:]...)
	} else {
		req = append(append(req, 3, byte(len(host))), host...)
	}
	req = binary.BigEndian.AppendUint16(req, port)
	if _, err := tc.Write(req); err != nil {
		return fail(err)
	}
	var reply [10]byte
	if _, err := io.ReadFull(tc, reply[:]); err != nil {
		return fail(err)
	}
	if err := tc.SetDeadline(time.Time{}); err != nil {
		return fail(err)
	}
	return tc, reply[1], nil
}

var httpClient = &http.Client{Timeout: 5 * time.Second}

func httpGet(t require.TestingT, url string) (int, string) {
	resp, err := httpClient.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}

// TestTwoNodesEndToEnd runs pilot's pieces in-process (a go-control-plane
// delta server with Address resources, the real pilot/ca CSR server) and
// two ztunnels, node-a in cluster c1 and node-b in cluster c2 on the same
// network. It proves: both become ready; a client pod on node-a reaches,
// via SOCKS5 and by hostname and by VIP, a service whose only endpoint is
// on node-b (HBONE across nodes) and a service on its own node, getting
// its echo back; the mTLS identities on both ends are the pods'
// identities from certificates issued by that CA (impersonation by each
// node's ztunnel, with its token and cluster); and inbound listeners follow
// the state (a pod leaving xDS closes its :15008 listener).
func TestTwoNodesEndToEnd(t *testing.T) {
	a1, a2, b1 := nextAddr(), nextAddr(), nextAddr()
	echoVIP, localVIP := netip.MustParseAddr("10.96.0.10"), netip.MustParseAddr("10.96.0.11")
	startEcho(t, a2)
	startEcho(t, b1)

	ca := catest.Start(t, catest.Options{ConfigCluster: "c1", Listen: netip.AddrPortFrom(nextAddr(), 0).String()})
	ca.AddNode(t, "token-a", "c1", "node-a")
	ca.AddNode(t, "token-b", "c2", "node-b")
	ca.Place("c1", "node-a", "default", "client", true)
	ca.Place("c1", "node-a", "default", "local", true)
	ca.Place("c2", "node-b", "default", "echo", true)

	xc := cache.NewLinearCache(workloadv1.TypeURL, cache.WithInitialResources(map[string]types.Resource{
		"c1/default/a1": pod("c1/default/a1", "client", "node-a", "c1", a1, nil),
		"c1/default/a2": pod("c1/default/a2", "local", "node-a", "c1", a2, backs(localKey)),
		"c2/default/b1": pod("c2/default/b1", "echo", "node-b", "c2", b1, backs(echoKey)),
		echoKey:         service("echo", echoVIP),
		localKey:        service("local", localVIP),
	}))
	xdsAddr := startXDS(t, xc, nextAddr(), nil)

	za := startNode(t, "node-a", "c1", "token-a", xdsAddr, ca)
	zb := startNode(t, "node-b", "c2", "token-b", xdsAddr, ca)
	for _, z := range []*ztunnel{za, zb} {
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			code, _ := httpGet(c, z.readyURL)
			require.Equal(c, http.StatusOK, code)
		}, 15*time.Second, 20*time.Millisecond)
	}

	for _, target := range []string{echoHost, echoVIP.String(), "local.default.svc.cluster.local", localVIP.String()} {
		code, got := socksEcho(t, za.socks, a1, target, svcPort, "hello "+target)
		require.Equal(t, byte(0), code, target)
		require.Equal(t, "hello "+target, got)
	}

	// Certificates came from the CA, requested by each node for its own pods.
	imp := map[string]string{} // impersonated identity -> token
	for _, r := range ca.Requests() {
		require.NoError(t, r.Err)
		if r.Impersonated != "" {
			imp[r.Impersonated] = r.Token
		}
		require.Equal(t, map[string]string{"token-a": "c1", "token-b": "c2"}[r.Token], r.ClusterID)
	}
	require.Equal(t, "token-a", imp["spiffe://cluster.local/ns/default/sa/client"])
	require.Equal(t, "token-a", imp["spiffe://cluster.local/ns/default/sa/local"])
	require.Equal(t, "token-b", imp["spiffe://cluster.local/ns/default/sa/echo"])
	caRoots, err := caclient.RootsFromPEM(ca.RootsPEM)
	require.NoError(t, err)
	echoCert, err := zb.n.Certs().Certificate(context.Background(), zb.n.Store().Load().LocalWorkloads("node-b")[0].Identity())
	require.NoError(t, err)
	inter := x509.NewCertPool()
	for _, der := range echoCert.Certificate[1:] {
		ic, err := x509.ParseCertificate(der)
		require.NoError(t, err)
		inter.AddCert(ic)
	}
	_, err = echoCert.Leaf.Verify(x509.VerifyOptions{Roots: caRoots, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}})
	require.NoError(t, err, "node-b serves a certificate issued by the CA")

	// The destination node saw the client's identity over mTLS.
	_, body := httpGet(t, zb.metricsURL)
	require.Contains(t, body, `destination_principal="spiffe://cluster.local/ns/default/sa/echo"`)
	require.Contains(t, body, `reporter="destination",source_cluster="c1"`)
	require.Contains(t, body, `source_principal="spiffe://cluster.local/ns/default/sa/client"`)

	// config_dump lists node-b's certificates, without keys.
	_, dumpJSON := httpGet(t, "http://"+zb.admin+"/config_dump")
	var dump admin.ConfigDump
	require.NoError(t, json.Unmarshal([]byte(dumpJSON), &dump))
	require.Len(t, dump.Workloads, 3)
	var ids []string
	for _, c := range dump.Certificates {
		ids = append(ids, c.Identity)
	}
	require.ElementsMatch(t, []string{"spiffe://cluster.local/ns/default/sa/echo", "spiffe://cluster.local/ns/isthmus-system/sa/ztunnel"}, ids)
	require.NotContains(t, dumpJSON, "PRIVATE KEY")

	// a2 leaves: node-a closes a2:15008 and drops the identity.
	a2HBONE := netip.AddrPortFrom(a2, 15008).String()
	c, err := net.DialTimeout("tcp", a2HBONE, time.Second)
	require.NoError(t, err, "inbound listens on the local pod address")
	c.Close()
	require.NoError(t, xc.DeleteResource("c1/default/a2"))
	require.EventuallyWithT(t, func(col *assert.CollectT) {
		c, err := net.DialTimeout("tcp", a2HBONE, time.Second)
		if err == nil {
			c.Close()
		}
		require.Error(col, err)
		for _, id := range za.n.Certs().Identities() {
			require.NotEqual(col, "local", id.ServiceAccount)
		}
	}, 10*time.Second, 20*time.Millisecond)
}
