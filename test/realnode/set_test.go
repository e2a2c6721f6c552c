package realnode_test

import (
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/isthmus-mesh/isthmus/internal/imagebuild"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/test/framework/realnode"
)

// TestRealNodeSet brings up two clusters on two networks joined by a wan,
// as the demo joins them: cluster-1 with two nodes on network-1, cluster-2
// with one on network-2. Pods on cluster-1's two nodes reach each other by
// pod IP; a pod of cluster-1 reaches cluster-2's gateway (a hostNetwork pod)
// only once it is exposed, and cluster-2's API server; it never reaches a
// pod IP of cluster-2, nor another port of the gateway's node, and the
// wan's filter counts each refusal. After the teardown nothing is left on
// the host.
func TestRealNodeSet(t *testing.T) {
	before := snapshotHost(t)
	var dir string
	t.Run("Set", func(t *testing.T) {
		dir = clusterSet(t)
	})
	requireHostClean(t, dir, before)
}

// gatewayPort is where the gateway pod of cluster-2 listens, on its node's
// IP.
const gatewayPort = 15443

func clusterSet(t *testing.T) string {
	set := realnode.StartSet(t, realnode.SetOptions{
		Clusters: []realnode.ClusterSpec{
			{Name: "cluster-1", Network: "network-1", Nodes: 2},
			{Name: "cluster-2", Network: "network-2", Nodes: 1},
		},
		Images: []imagebuild.Image{{Name: serverImage, Package: "./test/realnode/server", Description: "real-node test server"}},
	})
	c1, c2 := set.Cluster("cluster-1"), set.Cluster("cluster-2")
	require.Len(t, c1.Nodes, 2)
	require.Len(t, c2.Nodes, 1)
	t.Logf("2 clusters, 3 nodes up in %v (slowest node Ready %v / %v after its kubelet started)",
		set.Started.Round(time.Millisecond), c1.NodeReady.Round(time.Millisecond), c2.NodeReady.Round(time.Millisecond))

	requirePodCIDRs(t, set)
	a, b, far, _ := startSetPods(t, c1, c2)
	// a probes from inside its pod: a client on c1's first node asks it.
	probeA := func(kind, addr string) (int, string) {
		return probe(t, c1.Nodes[0], a.Status.PodIP, kind, addr)
	}
	podAddr := func(p *corev1.Pod, port int) string { return net.JoinHostPort(p.Status.PodIP, fmt.Sprint(port)) }

	t.Run("PodToPodAcrossNodes", func(t *testing.T) {
		code, body := probeA("fetch", podAddr(b, 8080))
		require.Equal(t, http.StatusOK, code, body)
		require.Equal(t, "isthmus realnode server "+b.Name+"\n", body)
		code, body = probe(t, c1.Nodes[1], b.Status.PodIP, "fetch", podAddr(a, 8080))
		require.Equal(t, http.StatusOK, code, body)
		require.Equal(t, "isthmus realnode server "+a.Name+"\n", body)
	})

	t.Run("PodToPodAcrossNetworksRefused", func(t *testing.T) {
		// far serves: its own node reaches it.
		require.Equal(t, "isthmus realnode server "+far.Name+"\n", get(t, c2.Node, podAddr(far, 8080)))
		n0 := rejected(t, set)
		code, body := probeA("dial", podAddr(far, 8080))
		require.Equal(t, http.StatusBadGateway, code, body)
		require.Contains(t, body, "no route to host", "refused by the wan's filter at once, not timed out")
		require.Greater(t, rejected(t, set), n0, "the wan's filter counted the refusal")
	})

	t.Run("GatewayThroughTheWAN", func(t *testing.T) {
		gwAddr := netip.AddrPortFrom(c2.Node.IP, gatewayPort)
		n0 := rejected(t, set)
		code, body := probeA("dial", gwAddr.String())
		require.Equal(t, http.StatusBadGateway, code, "not exposed yet: %s", body)
		require.Contains(t, body, "no route to host")
		require.Greater(t, rejected(t, set), n0)

		require.NoError(t, set.ExposeGateway(gwAddr))
		host, err := os.Hostname()
		require.NoError(t, err)
		code, body = probeA("fetch", gwAddr.String())
		require.Equal(t, http.StatusOK, code, body)
		require.Equal(t, "isthmus realnode server "+host+"\n", body, "the hostNetwork gateway pod answered")

		// Only that port of the node crosses: its kubelet's does not.
		n1 := rejected(t, set)
		code, body = probeA("dial", netip.AddrPortFrom(c2.Node.IP, 10250).String())
		require.Equal(t, http.StatusBadGateway, code, body)
		require.Contains(t, body, "no route to host")
		require.Greater(t, rejected(t, set), n1)

		require.Error(t, set.ExposeGateway(netip.MustParseAddrPort("10.2.200.1:15443")), "not a node's IP")
	})

	t.Run("RemoteAPIServer", func(t *testing.T) {
		want := apiServerCert(t, c2)
		require.NotEqual(t, apiServerCert(t, c1), want)
		code, body := probeA("tls", c2.APIServer.String())
		require.Equal(t, http.StatusOK, code, body)
		require.Equal(t, want, body, "the TLS handshake from a pod of cluster-1 reached cluster-2's API server")
		require.Equal(t, "10.2.255.1", c2.APIServer.Addr().String(), "the API server's address is in its network")

		// The remote secret's kubeconfig works from network-1 (dialled
		// from cluster-1's node): server, certificate name and token.
		kc, err := c2.RemoteKubeconfig(t.Context(), "cluster-2", remotesecret.ReaderOptions{})
		require.NoError(t, err)
		cfg, err := clientcmd.RESTConfigFromKubeConfig(kc)
		require.NoError(t, err)
		require.Equal(t, "https://"+c2.APIServer.String(), cfg.Host)
		cfg.Dial = c1.Nodes[0].DialContext
		client, err := kubernetes.NewForConfig(cfg)
		require.NoError(t, err)
		_, err = client.CoreV1().Services("default").Get(t.Context(), "kubernetes", metav1.GetOptions{})
		require.NoError(t, err)
		cfg.Dial = nil // the host's loopback has no such address
		client, err = kubernetes.NewForConfig(cfg)
		require.NoError(t, err)
		_, err = client.CoreV1().Services("default").Get(t.Context(), "kubernetes", metav1.GetOptions{})
		require.Error(t, err)
	})

	t.Logf("set RSS (etcd, 2 apiservers, controllers, 3 x containerd+kubelet, shims, containers): %d MiB", set.RSSBytes()>>20)
	t.Logf("cluster RSS with the shared etcd: cluster-1 (2 nodes) %d MiB, cluster-2 (1 node) %d MiB", c1.RSSBytes()>>20, c2.RSSBytes()>>20)
	return set.Dir()
}

// requirePodCIDRs checks that every node's PodCIDR is its own, and that
// its Node object says so.
func requirePodCIDRs(t *testing.T, set *realnode.Set) {
	t.Helper()
	cidrs := map[netip.Prefix]bool{}
	for _, e := range set.Clusters {
		for _, n := range e.Nodes {
			obj, err := e.Cluster.Client.CoreV1().Nodes().Get(t.Context(), n.Name, metav1.GetOptions{})
			require.NoError(t, err)
			require.Equal(t, n.PodCIDR.String(), obj.Spec.PodCIDR, "node %s", n.Name)
			require.False(t, cidrs[n.PodCIDR], "PodCIDR %s twice", n.PodCIDR)
			cidrs[n.PodCIDR] = true
		}
	}
}

// startSetPods runs the test server as pods a and b on cluster-1's two
// nodes, far on cluster-2's node, and gateway, a hostNetwork pod on
// cluster-2's node listening on gatewayPort, and returns them Running.
func startSetPods(t *testing.T, c1, c2 *realnode.Env) (a, b, far, gw *corev1.Pod) {
	t.Helper()
	const ns = "realnode"
	for _, e := range []*realnode.Env{c1, c2} {
		_, err := e.Cluster.Client.CoreV1().Namespaces().Create(t.Context(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	createServerPod(t, c1, ns, "a", c1.Nodes[0], false, nil)
	createServerPod(t, c1, ns, "b", c1.Nodes[1], false, nil)
	createServerPod(t, c2, ns, "far", c2.Node, false, nil)
	createServerPod(t, c2, ns, "gateway", c2.Node, true, []string{"-listen", fmt.Sprintf(":%d", gatewayPort)})
	a = waitPodRunning(t, c1.Cluster.Client, ns, "app=a")
	b = waitPodRunning(t, c1.Cluster.Client, ns, "app=b")
	far = waitPodRunning(t, c2.Cluster.Client, ns, "app=far")
	gw = waitPodRunning(t, c2.Cluster.Client, ns, "app=gateway")
	requireInCIDR(t, c1.Nodes[0], a)
	requireInCIDR(t, c1.Nodes[1], b)
	requireInCIDR(t, c2.Node, far)
	require.Equal(t, c2.Node.IP.String(), gw.Status.PodIP)
	return a, b, far, gw
}

// createServerPod creates a pod of the test server named name (label
// app=name) on node, on the pod network or the node's.
func createServerPod(t *testing.T, e *realnode.Env, ns, name string, node *realnode.Node, hostNetwork bool, args []string) {
	t.Helper()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{"app": name}},
		Spec: corev1.PodSpec{
			NodeName: node.Name, HostNetwork: hostNetwork,
			Containers: []corev1.Container{{Name: "server", Image: e.ImageRef(serverImage), Args: args}},
		},
	}
	_, err := e.Cluster.Client.CoreV1().Pods(ns).Create(t.Context(), pod, metav1.CreateOptions{})
	require.NoError(t, err)
}

func requireInCIDR(t *testing.T, n *realnode.Node, p *corev1.Pod) {
	t.Helper()
	ip, err := netip.ParseAddr(p.Status.PodIP)
	require.NoError(t, err)
	require.True(t, n.PodCIDR.Contains(ip), "pod %s IP %s outside node %s's PodCIDR %s", p.Name, ip, n.Name, n.PodCIDR)
}

// probe asks the test server at podIP (from inside node) to make a
// connection of kind (dial, fetch, tls) to addr, and returns the status
// and body of its answer.
func probe(t *testing.T, node *realnode.Node, podIP, kind, addr string) (int, string) {
	t.Helper()
	return fetch(t, node, fmt.Sprintf("http://%s/%s?addr=%s", net.JoinHostPort(podIP, "8080"), kind, url.QueryEscape(addr)))
}

// rejected reads the wan filter's refusal counter.
func rejected(t *testing.T, set *realnode.Set) uint64 {
	t.Helper()
	n, err := set.WANRejected()
	require.NoError(t, err)
	return n
}

// apiServerCert verifies the API server of e on the host's loopback
// against its CA and returns the hex SHA-256 of its leaf certificate.
func apiServerCert(t *testing.T, e *realnode.Env) string {
	t.Helper()
	u, err := url.Parse(e.Cluster.Host())
	require.NoError(t, err)
	roots := x509.NewCertPool()
	require.True(t, roots.AppendCertsFromPEM(e.Cluster.CAData()))
	c, err := tls.Dial("tcp", u.Host, &tls.Config{RootCAs: roots, ServerName: u.Hostname()})
	require.NoError(t, err)
	defer c.Close()
	sum := sha256.Sum256(c.ConnectionState().PeerCertificates[0].Raw)
	return hex.EncodeToString(sum[:])
}
