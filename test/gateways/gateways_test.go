// Package gateways_test is the acceptance test of east-west gateways
// declared with the Gateway API: real API servers with the Gateway API
// CRDs of the sigs.k8s.io/gateway-api module, pilot in-process on the
// config cluster (cluster-1, network-1) with cluster-2 (network-2) as a
// remote reached with the reader identity, node ztunnels in-process on
// loopback addresses, and the gateway pilot deploys for a Gateway in
// cluster-2 started from its Deployment by a test kubelet.
package gateways_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	gwv1 "sigs.k8s.io/gateway-api/apis/v1"

	"github.com/isthmus-mesh/isthmus/pilot/eastwest"
	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/test/meshtest"
	"github.com/isthmus-mesh/isthmus/ztunnel/node"
)

const (
	cartHost = "cart.shop.svc.cluster.local:80"
	wait     = time.Minute
	poll     = 20 * time.Millisecond
)

// hboneGateway is a Gateway of the class in ns serving network.
func hboneGateway(ns, name, network string) *gwv1.Gateway {
	gw := &gwv1.Gateway{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: gwv1.GatewaySpec{GatewayClassName: eastwest.ClassName,
			Listeners: []gwv1.Listener{{Name: "hbone", Port: eastwest.HBONEPort, Protocol: eastwest.HBONEProtocol}}},
	}
	if network != "" {
		gw.Labels = map[string]string{eastwest.NetworkLabel: network}
	}
	return gw
}

// condition returns the Gateway's condition t (nil when absent or the
// Gateway cannot be read).
func condition(ctx context.Context, cl client.Client, key client.ObjectKey, t gwv1.GatewayConditionType) (*metav1.Condition, *gwv1.Gateway) {
	var gw gwv1.Gateway
	if err := cl.Get(ctx, key, &gw); err != nil {
		return nil, nil
	}
	return meta.FindStatusCondition(gw.Status.Conditions, string(t)), &gw
}

// refused waits until the Gateway key is Accepted=False for reason, and
// checks nothing was deployed for it.
func refused(t *testing.T, cl client.Client, key client.ObjectKey, reason string) {
	t.Helper()
	ctx := t.Context()
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		cond, _ := condition(ctx, cl, key, gwv1.GatewayConditionAccepted)
		require.NotNil(c, cond)
		require.Equal(c, metav1.ConditionFalse, cond.Status)
		require.Equal(c, reason, cond.Reason)
		prog, _ := condition(ctx, cl, key, gwv1.GatewayConditionProgrammed)
		require.NotNil(c, prog)
		require.Equal(c, metav1.ConditionFalse, prog.Status)
	}, wait, poll)
	var deps appsv1.DeploymentList
	require.NoError(t, cl.List(ctx, &deps, client.InNamespace(key.Namespace)))
	require.Empty(t, deps.Items, "nothing is deployed for a refused Gateway")
	var svcs corev1.ServiceList
	require.NoError(t, cl.List(ctx, &svcs, client.InNamespace(key.Namespace), client.MatchingLabels{gwv1.GatewayNameLabelKey: key.Name}))
	require.Empty(t, svcs.Items, "no gateway Service for a refused Gateway")
}

// mesh is the running federation of the test: pilot on cluster-1, web-0
// in cluster-1 (network-1) calling cart in cluster-2 (network-2), whose
// only way in is network-2's gateway.
type mesh struct {
	c1, c2   *framework.Cluster
	cl1, cl2 client.Client
	pilot    *server.Server
	src      *meshtest.Ztunnel
	webIP    netip.Addr
	addrs    *meshtest.Addrs
}

// startMesh installs the CRDs, runs pilot with cluster-2 registered, and
// the workloads and node ztunnels of both clusters.
func startMesh(t *testing.T) *mesh {
	ctx := t.Context()
	m := &mesh{c1: clusters.Cluster("cluster-1"), c2: clusters.Cluster("cluster-2"), addrs: meshtest.NewAddrs()}
	gatewayAPICRDs(t)
	for _, c := range []*framework.Cluster{m.c1, m.c2} {
		require.NoError(t, c.InstallCRDs("../../manifests/base/crds"))
		require.NoError(t, c.EnsureNamespace(ctx, cpNS, nil))
	}
	require.NoError(t, m.c2.EnsureNamespace(ctx, "shop", nil))
	require.NoError(t, m.c2.EnsureNamespace(ctx, "tenant", nil))
	require.NoError(t, m.c1.EnsureNamespace(ctx, "front", nil))
	pilotIP, node1, node2 := m.addrs.Next(), m.addrs.Next(), m.addrs.Next()
	m.webIP = m.addrs.Next()
	cartApp := netip.AddrPortFrom(m.addrs.Next(), 8080)

	m.pilot = runPilot(t, pilotIP)
	// Pilot reaches cluster-2 with the reader identity
	// (remotesecret.ReaderRules) only.
	meshtest.RegisterRemote(t, m.c1, m.c2, "cluster-2", "network-2", nil)
	m.cl1, m.cl2 = runtimeClient(t, m.c1), runtimeClient(t, m.c2)

	_, err := m.c2.CreateService(ctx, "shop", "cart", map[string]string{"app": "cart"}, framework.ServicePort{Name: "tcp", Port: 80, TargetPort: 8080})
	require.NoError(t, err)
	_, err = m.c2.CreatePod(ctx, framework.PodOptions{Namespace: "shop", Name: "cart-0", Labels: map[string]string{"app": "cart"},
		ServiceAccount: "cart", Node: "node-2a", IP: cartApp.Addr(), Ready: true})
	require.NoError(t, err)
	_, err = m.c1.CreatePod(ctx, framework.PodOptions{Namespace: "front", Name: "web-0", Labels: map[string]string{"app": "web"},
		ServiceAccount: "web", Node: "node-1a", IP: m.webIP, Ready: true})
	require.NoError(t, err)
	meshtest.EchoApp(t, cartApp, "cart-0")
	m.src = meshtest.RunZtunnel(t, m.pilot, pilotIP, meshtest.ZtunnelOptions{Mode: node.ModeNode, Cluster: "cluster-1", Network: "network-1",
		Node: "node-1a", ServiceAccount: "ztunnel", IP: node1, Token: meshtest.ProxyPod(t, m.c1, "ztunnel-node-1a", "node-1a", "ztunnel", node1)})
	meshtest.RunZtunnel(t, m.pilot, pilotIP, meshtest.ZtunnelOptions{Mode: node.ModeNode, Cluster: "cluster-2", Network: "network-2",
		Node: "node-2a", ServiceAccount: "ztunnel", IP: node2, Token: meshtest.ProxyPod(t, m.c2, "ztunnel-node-2a", "node-2a", "ztunnel", node2)})
	return m
}

// request sends one line from web-0 to cart and returns the answer.
func (m *mesh) request(ctx context.Context, msg string) (string, error) {
	c, err := meshtest.DialVia(ctx, m.src, m.webIP, cartHost)
	if err != nil {
		return "", err
	}
	defer c.Close()
	return meshtest.Exchange(c, msg)
}

// TestGatewayAPIEastWest runs pilot once and checks, in order: the class in
// every cluster; Gateways refused outside the gateway namespaces or
// without a network; a Gateway in the remote cluster deployed, its status,
// cross-network traffic through the gateway started from its Deployment;
// and its deletion removing what was deployed.
func TestGatewayAPIEastWest(t *testing.T) {
	ctx := t.Context()
	m := startMesh(t)

	t.Run("class in every cluster", func(t *testing.T) {
		for name, cl := range map[string]client.Client{"cluster-1": m.cl1, "cluster-2": m.cl2} {
			require.EventuallyWithT(t, func(c *assert.CollectT) {
				var gc gwv1.GatewayClass
				require.NoError(c, cl.Get(ctx, client.ObjectKey{Name: eastwest.ClassName}, &gc))
				require.Equal(c, gwv1.GatewayController(eastwest.ControllerName), gc.Spec.ControllerName)
				require.True(c, meta.IsStatusConditionTrue(gc.Status.Conditions, string(gwv1.GatewayClassConditionStatusAccepted)))
			}, wait, poll, "GatewayClass in %s", name)
		}
	})
	t.Run("refused outside the gateway namespaces", func(t *testing.T) {
		gw := hboneGateway("tenant", "sneaky", "network-2")
		require.NoError(t, m.cl2.Create(ctx, gw))
		refused(t, m.cl2, client.ObjectKeyFromObject(gw), eastwest.ReasonUntrustedNamespace)
	})
	t.Run("refused without a network", func(t *testing.T) {
		gw := hboneGateway(cpNS, "nameless", "")
		require.NoError(t, m.cl2.Create(ctx, gw))
		refused(t, m.cl2, client.ObjectKeyFromObject(gw), string(gwv1.GatewayReasonInvalid))
		require.NoError(t, m.cl2.Delete(ctx, gw))
	})

	gw := hboneGateway(cpNS, "eastwest", "network-2")
	// Istio's east-west gateway declares its SNI passthrough port too.
	passthrough := gwv1.TLSModePassthrough
	gw.Spec.Listeners = append(gw.Spec.Listeners, gwv1.Listener{Name: "tls", Port: eastwest.TLSPassthroughPort, Protocol: gwv1.TLSProtocolType,
		TLS: &gwv1.ListenerTLSConfig{Mode: &passthrough}})
	var gwPod *pod
	t.Run("remote Gateway carries cross-network traffic", func(t *testing.T) { gwPod = m.serveGateway(t, gw) })
	require.NotNil(t, gwPod, "the gateway ran")
	t.Run("deleting the Gateway removes what pilot deployed", func(t *testing.T) { m.deleteGateway(t, gw, gwPod) })
}

// serveGateway creates gw in cluster-2 and follows it: deployed, Accepted;
// an address but no replica, not Programmed; the gateway started from the
// Deployment; Programmed with its address; web-0 reaches cart through it.
func (m *mesh) serveGateway(t *testing.T, gw *gwv1.Gateway) *pod {
	ctx := t.Context()
	key, name := client.ObjectKeyFromObject(gw), eastwest.ObjectName(gw.Name)
	require.NoError(t, m.cl2.Create(ctx, gw))
	var dep appsv1.Deployment
	for _, o := range []client.Object{&corev1.ServiceAccount{}, &dep, &corev1.Service{}} {
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			require.NoError(c, m.cl2.Get(ctx, client.ObjectKey{Namespace: cpNS, Name: name}, o))
		}, wait, poll, "pilot deploys the gateway: %T", o)
		require.Equal(t, gwv1.GroupVersion.String(), o.GetOwnerReferences()[0].APIVersion, "%T owned by the Gateway", o)
		require.Equal(t, gw.UID, o.GetOwnerReferences()[0].UID, "%T owned by the Gateway", o)
	}
	m.programmed(t, key, metav1.ConditionFalse, string(gwv1.GatewayReasonAddressNotAssigned), "Accepted, no address yet")
	_, err := m.request(ctx, "early")
	require.Error(t, err, "no path to network-2 before its gateway has an address")

	// The cloud's load balancer: the Service's address is the pod's.
	gwIP := m.addrs.Next()
	var svc corev1.Service
	require.NoError(t, m.cl2.Get(ctx, client.ObjectKey{Namespace: cpNS, Name: name}, &svc))
	svc.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{{IP: gwIP.String()}}
	require.NoError(t, m.cl2.Status().Update(ctx, &svc))
	m.programmed(t, key, metav1.ConditionFalse, string(gwv1.GatewayReasonPending), "an address, no available replica yet")

	k := &kubelet{t: t, c: m.c2, nodeName: "gw-node-2", ip: gwIP, dns: map[string]string{pilotName + ":15012": m.pilot.GRPCAddr()}}
	gwPod := k.start(&dep)
	g := m.programmed(t, key, metav1.ConditionTrue, string(gwv1.GatewayReasonProgrammed), "the Service's address, an available replica")
	require.Len(t, g.Status.Addresses, 1)
	require.Equal(t, gwIP.String(), g.Status.Addresses[0].Value)
	require.Len(t, g.Status.Listeners, len(gw.Spec.Listeners))
	for _, l := range g.Status.Listeners {
		require.True(t, meta.IsStatusConditionTrue(l.Conditions, string(gwv1.ListenerConditionProgrammed)), "listener %s", l.Name)
	}
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		got, err := m.request(ctx, "hello")
		require.NoError(c, err)
		require.Equal(c, "cart-0 got hello", got)
	}, wait, poll, "web-0 (network-1) reaches cart-0 (network-2) through the gateway")
	return gwPod
}

// programmed waits until the Gateway key is Accepted and its Programmed
// condition has status and reason, and returns it.
func (m *mesh) programmed(t *testing.T, key client.ObjectKey, status metav1.ConditionStatus, reason, why string) *gwv1.Gateway {
	t.Helper()
	var gw *gwv1.Gateway
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		acc, _ := condition(t.Context(), m.cl2, key, gwv1.GatewayConditionAccepted)
		require.NotNil(c, acc)
		require.Equal(c, metav1.ConditionTrue, acc.Status)
		var prog *metav1.Condition
		prog, gw = condition(t.Context(), m.cl2, key, gwv1.GatewayConditionProgrammed)
		require.NotNil(c, prog)
		require.Equal(c, status, prog.Status)
		require.Equal(c, reason, prog.Reason)
	}, wait, poll, why)
	return gw
}

// deleteGateway deletes gw and checks what pilot deployed for it goes (no
// garbage collector runs here: pilot removes it), then stops the gateway
// as the kubelet would and checks network-2 is out of reach.
func (m *mesh) deleteGateway(t *testing.T, gw *gwv1.Gateway, gwPod *pod) {
	ctx := t.Context()
	require.NoError(t, m.cl2.Delete(ctx, gw))
	name := eastwest.ObjectName(gw.Name)
	for _, o := range []client.Object{&corev1.ServiceAccount{}, &appsv1.Deployment{}, &corev1.Service{}} {
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			err := m.cl2.Get(ctx, client.ObjectKey{Namespace: cpNS, Name: name}, o)
			require.True(c, apierrors.IsNotFound(err), "%T: %v", o, err)
		}, wait, poll, "%T removed", o)
	}
	gwPod.stop()
	require.NoError(t, m.c2.Client.CoreV1().Pods(cpNS).Delete(ctx, gwPod.obj.Name, metav1.DeleteOptions{}))
	require.Eventually(t, func() bool {
		_, err := m.request(ctx, "late")
		return err != nil
	}, wait, poll, "no path to network-2 once its gateway is gone")
}
