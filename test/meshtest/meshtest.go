// Package meshtest runs the parts of a federation in-process for end-to-end
// tests on real API servers (test/framework): pilot on the config cluster,
// remote Secrets, proxy pods with CA tokens, east-west gateway Services,
// node and gateway ztunnels on loopback addresses, and a line echo app.
package meshtest

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
	"golang.org/x/net/proxy"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/internal/promread"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/pilot/ca"
	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/ztunnel/caclient"
	"github.com/isthmus-mesh/isthmus/ztunnel/node"
)

// Namespace is the control plane's namespace in every cluster.
const Namespace = "isthmus-system"

// Addrs hands out loopback addresses of this test process: 127.<a>.<b>.x
// with a random a in 64..243 (clear of the demo's fixed addresses).
type Addrs struct {
	base [2]byte
	n    atomic.Uint32
}

// NewAddrs returns a fresh address range.
func NewAddrs() *Addrs {
	return &Addrs{base: [2]byte{byte(64 + rand.IntN(180)), byte(rand.IntN(250))}}
}

// Next returns the next address of the range.
func (a *Addrs) Next() netip.Addr {
	i := a.n.Add(1)
	return netip.AddrFrom4([4]byte{127, a.base[0], a.base[1], byte(i)})
}

// Logger logs warnings, or everything with MESHTEST_DEBUG set.
func Logger(t testing.TB, name string) *slog.Logger {
	level := slog.LevelWarn
	if os.Getenv("MESHTEST_DEBUG") != "" {
		level = slog.LevelDebug
	}
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: level})).With("proc", name)
}

// RunPilot runs pilot in-process on config (cluster-1, network-1) with its
// TLS listener (CA and xDS) and debug server on ip, until the test ends;
// tweak, if set, adjusts its configuration.
func RunPilot(t testing.TB, config *framework.Cluster, ip netip.Addr, tweak func(*server.Config)) *server.Server {
	t.Helper()
	cfg := server.Config{
		Namespace: Namespace, ClusterID: "cluster-1", Network: "network-1", NoLeaderElection: true,
		DebugAddr: netip.AddrPortFrom(ip, 0).String(), MonitoringAddr: defaults.Disabled, GRPCAddr: netip.AddrPortFrom(ip, 0).String(),
		CA: ca.Config{ServingSANs: []string{ip.String()}}, Logger: Logger(t, "pilot"),
	}
	if tweak != nil {
		tweak(&cfg)
	}
	p, err := server.New(cfg, config.Config, nil)
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

// RegisterRemote puts remote's remote Secret (cluster id, on network, with
// extra annotations) into config.
func RegisterRemote(t testing.TB, config, remote *framework.Cluster, id, network string, annotations map[string]string) {
	t.Helper()
	ctx := context.Background()
	kc, err := remote.ReaderKubeconfig(ctx, id, remotesecret.ReaderOptions{})
	require.NoError(t, err)
	sec := remotesecret.Secret(id, Namespace, kc)
	sec.Annotations[remotesecret.NetworkAnnotation] = network
	for k, v := range annotations {
		sec.Annotations[k] = v
	}
	_, err = config.Client.CoreV1().Secrets(Namespace).Create(ctx, sec, metav1.CreateOptions{})
	require.NoError(t, err)
}

// ProxyPod creates the hostNetwork pod of a ztunnel or gateway (labelled
// app=<sa>, so that the gateway Service selects it and clients verify the
// gateway by its account) and returns a token for it with the CA's
// audience.
func ProxyPod(t testing.TB, c *framework.Cluster, name, nodeName, sa string, ip netip.Addr) string {
	t.Helper()
	ctx := context.Background()
	_, err := c.Client.CoreV1().ServiceAccounts(Namespace).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa, Namespace: Namespace}}, metav1.CreateOptions{})
	if !apierrors.IsAlreadyExists(err) {
		require.NoError(t, err)
	}
	pod, err := c.CreatePod(ctx, framework.PodOptions{Namespace: Namespace, Name: name, ServiceAccount: sa, Node: nodeName, IP: ip,
		HostNetwork: true, Ready: true, Labels: map[string]string{"app": sa}})
	require.NoError(t, err)
	ttl := int64(3600)
	tr, err := c.Client.CoreV1().ServiceAccounts(Namespace).CreateToken(ctx, sa, &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{
		Audiences: []string{"istio-ca"}, ExpirationSeconds: &ttl,
		BoundObjectRef: &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
	}}, metav1.CreateOptions{})
	require.NoError(t, err)
	return tr.Status.Token
}

// GatewayService publishes network's east-west gateway at ip in c, with
// its HBONE (15008) and SNI passthrough (15443) ports.
func GatewayService(t testing.TB, c *framework.Cluster, network string, ip netip.Addr) {
	t.Helper()
	ctx := context.Background()
	svc, err := c.Client.CoreV1().Services(Namespace).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "eastwest-gateway", Namespace: Namespace, Labels: map[string]string{"topology.istio.io/network": network}},
		Spec: corev1.ServiceSpec{Type: corev1.ServiceTypeLoadBalancer, Selector: map[string]string{"app": "eastwest-gateway"},
			Ports: []corev1.ServicePort{{Name: "tls-hbone", Port: 15008, TargetPort: intstr.FromInt32(15008)},
				{Name: "tls", Port: 15443, TargetPort: intstr.FromInt32(15443)}}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	svc.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{{IP: ip.String()}}
	_, err = c.Client.CoreV1().Services(Namespace).UpdateStatus(ctx, svc, metav1.UpdateOptions{})
	require.NoError(t, err)
}

// Ztunnel is one running ztunnel (node or gateway mode).
type Ztunnel struct {
	Node    *node.Node
	IP      netip.Addr
	Metrics *prometheus.Registry
}

// ZtunnelOptions say which ztunnel to run.
type ZtunnelOptions struct {
	Mode                   node.Mode
	Cluster, Network, Node string
	ServiceAccount, Token  string
	IP                     netip.Addr
	// TrustDomain is the cluster's (default: the mesh's, cluster.local).
	TrustDomain string
	// TrustBundle, when set, is the SPIFFE trust bundle map the ztunnel
	// verifies peers with; unset, pilot's PEM roots are its domain's only.
	TrustBundle []byte
	// Metrics serves /metrics on IP:15020; DNS serves the DNS proxy on
	// IP:15053 (node mode); TLSPassthrough serves SNI passthrough on
	// IP:15443 (gateway mode).
	Metrics, DNS, TLSPassthrough bool
}

// RunZtunnel runs a ztunnel connected to pilot p (serving on pilotIP)
// until the test ends, and waits until it is ready.
func RunZtunnel(t testing.TB, p *server.Server, pilotIP netip.Addr, o ZtunnelOptions) *Ztunnel {
	t.Helper()
	at := func(port uint16) string { return netip.AddrPortFrom(o.IP, port).String() }
	cfg := node.Config{
		NodeName: o.Node, ClusterID: o.Cluster, Network: o.Network, Mode: o.Mode, Namespace: Namespace, ServiceAccount: o.ServiceAccount,
		TrustDomain: o.TrustDomain,
		XDSAddress:  p.GRPCAddr(), CAAddress: p.GRPCAddr(), XDSServerName: pilotIP.String(), CAServerName: pilotIP.String(),
		NodeIPs: []netip.Addr{o.IP}, AdminListen: node.Disabled, MetricsListen: node.Disabled, ReadinessListen: at(15021),
	}
	if o.Mode == node.ModeGateway {
		cfg.GatewayListen = at(15008)
		if o.TLSPassthrough {
			cfg.GatewayTLSListen = at(15443)
		}
	} else {
		cfg.SOCKS5Listen, cfg.OutboundListen = at(15080), at(15001)
		if o.DNS {
			cfg.DNSListen = at(15053)
		}
	}
	if o.Metrics {
		cfg.MetricsListen = at(15020)
	}
	z := &Ztunnel{IP: o.IP, Metrics: prometheus.NewRegistry()}
	var err error
	z.Node, err = node.New(cfg, node.Deps{Token: caclient.StaticToken(o.Token), RootsPEM: p.CA.Roots(), TrustBundle: o.TrustBundle,
		Registry: z.Metrics, Log: Logger(t, o.Node)})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- z.Node.Run(ctx) }()
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
	}, time.Minute, 20*time.Millisecond, "%s ready", o.Node)
	return z
}

// Counter returns the value of metric with labels in reg (0 when absent;
// summed when several label sets match).
func Counter(t testing.TB, reg *prometheus.Registry, metric string, labels map[string]string) float64 {
	t.Helper()
	v, err := promread.Value(reg, metric, labels)
	require.NoError(t, err)
	return v
}

// EchoApp answers each line with "<who> got <line>" on addr until the
// test ends.
func EchoApp(t testing.TB, addr netip.AddrPort, who string) {
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

// DialVia connects from src through the SOCKS5 listener of a node ztunnel
// to host:port.
func DialVia(ctx context.Context, z *Ztunnel, src netip.Addr, host string) (net.Conn, error) {
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: src.AsSlice()}, Timeout: 5 * time.Second}
	socks, err := proxy.SOCKS5("tcp", netip.AddrPortFrom(z.IP, 15080).String(), nil, d)
	if err != nil {
		return nil, err
	}
	return socks.(proxy.ContextDialer).DialContext(ctx, "tcp", host)
}

// Exchange sends one line on c and reads one line back.
func Exchange(c net.Conn, msg string) (string, error) {
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, msg+"\n"); err != nil {
		return "", err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line), err
}
