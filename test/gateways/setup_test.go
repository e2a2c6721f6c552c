package gateways_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"golang.org/x/net/proxy"
	appsv1 "k8s.io/api/apps/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"
	gwv1 "sigs.k8s.io/gateway-api/apis/v1"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/pilot/ca"
	"github.com/isthmus-mesh/isthmus/pilot/eastwest"
	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/ztunnel/caclient"
	"github.com/isthmus-mesh/isthmus/ztunnel/node"
)

var clusters *framework.ClusterSet

func TestMain(m *testing.M) {
	// controller-runtime's caches (pilot/eastwest) log through its own
	// process-wide logger, as cmd/pilot sets it.
	ctrllog.SetLogger(logr.FromSlogHandler(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: logLevel()})))
	code := framework.Main(m, framework.Options{Names: []string{"cluster-1", "cluster-2"}}, &clusters)
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

const (
	cpNS = "isthmus-system"
	// pilotName is the name pilot's serving certificate carries and the
	// east-west Deployments dial (their default --xds-address host).
	pilotName = "isthmusd." + cpNS + ".svc"
)

// addrs hands out loopback addresses of this test process: 127.<a>.<b>.x
// with a random a in 64..243 (clear of the demo's fixed addresses).
type addrs struct {
	base [2]byte
	n    atomic.Uint32
}

func newAddrs() *addrs {
	return &addrs{base: [2]byte{byte(64 + rand.IntN(180)), byte(rand.IntN(250))}}
}

func (a *addrs) next() netip.Addr {
	i := a.n.Add(1)
	return netip.AddrFrom4([4]byte{127, a.base[0], a.base[1], byte(i)})
}

// logger logs warnings, or everything with GATEWAYS_TEST_DEBUG set.
func logger(t *testing.T, name string) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: logLevel()})).With("proc", name)
}

func logLevel() slog.Level {
	if os.Getenv("GATEWAYS_TEST_DEBUG") != "" {
		return slog.LevelDebug
	}
	return slog.LevelWarn
}

// gatewayAPICRDs installs the Gateway API CRDs (GatewayClass, Gateway) that
// the sigs.k8s.io/gateway-api module in go.mod ships, in every cluster.
func gatewayAPICRDs(t *testing.T) {
	t.Helper()
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "sigs.k8s.io/gateway-api").Output()
	require.NoError(t, err, "locate the sigs.k8s.io/gateway-api module")
	dir := filepath.Join(strings.TrimSpace(string(out)), "config", "crd", "standard")
	for _, c := range clusters.Clusters {
		require.NoError(t, c.InstallCRDs(filepath.Join(dir, "gateway.networking.k8s.io_gatewayclasses.yaml"),
			filepath.Join(dir, "gateway.networking.k8s.io_gateways.yaml")))
	}
}

// runtimeClient is a controller-runtime client of c that knows Gateway API
// types.
func runtimeClient(t *testing.T, c *framework.Cluster) client.Client {
	t.Helper()
	s := runtime.NewScheme()
	require.NoError(t, corev1.AddToScheme(s))
	require.NoError(t, appsv1.AddToScheme(s))
	require.NoError(t, gwv1.Install(s))
	cl, err := client.New(c.Config, client.Options{Scheme: s})
	require.NoError(t, err)
	return cl
}

// runPilot runs pilot in-process on cluster-1 (the config cluster,
// network-1) with its TLS listener (CA and xDS) on ip; its serving
// certificate carries pilotName, which the east-west Deployments dial.
func runPilot(t *testing.T, ip netip.Addr) *server.Server {
	t.Helper()
	p, err := server.New(server.Config{
		Namespace: cpNS, ClusterID: "cluster-1", Network: "network-1", NoLeaderElection: true,
		DebugAddr: netip.AddrPortFrom(ip, 0).String(), MonitoringAddr: defaults.Disabled, GRPCAddr: netip.AddrPortFrom(ip, 0).String(),
		CA:       ca.Config{ServingSANs: []string{pilotName, ip.String()}},
		Gateways: eastwest.Config{Image: "isthmus.test/ztunnel:e2e"},
		Logger:   logger(t, "pilot"),
	}, clusters.Cluster("cluster-1").Config, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Error("pilot did not stop")
		}
	})
	require.Eventually(t, func() bool { return p.GRPCAddr() != "" && p.DebugAddr() != "" && p.Ready() }, 30*time.Second, 10*time.Millisecond)
	return p
}

// registerCluster2 puts cluster-2's remote secret (network-2) into
// cluster-1: pilot reaches cluster-2 with the reader identity
// (remotesecret.ReaderRules) only.
func registerCluster2(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	kc, err := clusters.Cluster("cluster-2").ReaderKubeconfig(ctx, "cluster-2", remotesecret.ReaderOptions{})
	require.NoError(t, err)
	sec := remotesecret.Secret("cluster-2", cpNS, kc)
	sec.Annotations[remotesecret.NetworkAnnotation] = "network-2"
	_, err = clusters.Cluster("cluster-1").Client.CoreV1().Secrets(cpNS).Create(ctx, sec, metav1.CreateOptions{})
	require.NoError(t, err)
}

// proxyPod creates the hostNetwork pod of a node ztunnel and a token for it
// with the CA's audience.
func proxyPod(t *testing.T, c *framework.Cluster, name, nodeName, sa string, ip netip.Addr) string {
	t.Helper()
	ctx := context.Background()
	_, err := c.Client.CoreV1().ServiceAccounts(cpNS).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa, Namespace: cpNS}}, metav1.CreateOptions{})
	if !apierrors.IsAlreadyExists(err) {
		require.NoError(t, err)
	}
	pod, err := c.CreatePod(ctx, framework.PodOptions{Namespace: cpNS, Name: name, ServiceAccount: sa, Node: nodeName, IP: ip,
		HostNetwork: true, Ready: true, Labels: map[string]string{"app": sa}})
	require.NoError(t, err)
	return podToken(t, c, pod, "istio-ca", 3600)
}

// podToken asks the TokenRequest API for a token of pod's ServiceAccount
// bound to pod, as a kubelet does for a projected token volume.
func podToken(t *testing.T, c *framework.Cluster, pod *corev1.Pod, audience string, ttl int64) string {
	t.Helper()
	tr, err := c.Client.CoreV1().ServiceAccounts(pod.Namespace).CreateToken(context.Background(), pod.Spec.ServiceAccountName, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{
			Audiences: []string{audience}, ExpirationSeconds: &ttl,
			BoundObjectRef: &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
		}}, metav1.CreateOptions{})
	require.NoError(t, err)
	return tr.Status.Token
}

// ztunnel is one running node ztunnel.
type ztunnel struct {
	ip netip.Addr
}

// runZtunnel runs a node ztunnel of cluster/network on nodeName at ip,
// connected to pilot p, until the test ends, and waits until it is ready.
func runZtunnel(t *testing.T, p *server.Server, pilotIP netip.Addr, cluster, network, nodeName, token string, ip netip.Addr) *ztunnel {
	t.Helper()
	at := func(port uint16) string { return netip.AddrPortFrom(ip, port).String() }
	cfg := node.Config{
		NodeName: nodeName, ClusterID: cluster, Network: network, Mode: node.ModeNode, Namespace: cpNS, ServiceAccount: "ztunnel",
		XDSAddress: p.GRPCAddr(), CAAddress: p.GRPCAddr(), XDSServerName: pilotIP.String(), CAServerName: pilotIP.String(),
		NodeIPs: []netip.Addr{ip}, AdminListen: node.Disabled, MetricsListen: node.Disabled, ReadinessListen: at(15021),
		SOCKS5Listen: at(15080), OutboundListen: at(15001),
	}
	n, err := node.New(cfg, node.Deps{Token: caclient.StaticToken(token), RootsPEM: p.CA.Roots(), Log: logger(t, nodeName)})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- n.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	waitReady(t, at(15021), nodeName)
	return &ztunnel{ip: ip}
}

// waitReady waits until addr's /healthz/ready answers 200.
func waitReady(t *testing.T, addr, who string) {
	t.Helper()
	require.Eventually(t, func() bool {
		resp, err := http.Get("http://" + addr + "/healthz/ready")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, time.Minute, 20*time.Millisecond, "%s ready", who)
}

// echoApp answers each line with "<who> got <line>" on addr until the
// test ends.
func echoApp(t *testing.T, addr netip.AddrPort, who string) {
	t.Helper()
	ln, err := net.Listen("tcp", addr.String())
	require.NoError(t, err)
	var wg sync.WaitGroup
	var mu sync.Mutex
	conns := map[net.Conn]bool{}
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns[c] = true
			mu.Unlock()
			wg.Go(func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					fmt.Fprintf(c, "%s got %s\n", who, strings.TrimSpace(line))
				}
			})
		}
	})
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
}

// request connects from src through the SOCKS5 listener of node ztunnel z
// to host, sends one line and reads one line back.
func request(ctx context.Context, z *ztunnel, src netip.Addr, host, msg string) (string, error) {
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: src.AsSlice()}, Timeout: 5 * time.Second}
	socks, err := proxy.SOCKS5("tcp", netip.AddrPortFrom(z.ip, 15080).String(), nil, d)
	if err != nil {
		return "", err
	}
	c, err := socks.(proxy.ContextDialer).DialContext(ctx, "tcp", host)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, msg+"\n"); err != nil {
		return "", err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line), err
}
