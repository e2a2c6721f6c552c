// Package trustdomain_test is the end-to-end acceptance test of
// trust-domain federation (issue 20 item 4): real API servers, pilot, node
// ztunnels and east-west gateways in-process on loopback addresses.
// Cluster-2 (network-2) has its own trust domain and root, given to pilot
// as a trust-domain Secret and named by its remote Secret; workloads of
// each network reach the other's through its gateway, and an
// AuthorizationPolicy principal of the mesh's domain matches cluster-2's
// identity through a trust-domain alias.
package trustdomain_test

import (
	"context"
	"crypto/x509"
	"fmt"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	securityclient "istio.io/client-go/pkg/apis/security/v1"
	"istio.io/client-go/pkg/clientset/versioned"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/yaml"

	"github.com/isthmus-mesh/isthmus/internal/spiffe"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/pilot/ca"
	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/test/meshtest"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
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
	net2TD   = "network-2.example"
	cartHost = "cart.shop.svc.cluster.local:80"
	webHost  = "web.front.svc.cluster.local:80"
	wait     = 30 * time.Second
)

// noClusters is the Clusters of a CA that only mints its root.
type noClusters struct{}

func (noClusters) KubeClient(string) (kubernetes.Interface, bool) { return nil, false }

// domainMaterial has a CA of trust domain td generate its self-signed
// root in a namespace of its own, and returns it in Istio's plug-in
// layout (what an operator puts in a trust-domain Secret).
func domainMaterial(t *testing.T, c *framework.Cluster, td string) map[string][]byte {
	t.Helper()
	ctx := context.Background()
	ns := "material-" + td[:9]
	require.NoError(t, c.EnsureNamespace(ctx, ns, nil))
	gen, err := ca.New(ca.Config{ClusterID: "cluster-1", Namespace: ns, TrustDomain: td}, ca.Deps{ConfigClient: c.Client, Clusters: noClusters{}})
	require.NoError(t, err)
	require.NoError(t, gen.Init(ctx))
	s, err := c.Client.CoreV1().Secrets(ns).Get(ctx, ca.DefaultSelfSignedSecret, metav1.GetOptions{})
	require.NoError(t, err)
	return s.Data
}

func TestTrustDomainFederationEndToEnd(t *testing.T) {
	ctx := context.Background()
	c1, c2 := clusters.Cluster("cluster-1"), clusters.Cluster("cluster-2")
	require.NoError(t, c1.InstallCRDs("../../manifests/base/crds"))
	for _, c := range []*framework.Cluster{c1, c2} {
		require.NoError(t, c.EnsureNamespace(ctx, meshtest.Namespace, nil))
	}
	require.NoError(t, c1.EnsureNamespace(ctx, "shop", nil))
	require.NoError(t, c2.EnsureNamespace(ctx, "front", nil))

	// network-2's own CA, handed to pilot in a trust-domain Secret.
	material := domainMaterial(t, c1, net2TD)
	_, err := c1.Client.CoreV1().Secrets(meshtest.Namespace).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{
		Name: "network-2-ca", Namespace: meshtest.Namespace,
		Labels:      map[string]string{ca.TrustDomainSecretLabel: "true"},
		Annotations: map[string]string{ca.TrustDomainAnnotation: net2TD},
	}, Data: material}, metav1.CreateOptions{})
	require.NoError(t, err)

	a := meshtest.NewAddrs()
	pilotIP, node1, node2, gw1, gw2 := a.Next(), a.Next(), a.Next(), a.Next(), a.Next()
	cartApp, webApp, buyerIP := netip.AddrPortFrom(a.Next(), 8080), netip.AddrPortFrom(a.Next(), 8080), a.Next()
	p := meshtest.RunPilot(t, c1, pilotIP, func(cfg *server.Config) { cfg.TrustDomainAliases = []string{net2TD} })
	require.Equal(t, []string{"cluster.local", net2TD}, p.CA.TrustBundle().Domains())
	meshtest.RegisterRemote(t, c1, c2, "cluster-2", "network-2", map[string]string{remotesecret.TrustDomainAnnotation: net2TD})
	require.Eventually(t, func() bool { return p.CA.TrustDomainOf("cluster-2") == net2TD }, wait, 10*time.Millisecond)
	meshtest.GatewayService(t, c1, "network-1", gw1)
	meshtest.GatewayService(t, c2, "network-2", gw2)

	_, err = c1.CreateService(ctx, "shop", "cart", map[string]string{"app": "cart"}, framework.ServicePort{Name: "tcp", Port: 80, TargetPort: 8080})
	require.NoError(t, err)
	_, err = c1.CreatePod(ctx, framework.PodOptions{Namespace: "shop", Name: "cart-0", Labels: map[string]string{"app": "cart"},
		ServiceAccount: "cart", Node: "node-1a", IP: cartApp.Addr(), Ready: true})
	require.NoError(t, err)
	_, err = c1.CreatePod(ctx, framework.PodOptions{Namespace: "shop", Name: "buyer-0", Labels: map[string]string{"app": "buyer"},
		ServiceAccount: "buyer", Node: "node-1a", IP: buyerIP, Ready: true})
	require.NoError(t, err)
	_, err = c2.CreateService(ctx, "front", "web", map[string]string{"app": "web"}, framework.ServicePort{Name: "tcp", Port: 80, TargetPort: 8080})
	require.NoError(t, err)
	_, err = c2.CreatePod(ctx, framework.PodOptions{Namespace: "front", Name: "web-0", Labels: map[string]string{"app": "web"},
		ServiceAccount: "web", Node: "node-2a", IP: webApp.Addr(), Ready: true})
	require.NoError(t, err)
	meshtest.EchoApp(t, cartApp, "cart-0")
	meshtest.EchoApp(t, webApp, "web-0")

	// Each ztunnel reads the trust bundle pilot publishes to its cluster.
	bundle := func(c *framework.Cluster) []byte {
		var data string
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			cm, err := c.Client.CoreV1().ConfigMaps(meshtest.Namespace).Get(ctx, ca.DefaultRootConfigMap, metav1.GetOptions{})
			require.NoError(ct, err)
			b, err := spiffe.ParseTrustBundle([]byte(cm.Data[ca.TrustBundleKey]))
			require.NoError(ct, err)
			require.Equal(ct, []string{"cluster.local", net2TD}, b.Domains())
			data = cm.Data[ca.TrustBundleKey]
		}, wait, 20*time.Millisecond, "trust bundle published to %s", c.Name)
		return []byte(data)
	}
	b1, b2 := bundle(c1), bundle(c2)
	zt := func(c *framework.Cluster, mode node.Mode, name, nodeName, sa, network, td string, ip netip.Addr, b []byte) *meshtest.Ztunnel {
		tok := meshtest.ProxyPod(t, c, name, nodeName, sa, ip)
		return meshtest.RunZtunnel(t, p, pilotIP, meshtest.ZtunnelOptions{Mode: mode, Cluster: c.Name, Network: network, Node: nodeName,
			ServiceAccount: sa, Token: tok, IP: ip, TrustDomain: td, TrustBundle: b})
	}
	z1 := zt(c1, node.ModeNode, "ztunnel-node-1a", "node-1a", "ztunnel", "network-1", "cluster.local", node1, b1)
	zt(c1, node.ModeGateway, "eastwest-gateway-1", "gw-node-1", "eastwest-gateway", "network-1", "cluster.local", gw1, b1)
	z2 := zt(c2, node.ModeNode, "ztunnel-node-2a", "node-2a", "ztunnel", "network-2", net2TD, node2, b2)
	zt(c2, node.ModeGateway, "eastwest-gateway-2", "gw-node-2", "eastwest-gateway", "network-2", net2TD, gw2, b2)

	request := func(z *meshtest.Ztunnel, src netip.Addr, host, msg string) (string, error) {
		c, err := meshtest.DialVia(t.Context(), z, src, host)
		if err != nil {
			return "", err
		}
		defer c.Close()
		return meshtest.Exchange(c, msg)
	}
	reaches := func(t *testing.T, z *meshtest.Ztunnel, src netip.Addr, host, want string) {
		t.Helper()
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			got, err := request(z, src, host, "hello")
			require.NoError(ct, err)
			require.Equal(ct, want+" got hello", got)
		}, wait, 20*time.Millisecond)
	}
	t.Run("network-2 reaches network-1 through network-1's gateway", func(t *testing.T) {
		reaches(t, z2, webApp.Addr(), cartHost, "cart-0")
	})
	t.Run("network-1 reaches network-2 through network-2's gateway", func(t *testing.T) {
		reaches(t, z1, buyerIP, webHost, "web-0")
	})
	t.Run("cluster-2's identities are network-2's, signed by its own root", func(t *testing.T) {
		w, ok := z2.Node.Store().Load().WorkloadByAddr(webApp.Addr())
		require.True(t, ok)
		require.Equal(t, net2TD, w.TrustDomain)
		web := identity.Identity{TrustDomain: net2TD, Namespace: "front", ServiceAccount: "web"}
		cert, err := z2.Node.Certs().Certificate(t.Context(), web)
		require.NoError(t, err)
		var chain []*x509.Certificate
		for _, der := range cert.Certificate {
			c, err := x509.ParseCertificate(der)
			require.NoError(t, err)
			chain = append(chain, c)
		}
		own, err := spiffe.TrustBundleFromPEM(net2TD, material[ca.RootCertKey])
		require.NoError(t, err)
		id, err := own.Verify(chain, time.Now())
		require.NoError(t, err)
		require.Equal(t, web, id)
		mesh, err := spiffe.TrustBundleFromPEM(net2TD, p.CA.Roots())
		require.NoError(t, err)
		_, err = mesh.Verify(chain, time.Now())
		require.ErrorIs(t, err, spiffe.ErrUntrusted, "not signed by the mesh's root")
	})

	// web-0 runs as spiffe://network-2.example/ns/front/sa/web: a
	// principal written in the mesh's domain matches it through the alias.
	policies, err := versioned.NewForConfig(c1.Config)
	require.NoError(t, err)
	apply := func(spec string) {
		ap := &securityclient.AuthorizationPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "cart-callers"}}
		require.NoError(t, yaml.Unmarshal([]byte(spec), &ap.Spec))
		cur, err := policies.SecurityV1().AuthorizationPolicies("shop").Get(ctx, ap.Name, metav1.GetOptions{})
		if err == nil {
			ap.ResourceVersion = cur.ResourceVersion
			_, err = policies.SecurityV1().AuthorizationPolicies("shop").Update(ctx, ap, metav1.UpdateOptions{})
		} else {
			_, err = policies.SecurityV1().AuthorizationPolicies("shop").Create(ctx, ap, metav1.CreateOptions{})
		}
		require.NoError(t, err)
	}
	t.Run("an ALLOW of another account refuses web", func(t *testing.T) {
		apply(`{selector: {matchLabels: {app: cart}}, rules: [{from: [{source: {principals: ["cluster.local/ns/front/sa/nobody"]}}]}]}`)
		require.Eventually(t, func() bool {
			_, err := request(z2, webApp.Addr(), cartHost, "hello")
			return err != nil
		}, wait, 20*time.Millisecond)
	})
	t.Run("an ALLOW of the mesh domain's principal admits web's alias identity", func(t *testing.T) {
		apply(`{selector: {matchLabels: {app: cart}}, rules: [{from: [{source: {principals: ["cluster.local/ns/front/sa/web"]}}]}]}`)
		reaches(t, z2, webApp.Addr(), cartHost, "cart-0")
	})
}
