package main

import (
	"context"
	"net/http"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/test/meshtest"
	"github.com/isthmus-mesh/isthmus/ztunnel/caclient"
	"github.com/isthmus-mesh/isthmus/ztunnel/node"
)

// TestZtunnelConfigAgainstAMesh: a real pilot on the primary cluster
// (cluster-1, network-1) with the remote cluster registered on network-2,
// whose east-west gateway and service web (a pod in the remote only) it
// federates; a real node ztunnel of cluster-1 with its admin server.
// ztunnel-config workloads, reading that ztunnel (its pod found through
// the API server; its admin port over a direct dialer: the port-forward
// needs a kubelet), lists the remote network's split-horizon workload of
// web with the gateway, as in the demo.
func TestZtunnelConfigAgainstAMesh(t *testing.T) {
	ctx := context.Background()
	c1, c2 := clusters.Cluster("primary"), clusters.Cluster("remote")
	for _, c := range []*framework.Cluster{c1, c2} {
		require.NoError(t, c.EnsureNamespace(ctx, meshtest.Namespace, nil))
	}
	require.NoError(t, c2.EnsureNamespace(ctx, "zc-front", nil))
	a := meshtest.NewAddrs()
	pilotIP, nodeIP, gwIP, webIP := a.Next(), a.Next(), a.Next(), a.Next()

	p := meshtest.RunPilot(t, c1, pilotIP, nil)
	const remoteID = "cluster-zc"
	meshtest.RegisterRemote(t, c1, c2, remoteID, "network-2", nil)
	meshtest.GatewayService(t, c2, "network-2", gwIP)
	_, err := c2.CreateService(ctx, "zc-front", "web", map[string]string{"app": "web"}, framework.ServicePort{Name: "tcp", Port: 80, TargetPort: 8080})
	require.NoError(t, err)
	_, err = c2.CreatePod(ctx, framework.PodOptions{Namespace: "zc-front", Name: "web-0", Labels: map[string]string{"app": "web"},
		ServiceAccount: "web", Node: "node-2a", IP: webIP, Ready: true})
	require.NoError(t, err)
	// The gateway's pod gives its Service the identity clients verify.
	meshtest.ProxyPod(t, c2, "eastwest-gateway-zc", "gw-node-2", "eastwest-gateway", gwIP)
	tok := meshtest.ProxyPod(t, c1, "ztunnel-zc", "node-zc", "ztunnel", nodeIP)
	t.Cleanup(func() {
		// The clusters are shared by the package's tests (and run no
		// kubelet: pods go at once).
		del := metav1.DeleteOptions{GracePeriodSeconds: new(int64)}
		_ = c1.Client.CoreV1().Secrets(meshtest.Namespace).Delete(ctx, remotesecret.Secret(remoteID, meshtest.Namespace, nil).Name, del)
		_ = c1.Client.CoreV1().Pods(meshtest.Namespace).Delete(ctx, "ztunnel-zc", del)
		_ = c2.Client.CoreV1().Pods(meshtest.Namespace).Delete(ctx, "eastwest-gateway-zc", del)
		_ = c2.Client.CoreV1().Services(meshtest.Namespace).Delete(ctx, "eastwest-gateway", del)
		_ = c2.Client.CoreV1().Pods("zc-front").Delete(ctx, "web-0", del)
		_ = c2.Client.CoreV1().Services("zc-front").Delete(ctx, "web", del)
	})
	admin := runAdminZtunnel(t, p, pilotIP, nodeIP, tok)

	kc := writeKubeconfig(t, "primary", c1.Config)
	dialer := func(*rest.Config) podDialer { return directDialer{admin} }
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		out, err := runZtunnelConfig(t, dialer, "workloads", "ztunnel-zc", "--kubeconfig", kc, "-n", meshtest.Namespace)
		require.NoError(c, err)
		_, rows := parseTable(t, out)
		var web []string
		for _, r := range rows {
			if r[0] == "zc-front" && r[5] == "network-2" {
				web = r
			}
		}
		require.NotNil(c, web, "the split-horizon workload of network-2:\n%s", out)
		assert.Equal(c, "-", web[2], "no address")
		// Through network-2's gateway. Other tests of the package leave
		// Secrets registering the same remote cluster under other IDs:
		// pilot then knows that gateway once per registration.
		for _, gw := range strings.Split(web[8], ",") {
			assert.Equal(c, netip.AddrPortFrom(gwIP, 15008).String(), gw, "through network-2's gateway")
		}
	}, 30*time.Second, 100*time.Millisecond)

	out, err := runZtunnelConfig(t, dialer, "workloads", "ztunnel-zc", "--kubeconfig", kc, "-n", meshtest.Namespace)
	require.NoError(t, err)
	t.Logf("ztunnel-config workloads:\n%s", out)
	out, err = runZtunnelConfig(t, dialer, "services", "ztunnel-zc", "--kubeconfig", kc, "-n", meshtest.Namespace)
	require.NoError(t, err)
	require.Contains(t, out, "web.zc-front.svc.cluster.local")
	out, err = runZtunnelConfig(t, dialer, "certificates", "ztunnel-zc", "--kubeconfig", kc, "-n", meshtest.Namespace)
	require.NoError(t, err)
	require.Contains(t, out, "spiffe://cluster.local/ns/isthmus-system/sa/ztunnel", "the node's own certificate, from pilot's CA")
}

// runAdminZtunnel runs a node ztunnel of cluster-1 on ip, connected to
// pilot p, with its admin server on ip:15000 (meshtest.RunZtunnel runs
// none), until the test ends; it returns the admin address once ready.
func runAdminZtunnel(t *testing.T, p *server.Server, pilotIP, ip netip.Addr, token string) string {
	t.Helper()
	at := func(port uint16) string { return netip.AddrPortFrom(ip, port).String() }
	cfg := node.Config{
		NodeName: "node-zc", ClusterID: "cluster-1", Network: "network-1", Namespace: meshtest.Namespace, ServiceAccount: "ztunnel",
		XDSAddress: p.GRPCAddr(), CAAddress: p.GRPCAddr(), XDSServerName: pilotIP.String(), CAServerName: pilotIP.String(),
		NodeIPs: []netip.Addr{ip}, AdminListen: at(15000), MetricsListen: node.Disabled, ReadinessListen: at(15021),
		SOCKS5Listen: at(15080), OutboundListen: at(15001),
	}
	n, err := node.New(cfg, node.Deps{Token: caclient.StaticToken(token), RootsPEM: p.CA.Roots(), Log: meshtest.Logger(t, "node-zc")})
	require.NoError(t, err)
	runCtx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- n.Run(runCtx) }()
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
	}, time.Minute, 20*time.Millisecond, "ztunnel ready")
	return at(15000)
}
