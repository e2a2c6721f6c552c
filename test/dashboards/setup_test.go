// Package dashboards_test runs the queries of Istio's published Grafana
// dashboards (pilot, ztunnel, and the TCP panels of mesh, service and
// workload), of Kiali's TCP traffic graph, and of Isthmus's own dashboard
// (manifests/pilot/dashboards/isthmus-mesh.json) against what Isthmus
// exports: real API servers, pilot and the node and gateway ztunnels of
// two networks in-process on loopback addresses, traffic across the
// networks and within one and a DNS query, each /metrics scraped over HTTP
// twice, the samples loaded into Prometheus's own storage and every query
// run by its PromQL engine. A query must parse; it must return data unless
// it is listed in docs/observability.md as one Isthmus does not feed, and
// then it must not. Kiali's queries must also let Kiali draw each edge of
// the traffic, unless docs list the edge and query.
package dashboards_test

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	mdns "github.com/miekg/dns"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	securityclient "istio.io/client-go/pkg/apis/security/v1"
	"istio.io/client-go/pkg/clientset/versioned"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/test/meshtest"
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

const (
	cartHost = "cart.shop.svc.cluster.local:80"
	webHost  = "web.front.svc.cluster.local:80"
	wait     = 30 * time.Second
	// pilotPod and pilotApp are the pod name and app label the pilot
	// chart's Deployment gives pilot (isthmusd-<hash>, app: isthmusd).
	pilotPod = "isthmusd-0"
	pilotApp = "isthmusd"
)

// mesh is a running federation and the targets to scrape.
type mesh struct {
	targets []target
	// traffic sends one round of requests across the networks and within
	// network-1, and one DNS query.
	traffic func(t *testing.T)
}

// runMesh starts the federation: pilot on cluster-1 (network-1), cluster-2
// on network-2, a node ztunnel and an east-west gateway in each network,
// cart in cluster-1, web in cluster-2, a policy in the config cluster, and
// the federation problems of federationProblems.
func runMesh(t *testing.T) *mesh {
	ctx := context.Background()
	c1, c2 := clusters.Cluster("cluster-1"), clusters.Cluster("cluster-2")
	require.NoError(t, c1.InstallCRDs("../../manifests/base/crds"))
	for _, c := range []*framework.Cluster{c1, c2} {
		require.NoError(t, c.EnsureNamespace(ctx, meshtest.Namespace, nil))
	}
	require.NoError(t, c1.EnsureNamespace(ctx, "shop", nil))
	require.NoError(t, c2.EnsureNamespace(ctx, "front", nil))

	a := meshtest.NewAddrs()
	pilotIP, node1, node2, gw1, gw2 := a.Next(), a.Next(), a.Next(), a.Next(), a.Next()
	cartApp, webApp, buyerIP := netip.AddrPortFrom(a.Next(), 8080), netip.AddrPortFrom(a.Next(), 8080), a.Next()
	p := meshtest.RunPilot(t, c1, pilotIP, func(cfg *server.Config) { cfg.MonitoringAddr = netip.AddrPortFrom(pilotIP, 0).String() })
	meshtest.RegisterRemote(t, c1, c2, "cluster-2", "network-2", nil)
	meshtest.GatewayService(t, c1, "network-1", gw1)
	meshtest.GatewayService(t, c2, "network-2", gw2)

	_, err := c1.CreateService(ctx, "shop", "cart", map[string]string{"app": "cart"}, framework.ServicePort{Name: "tcp", Port: 80, TargetPort: 8080})
	require.NoError(t, err)
	for _, po := range []framework.PodOptions{
		{Namespace: "shop", Name: "cart-0", Labels: map[string]string{"app": "cart"}, ServiceAccount: "cart", Node: "node-1a", IP: cartApp.Addr(), Ready: true},
		{Namespace: "shop", Name: "buyer-0", Labels: map[string]string{"app": "buyer"}, ServiceAccount: "buyer", Node: "node-1a", IP: buyerIP, Ready: true},
	} {
		_, err = c1.CreatePod(ctx, po)
		require.NoError(t, err)
	}
	_, err = c2.CreateService(ctx, "front", "web", map[string]string{"app": "web"}, framework.ServicePort{Name: "tcp", Port: 80, TargetPort: 8080})
	require.NoError(t, err)
	_, err = c2.CreatePod(ctx, framework.PodOptions{Namespace: "front", Name: "web-0", Labels: map[string]string{"app": "web"},
		ServiceAccount: "web", Node: "node-2a", IP: webApp.Addr(), Ready: true})
	require.NoError(t, err)
	meshtest.EchoApp(t, cartApp, "cart-0")
	meshtest.EchoApp(t, webApp, "web-0")

	denyAllPolicy(t, c1)
	federationProblems(t, p.Metrics, c1, c2, a.Next(), a.Next())

	m := &mesh{targets: []target{{
		URL:    "http://" + p.MonitoringAddr() + "/metrics",
		Labels: map[string]string{"namespace": meshtest.Namespace, "pod": pilotPod, "app": pilotApp},
	}}}
	zt := func(c *framework.Cluster, mode node.Mode, name, nodeName, sa, network string, ip netip.Addr) *meshtest.Ztunnel {
		return m.ztunnel(t, p, pilotIP, c, mode, name, nodeName, sa, network, ip)
	}
	z1 := zt(c1, node.ModeNode, "ztunnel-node-1a", "node-1a", "ztunnel", "network-1", node1)
	zt(c1, node.ModeGateway, "eastwest-gateway-1", "gw-node-1", "eastwest-gateway", "network-1", gw1)
	z2 := zt(c2, node.ModeNode, "ztunnel-node-2a", "node-2a", "ztunnel", "network-2", node2)
	zt(c2, node.ModeGateway, "eastwest-gateway-2", "gw-node-2", "eastwest-gateway", "network-2", gw2)

	reaches := func(t *testing.T, z *meshtest.Ztunnel, src netip.Addr, host, want string) {
		t.Helper()
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			c, err := meshtest.DialVia(t.Context(), z, src, host)
			require.NoError(ct, err)
			defer c.Close()
			got, err := meshtest.Exchange(c, "hello")
			require.NoError(ct, err)
			require.Equal(ct, want+" got hello", got)
		}, wait, 20*time.Millisecond)
	}
	m.traffic = func(t *testing.T) {
		reaches(t, z1, buyerIP, webHost, "web-0")         // network-1 to network-2
		reaches(t, z1, buyerIP, cartHost, "cart-0")       // within network-1
		reaches(t, z2, webApp.Addr(), cartHost, "cart-0") // network-2 to network-1
		dnsQuery(t, buyerIP, netip.AddrPortFrom(node1, 15053), "web.front.svc.cluster.local.")
	}
	return m
}

// ztunnel runs a ztunnel of pod name (created with meshtest.ProxyPod) with
// its metrics and, in node mode, DNS served, and adds it to the targets
// with the labels of its pod object.
func (m *mesh) ztunnel(t *testing.T, p *server.Server, pilotIP netip.Addr, c *framework.Cluster, mode node.Mode,
	name, nodeName, sa, network string, ip netip.Addr) *meshtest.Ztunnel {
	t.Helper()
	tok := meshtest.ProxyPod(t, c, name, nodeName, sa, ip)
	z := meshtest.RunZtunnel(t, p, pilotIP, meshtest.ZtunnelOptions{Mode: mode, Cluster: c.Name, Network: network, Node: nodeName,
		ServiceAccount: sa, Token: tok, IP: ip, Metrics: true, DNS: mode == node.ModeNode})
	pod, err := c.Client.CoreV1().Pods(meshtest.Namespace).Get(context.Background(), name, metav1.GetOptions{})
	require.NoError(t, err)
	l := map[string]string{"namespace": pod.Namespace, "pod": pod.Name}
	for k, v := range pod.Labels {
		l[k] = v
	}
	m.targets = append(m.targets, target{URL: "http://" + netip.AddrPortFrom(ip, 15020).String() + "/metrics", Labels: l})
	return z
}

// denyAllPolicy creates a policy in the config cluster c, in a namespace
// without workloads (it denies all there): pilot counts its event.
func denyAllPolicy(t *testing.T, c *framework.Cluster) {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, c.EnsureNamespace(ctx, "audit", nil))
	policies, err := versioned.NewForConfig(c.Config)
	require.NoError(t, err)
	_, err = policies.SecurityV1().AuthorizationPolicies("audit").Create(ctx, &securityclient.AuthorizationPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: "deny-all", Namespace: "audit"}}, metav1.CreateOptions{})
	require.NoError(t, err)
}

// dnsQuery asks ztunnel's DNS proxy at server for name's A record from
// src (a pod of its node) and expects an answer.
func dnsQuery(t *testing.T, src netip.Addr, server netip.AddrPort, name string) {
	t.Helper()
	c := &mdns.Client{Net: "udp", Timeout: 5 * time.Second, Dialer: &net.Dialer{LocalAddr: &net.UDPAddr{IP: src.AsSlice()}}}
	q := new(mdns.Msg)
	q.SetQuestion(name, mdns.TypeA)
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		r, _, err := c.Exchange(q, server.String())
		require.NoError(ct, err)
		require.Equal(ct, mdns.RcodeSuccess, r.Rcode)
		require.NotEmpty(ct, r.Answer)
	}, wait, 50*time.Millisecond)
}
