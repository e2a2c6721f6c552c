// Package authz_test is the acceptance test of L4 authorization across
// clusters: real API servers, pilot, node ztunnels and an east-west gateway
// in-process on loopback addresses, a client in cluster-2 (network-2)
// reaching a workload in cluster-1 through network-1's gateway, and policies
// created in the config cluster.
package authz_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"istio.io/api/security/v1beta1"
	securityclient "istio.io/client-go/pkg/apis/security/v1"
	"istio.io/client-go/pkg/clientset/versioned"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/test/meshtest"
	"github.com/isthmus-mesh/isthmus/ztunnel/authz"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/node"
)

const (
	cartHost  = "cart.shop.svc.cluster.local:80"
	cartUID   = "cluster-1/shop/cart-0"
	webPeer   = "cluster.local/ns/front/sa/web"
	allowWait = 30 * time.Second
)

var spiffeWeb = identity.Identity{TrustDomain: "cluster.local", Namespace: "front", ServiceAccount: "web"}

// mesh is the running federation of the test.
type mesh struct {
	client  versioned.Interface // the config cluster's security.istio.io
	dst     *meshtest.Ztunnel   // node-1a, cluster-1: runs cart-0
	src     *meshtest.Ztunnel   // node-2a, cluster-2: runs web-0
	gw      *meshtest.Ztunnel   // network-1's east-west gateway
	webIP   netip.Addr
	cartApp netip.AddrPort
	debug   string // pilot's debug URL
}

func startMesh(t *testing.T) *mesh {
	ctx := context.Background()
	c1, c2 := clusters.Cluster("cluster-1"), clusters.Cluster("cluster-2")
	require.NoError(t, c1.InstallCRDs("../../manifests/base/crds"))
	for _, c := range []*framework.Cluster{c1, c2} {
		require.NoError(t, c.EnsureNamespace(ctx, meshtest.Namespace, nil))
	}
	require.NoError(t, c1.EnsureNamespace(ctx, "shop", nil))
	require.NoError(t, c2.EnsureNamespace(ctx, "front", nil))
	a := meshtest.NewAddrs()
	pilotIP, node1, node2, gw1 := a.Next(), a.Next(), a.Next(), a.Next()
	m := &mesh{webIP: a.Next(), cartApp: netip.AddrPortFrom(a.Next(), 8080)}

	p := meshtest.RunPilot(t, c1, pilotIP, nil)
	m.debug = "http://" + p.DebugAddr()
	meshtest.RegisterRemote(t, c1, c2, "cluster-2", "network-2", nil)
	meshtest.GatewayService(t, c1, "network-1", gw1)
	_, err := c1.CreateService(ctx, "shop", "cart", map[string]string{"app": "cart"}, framework.ServicePort{Name: "tcp", Port: 80, TargetPort: 8080})
	require.NoError(t, err)
	_, err = c1.CreatePod(ctx, framework.PodOptions{Namespace: "shop", Name: "cart-0", Labels: map[string]string{"app": "cart"},
		ServiceAccount: "cart", Node: "node-1a", IP: m.cartApp.Addr(), Ready: true})
	require.NoError(t, err)
	_, err = c2.CreatePod(ctx, framework.PodOptions{Namespace: "front", Name: "web-0", Labels: map[string]string{"app": "web"},
		ServiceAccount: "web", Node: "node-2a", IP: m.webIP, Ready: true})
	require.NoError(t, err)
	meshtest.EchoApp(t, m.cartApp, "cart-0")

	tok1 := meshtest.ProxyPod(t, c1, "ztunnel-node-1a", "node-1a", "ztunnel", node1)
	tok2 := meshtest.ProxyPod(t, c2, "ztunnel-node-2a", "node-2a", "ztunnel", node2)
	tokGW := meshtest.ProxyPod(t, c1, "eastwest-gateway-0", "gw-node-1", "eastwest-gateway", gw1)
	m.dst = meshtest.RunZtunnel(t, p, pilotIP, meshtest.ZtunnelOptions{Mode: node.ModeNode, Cluster: "cluster-1", Network: "network-1",
		Node: "node-1a", ServiceAccount: "ztunnel", Token: tok1, IP: node1})
	m.gw = meshtest.RunZtunnel(t, p, pilotIP, meshtest.ZtunnelOptions{Mode: node.ModeGateway, Cluster: "cluster-1", Network: "network-1",
		Node: "gw-node-1", ServiceAccount: "eastwest-gateway", Token: tokGW, IP: gw1})
	m.src = meshtest.RunZtunnel(t, p, pilotIP, meshtest.ZtunnelOptions{Mode: node.ModeNode, Cluster: "cluster-2", Network: "network-2",
		Node: "node-2a", ServiceAccount: "ztunnel", Token: tok2, IP: node2})
	m.client, err = versioned.NewForConfig(c1.Config)
	require.NoError(t, err)
	return m
}

// request opens a connection from web-0 to cart and exchanges one line.
func (m *mesh) request(ctx context.Context, msg string) (string, error) {
	c, err := meshtest.DialVia(ctx, m.src, m.webIP, cartHost)
	if err != nil {
		return "", err
	}
	defer c.Close()
	return meshtest.Exchange(c, msg)
}

// allowed waits until web-0 reaches cart; refused until it cannot.
func (m *mesh) allowed(t *testing.T, why string) {
	t.Helper()
	ok := assert.EventuallyWithT(t, func(c *assert.CollectT) {
		got, err := m.request(t.Context(), "hello")
		require.NoError(c, err)
		require.Equal(c, "cart-0 got hello", got)
	}, allowWait, 20*time.Millisecond, why)
	if !ok {
		m.explain(t)
		t.FailNow()
	}
}

// explain logs how the destination's ztunnel now judges web-0's
// connections, and what it holds.
func (m *mesh) explain(t *testing.T) {
	t.Helper()
	store := m.dst.Node.Authorizer().Store()
	ex := store.Load().Explain(authz.Conn{Workload: cartUID, Peer: spiffeWeb, DestinationIP: m.cartApp.Addr(), DestinationPort: m.cartApp.Port()})
	t.Logf("destination ztunnel: %+v; holds %v", ex, store.Versions())
}

func (m *mesh) refused(t *testing.T, why string) {
	t.Helper()
	require.Eventually(t, func() bool {
		_, err := m.request(t.Context(), "hello")
		return err != nil
	}, allowWait, 20*time.Millisecond, why)
	// Once refused, every new connection is.
	for range 3 {
		_, err := m.request(t.Context(), "again")
		require.Error(t, err, why)
	}
}

// apply creates or replaces an AuthorizationPolicy of the config cluster
// from YAML; it is deleted when the (sub)test ends, so that a failure does
// not leak into the next one.
func (m *mesh) apply(t *testing.T, ns, name, spec string) {
	t.Helper()
	t.Cleanup(func() {
		err := m.client.SecurityV1().AuthorizationPolicies(ns).Delete(context.Background(), name, metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete policy %s/%s: %v", ns, name, err)
		}
	})
	ap := &securityclient.AuthorizationPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
	require.NoError(t, yaml.Unmarshal([]byte(spec), &ap.Spec))
	ctx := t.Context()
	cur, err := m.client.SecurityV1().AuthorizationPolicies(ns).Get(ctx, name, metav1.GetOptions{})
	if err == nil {
		ap.ResourceVersion = cur.ResourceVersion
		_, err = m.client.SecurityV1().AuthorizationPolicies(ns).Update(ctx, ap, metav1.UpdateOptions{})
	} else {
		_, err = m.client.SecurityV1().AuthorizationPolicies(ns).Create(ctx, ap, metav1.CreateOptions{})
	}
	require.NoError(t, err)
}

func (m *mesh) remove(t *testing.T, ns, name string) {
	t.Helper()
	require.NoError(t, m.client.SecurityV1().AuthorizationPolicies(ns).Delete(t.Context(), name, metav1.DeleteOptions{}))
}

// denied returns isthmus_authz_denied_total of the destination ztunnel.
func (m *mesh) denied(t *testing.T, ns, name, reason string) float64 {
	return meshtest.Counter(t, m.dst.Metrics, "isthmus_authz_denied_total", map[string]string{"namespace": ns, "policy": name, "reason": reason})
}

// TestAuthorizationAcrossClusters is the acceptance test: a client in
// cluster-2 (network-2) reaching cart in cluster-1 through network-1's
// gateway is refused by a DENY policy created in the config cluster,
// allowed by an ALLOW naming its principal, refused by a namespace-wide
// ALLOW that does not match it and by a DENY mentioning an L7 attribute; a
// change applies to new connections and closes open ones it now refuses;
// every refusal is counted by policy and reason.
func TestAuthorizationAcrossClusters(t *testing.T) {
	m := startMesh(t)
	m.allowed(t, "no policy: allowed")

	t.Run("DENY from the config cluster closes the open connection and refuses new ones", func(t *testing.T) {
		open, err := meshtest.DialVia(t.Context(), m.src, m.webIP, cartHost)
		require.NoError(t, err)
		defer open.Close()
		got, err := meshtest.Exchange(open, "before")
		require.NoError(t, err)
		require.Equal(t, "cart-0 got before", got)

		m.apply(t, "shop", "deny-web", `
action: DENY
rules: [{from: [{source: {principals: ["`+webPeer+`"]}}]}]`)
		m.refused(t, "DENY naming web's principal")
		// The connection opened before the policy is closed by it.
		_ = open.SetReadDeadline(time.Now().Add(allowWait))
		_, err = io.ReadAll(open)
		if err == nil {
			_, err = meshtest.Exchange(open, "after")
		}
		require.Error(t, err, "the open connection is closed")
		require.Positive(t, m.denied(t, "shop", "deny-web", authz.ReasonDenyPolicy))
		// At least the open one (a connection the check loop closed may
		// still have been open on the destination's side).
		require.GreaterOrEqual(t, meshtest.Counter(t, m.dst.Metrics, "isthmus_authz_revoked_total",
			map[string]string{"namespace": "shop", "policy": "deny-web", "reason": authz.ReasonDenyPolicy}), 1.0)
		m.remove(t, "shop", "deny-web")
		m.allowed(t, "DENY removed")
	})

	t.Run("a namespace-wide ALLOW that does not match refuses", func(t *testing.T) {
		m.apply(t, "shop", "only-back", `
rules: [{from: [{source: {namespaces: ["back"]}}]}]`)
		m.refused(t, "namespace-wide ALLOW of namespace back")
		require.Positive(t, m.denied(t, "", "", authz.ReasonAllowUnmatched))
		m.remove(t, "shop", "only-back")
		m.allowed(t, "ALLOW removed")
	})

	t.Run("ALLOW naming the principal allows", func(t *testing.T) {
		// With an ALLOW that does not match web in force, web is refused
		// until an ALLOW names its principal.
		m.apply(t, "shop", "only-back", `
rules: [{from: [{source: {namespaces: ["back"]}}]}]`)
		m.apply(t, "shop", "cart-callers", `
selector: {matchLabels: {app: cart}}
rules: [{from: [{source: {principals: ["cluster.local/ns/shop/sa/admin"]}}]}]`)
		m.refused(t, "ALLOW policies apply, none names web")
		m.apply(t, "shop", "cart-callers", `
selector: {matchLabels: {app: cart}}
rules: [{from: [{source: {principals: ["spiffe://`+webPeer+`", "cluster.local/ns/shop/sa/admin"]}}], to: [{operation: {ports: ["8080"]}}]}]`)
		m.allowed(t, "ALLOW naming web")
		d := m.dst.Node.Authorizer().Check(authz.Conn{Workload: cartUID, Peer: spiffeWeb, DestinationIP: m.cartApp.Addr(), DestinationPort: m.cartApp.Port()})
		require.Equal(t, authz.Decision{Allowed: true, Namespace: "shop", Name: "cart-callers"}, d, "allowed by the ALLOW naming web")
	})

	t.Run("a DENY mentioning an L7 attribute still denies", func(t *testing.T) {
		m.apply(t, "shop", "no-post", `
action: DENY
rules: [{from: [{source: {namespaces: ["front"]}}], to: [{operation: {methods: ["POST"]}}]}]`)
		m.refused(t, "DENY with methods denies at L4")
		require.Positive(t, m.denied(t, "shop", "no-post", authz.ReasonDenyPolicy))
		// Pilot reports what it does not enforce as written.
		var sum struct {
			AuthorizationPolicies []struct {
				Name     string
				Problems []struct{ Reason, Field string }
			}
		}
		getJSON(t, m.debug+"/debug/authorizationz", &sum)
		var found bool
		for _, p := range sum.AuthorizationPolicies {
			if p.Name == "no-post" {
				found = true
				require.Equal(t, "unsupported_attribute", p.Problems[0].Reason)
				require.Equal(t, "rules[0].to[0].operation.methods", p.Problems[0].Field)
			}
		}
		require.True(t, found)
		m.remove(t, "shop", "no-post")
		m.allowed(t, "DENY removed")
	})

	t.Run("PeerAuthentication governs the plaintext path", func(t *testing.T) {
		listen := netip.AddrPortFrom(m.cartApp.Addr(), 15006)
		plaintextPort(t, m.dst.Node.Authorizer(), cartUID, listen, m.cartApp)
		client := func() (string, error) {
			c, err := net.DialTimeout("tcp", listen.String(), 5*time.Second)
			if err != nil {
				return "", err
			}
			defer c.Close()
			return meshtest.Exchange(c, "plain")
		}
		// STRICT by default: refused, and counted.
		_, err := client()
		require.Error(t, err)
		require.Positive(t, m.denied(t, "", "", authz.ReasonMTLSRequired))

		perm := &securityclient.PeerAuthentication{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "permissive"}}
		perm.Spec.Mtls = &v1beta1.PeerAuthentication_MutualTLS{Mode: v1beta1.PeerAuthentication_MutualTLS_PERMISSIVE}
		_, err = m.client.SecurityV1().PeerAuthentications("shop").Create(t.Context(), perm, metav1.CreateOptions{})
		require.NoError(t, err)
		t.Cleanup(func() {
			err := m.client.SecurityV1().PeerAuthentications("shop").Delete(context.Background(), "permissive", metav1.DeleteOptions{})
			if err != nil && !apierrors.IsNotFound(err) {
				t.Errorf("delete PeerAuthentication: %v", err)
			}
		})
		require.Eventually(t, func() bool {
			got, err := client()
			return err == nil && got == "cart-0 got plain"
		}, allowWait, 20*time.Millisecond, "PERMISSIVE lets plaintext in")

		// STRICT again: the open plaintext connection is closed.
		open, err := net.DialTimeout("tcp", listen.String(), 5*time.Second)
		require.NoError(t, err)
		defer open.Close()
		got, err := meshtest.Exchange(open, "open")
		require.NoError(t, err)
		require.Equal(t, "cart-0 got open", got)
		require.NoError(t, m.client.SecurityV1().PeerAuthentications("shop").Delete(t.Context(), "permissive", metav1.DeleteOptions{}))
		_ = open.SetReadDeadline(time.Now().Add(allowWait))
		_, err = io.ReadAll(open)
		if err == nil {
			_, err = meshtest.Exchange(open, "after")
		}
		require.Error(t, err)
		require.Equal(t, 1.0, meshtest.Counter(t, m.dst.Metrics, "isthmus_authz_revoked_total",
			map[string]string{"namespace": "", "policy": "", "reason": authz.ReasonMTLSRequired}))
	})

	t.Run("pilot explains a workload's policies", func(t *testing.T) {
		m.apply(t, "isthmus-system", "mesh-deny-guests", `
action: DENY
rules: [{from: [{source: {namespaces: ["guests"]}}]}]`)
		var wp struct {
			Workload  struct{ UID string }
			Resources []map[string]any
		}
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			resp, err := http.Get(m.debug + "/debug/authz?workload=" + cartUID)
			require.NoError(c, err)
			defer resp.Body.Close()
			require.Equal(c, http.StatusOK, resp.StatusCode)
			body, _ := io.ReadAll(resp.Body)
			require.Contains(c, string(body), "mesh-deny-guests")
			require.Contains(c, string(body), `"scope": "MESH"`)
		}, allowWait, 50*time.Millisecond)
		getJSON(t, m.debug+"/debug/authz?workload="+cartUID, &wp)
		require.Equal(t, cartUID, wp.Workload.UID)
		m.allowed(t, "a mesh-wide DENY of another namespace does not concern web")
	})
}

// plaintextPort is the test's stand-in for a pod's inbound plaintext
// listener (15006, which pod enrolment adds): each connection is admitted
// through the node's Authorizer as a plaintext connection to workload uid
// (the API the real listener uses), then relayed to app.
func plaintextPort(t *testing.T, a *authz.Enforcer, uid string, listen, app netip.AddrPort) {
	t.Helper()
	require.NotNil(t, a)
	ln, err := net.Listen("tcp", listen.String())
	require.NoError(t, err)
	var wg sync.WaitGroup
	ctx, cancel := context.WithCancel(context.Background())
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() { servePlaintext(ctx, a, uid, c, app) })
		}
	})
	t.Cleanup(func() {
		cancel()
		ln.Close()
		wg.Wait()
	})
}

func servePlaintext(ctx context.Context, a *authz.Enforcer, uid string, c net.Conn, app netip.AddrPort) {
	defer c.Close()
	remote := netip.MustParseAddrPort(c.RemoteAddr().String())
	release, err := a.Admit(ctx, authz.Conn{
		Workload: uid, Plaintext: true, SourceIP: remote.Addr(), DestinationIP: app.Addr(), DestinationPort: app.Port(),
	}, func() { c.Close() })
	if err != nil {
		return
	}
	defer release()
	up, err := net.DialTimeout("tcp", app.String(), 5*time.Second)
	if err != nil {
		return
	}
	defer up.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	done := make(chan struct{})
	go func() {
		_, _ = io.Copy(up, c)
		up.Close()
		close(done)
	}()
	_, _ = io.Copy(c, up)
	c.Close()
	<-done
}

func getJSON(t *testing.T, url string, into any) {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.NoError(t, yaml.Unmarshal(body, into))
}
