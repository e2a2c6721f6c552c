package authz_test

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
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"golang.org/x/net/proxy"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/pilot/ca"
	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/ztunnel/caclient"
	"github.com/isthmus-mesh/isthmus/ztunnel/node"
)

var clusters *framework.ClusterSet

func TestMain(m *testing.M) {
	code := framework.Main(m, framework.Options{Names: []string{"cluster-1", "cluster-2"}}, &clusters)
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

const cpNS = "isthmus-system"

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

// logger logs warnings, or everything with AUTHZ_TEST_DEBUG set.
func logger(t *testing.T, name string) *slog.Logger {
	level := slog.LevelWarn
	if os.Getenv("AUTHZ_TEST_DEBUG") != "" {
		level = slog.LevelDebug
	}
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: level})).With("proc", name)
}

// runPilot runs pilot in-process on cluster-1 (the config cluster,
// network-1) with its TLS listener (CA and xDS) and debug server on ip.
func runPilot(t *testing.T, ip netip.Addr) *server.Server {
	t.Helper()
	p, err := server.New(server.Config{
		Namespace: cpNS, ClusterID: "cluster-1", Network: "network-1", NoLeaderElection: true,
		DebugAddr: netip.AddrPortFrom(ip, 0).String(), MonitoringAddr: defaults.Disabled, GRPCAddr: netip.AddrPortFrom(ip, 0).String(),
		CA: ca.Config{ServingSANs: []string{ip.String()}}, Logger: logger(t, "pilot"),
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

// registerCluster2 puts cluster-2's remote secret (network-2) into cluster-1.
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

// proxyPod creates the hostNetwork pod of a ztunnel or gateway (labelled
// app=<sa>, so that the gateway Service selects it and clients verify the
// gateway by its account) and a token for it with the CA's audience.
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
	ttl := int64(3600)
	tr, err := c.Client.CoreV1().ServiceAccounts(cpNS).CreateToken(ctx, sa, &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{
		Audiences: []string{"istio-ca"}, ExpirationSeconds: &ttl,
		BoundObjectRef: &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
	}}, metav1.CreateOptions{})
	require.NoError(t, err)
	return tr.Status.Token
}

// gatewayService publishes network's east-west gateway at ip in c.
func gatewayService(t *testing.T, c *framework.Cluster, network string, ip netip.Addr) {
	t.Helper()
	ctx := context.Background()
	svc, err := c.Client.CoreV1().Services(cpNS).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "eastwest-gateway", Namespace: cpNS, Labels: map[string]string{"topology.istio.io/network": network}},
		Spec: corev1.ServiceSpec{Type: corev1.ServiceTypeLoadBalancer, Selector: map[string]string{"app": "eastwest-gateway"},
			Ports: []corev1.ServicePort{{Name: "tls-hbone", Port: 15008, TargetPort: intstr.FromInt32(15008)}}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	svc.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{{IP: ip.String()}}
	_, err = c.Client.CoreV1().Services(cpNS).UpdateStatus(ctx, svc, metav1.UpdateOptions{})
	require.NoError(t, err)
}

// ztunnel is one running ztunnel (node or gateway mode).
type ztunnel struct {
	n       *node.Node
	ip      netip.Addr
	metrics *prometheus.Registry
}

// runZtunnel runs a ztunnel of cluster/network on nodeName at ip,
// connected to pilot p, until the test ends, and waits until it is ready.
func runZtunnel(t *testing.T, p *server.Server, pilotIP netip.Addr, mode node.Mode, cluster, network, nodeName, sa, token string, ip netip.Addr) *ztunnel {
	t.Helper()
	at := func(port uint16) string { return netip.AddrPortFrom(ip, port).String() }
	cfg := node.Config{
		NodeName: nodeName, ClusterID: cluster, Network: network, Mode: mode, Namespace: cpNS, ServiceAccount: sa,
		XDSAddress: p.GRPCAddr(), CAAddress: p.GRPCAddr(), XDSServerName: pilotIP.String(), CAServerName: pilotIP.String(),
		NodeIPs: []netip.Addr{ip}, AdminListen: node.Disabled, MetricsListen: node.Disabled, ReadinessListen: at(15021),
	}
	if mode == node.ModeGateway {
		cfg.GatewayListen = at(15008)
	} else {
		cfg.SOCKS5Listen, cfg.OutboundListen = at(15080), at(15001)
	}
	z := &ztunnel{ip: ip, metrics: prometheus.NewRegistry()}
	var err error
	z.n, err = node.New(cfg, node.Deps{Token: caclient.StaticToken(token), RootsPEM: p.CA.Roots(), Registry: z.metrics, Log: logger(t, nodeName)})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- z.n.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	require.Eventually(t, func() bool {
		resp, err := http.Get("http://" + at(15021) + "/healthz/ready")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, time.Minute, 20*time.Millisecond, "%s ready", nodeName)
	return z
}

// counter returns the value of metric with labels in reg (0 when absent).
func counter(t *testing.T, reg *prometheus.Registry, metric string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != metric {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			got := map[string]string{}
			for _, lp := range m.GetLabel() {
				got[lp.GetName()] = lp.GetValue()
			}
			for k, v := range labels {
				if got[k] != v {
					continue next
				}
			}
			if m.GetCounter() != nil {
				return m.GetCounter().GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	return 0
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

// dialVia connects from src through the SOCKS5 listener of a node ztunnel
// to host:port.
func dialVia(ctx context.Context, z *ztunnel, src netip.Addr, host string) (net.Conn, error) {
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: src.AsSlice()}, Timeout: 5 * time.Second}
	socks, err := proxy.SOCKS5("tcp", netip.AddrPortFrom(z.ip, 15080).String(), nil, d)
	if err != nil {
		return nil, err
	}
	return socks.(proxy.ContextDialer).DialContext(ctx, "tcp", host)
}

// exchange sends one line on c and reads one line back.
func exchange(c net.Conn, msg string) (string, error) {
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, msg+"\n"); err != nil {
		return "", err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line), err
}
