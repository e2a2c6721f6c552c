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
	"github.com/isthmus-mesh/isthmus/test/framework"
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

// TestGatewayAPIEastWest runs pilot once and checks, in order: the class in
// every cluster; Gateways refused outside the gateway namespaces or
// without a network; a Gateway in the remote cluster deployed, its status,
// cross-network traffic through the gateway started from its Deployment;
// and its deletion removing what was deployed.
func TestGatewayAPIEastWest(t *testing.T) {
	ctx := t.Context()
	c1, c2 := clusters.Cluster("cluster-1"), clusters.Cluster("cluster-2")
	gatewayAPICRDs(t)
	for _, c := range []*framework.Cluster{c1, c2} {
		require.NoError(t, c.InstallCRDs("../../manifests/base/crds"))
		require.NoError(t, c.EnsureNamespace(ctx, cpNS, nil))
	}
	require.NoError(t, c2.EnsureNamespace(ctx, "shop", nil))
	require.NoError(t, c2.EnsureNamespace(ctx, "tenant", nil))
	require.NoError(t, c1.EnsureNamespace(ctx, "front", nil))
	a := newAddrs()
	pilotIP, node1, node2, gwIP, webIP := a.next(), a.next(), a.next(), a.next(), a.next()
	cartApp := netip.AddrPortFrom(a.next(), 8080)

	p := runPilot(t, pilotIP)
	registerCluster2(t)
	cl1, cl2 := runtimeClient(t, c1), runtimeClient(t, c2)

	t.Run("class in every cluster", func(t *testing.T) {
		for name, cl := range map[string]client.Client{"cluster-1": cl1, "cluster-2": cl2} {
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
		require.NoError(t, cl2.Create(ctx, gw))
		refused(t, cl2, client.ObjectKeyFromObject(gw), eastwest.ReasonUntrustedNamespace)
	})

	t.Run("refused without a network", func(t *testing.T) {
		gw := hboneGateway(cpNS, "nameless", "")
		require.NoError(t, cl2.Create(ctx, gw))
		refused(t, cl2, client.ObjectKeyFromObject(gw), string(gwv1.GatewayReasonInvalid))
		require.NoError(t, cl2.Delete(ctx, gw))
	})

	// The workloads: web-0 in cluster-1 (network-1) calls cart in
	// cluster-2 (network-2), whose only way in is network-2's gateway.
	_, err := c2.CreateService(ctx, "shop", "cart", map[string]string{"app": "cart"}, framework.ServicePort{Name: "tcp", Port: 80, TargetPort: 8080})
	require.NoError(t, err)
	_, err = c2.CreatePod(ctx, framework.PodOptions{Namespace: "shop", Name: "cart-0", Labels: map[string]string{"app": "cart"},
		ServiceAccount: "cart", Node: "node-2a", IP: cartApp.Addr(), Ready: true})
	require.NoError(t, err)
	_, err = c1.CreatePod(ctx, framework.PodOptions{Namespace: "front", Name: "web-0", Labels: map[string]string{"app": "web"},
		ServiceAccount: "web", Node: "node-1a", IP: webIP, Ready: true})
	require.NoError(t, err)
	echoApp(t, cartApp, "cart-0")
	src := runZtunnel(t, p, pilotIP, "cluster-1", "network-1", "node-1a", proxyPod(t, c1, "ztunnel-node-1a", "node-1a", "ztunnel", node1), node1)
	runZtunnel(t, p, pilotIP, "cluster-2", "network-2", "node-2a", proxyPod(t, c2, "ztunnel-node-2a", "node-2a", "ztunnel", node2), node2)

	gw := hboneGateway(cpNS, "eastwest", "network-2")
	key := client.ObjectKeyFromObject(gw)
	name := eastwest.ObjectName(gw.Name)
	var gwPod *pod
	t.Run("remote Gateway carries cross-network traffic", func(t *testing.T) {
		require.NoError(t, cl2.Create(ctx, gw))
		var dep appsv1.Deployment
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			require.NoError(c, cl2.Get(ctx, client.ObjectKey{Namespace: cpNS, Name: name}, &dep))
		}, wait, poll, "pilot deploys the gateway")
		for _, o := range []client.Object{&corev1.ServiceAccount{}, &corev1.Service{}} {
			require.NoError(t, cl2.Get(ctx, client.ObjectKey{Namespace: cpNS, Name: name}, o))
			require.Equal(t, gwv1.GroupVersion.String(), o.GetOwnerReferences()[0].APIVersion, "%T owned by the Gateway", o)
		}
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			acc, _ := condition(ctx, cl2, key, gwv1.GatewayConditionAccepted)
			require.NotNil(c, acc)
			require.Equal(c, metav1.ConditionTrue, acc.Status)
			prog, _ := condition(ctx, cl2, key, gwv1.GatewayConditionProgrammed)
			require.NotNil(c, prog)
			require.Equal(c, string(gwv1.GatewayReasonAddressNotAssigned), prog.Reason)
		}, wait, poll, "Accepted, not yet Programmed")
		_, err := request(ctx, src, webIP, cartHost, "early")
		require.Error(t, err, "no path to network-2 before its gateway has an address")

		// The cloud's load balancer: the Service's address is the pod's.
		var svc corev1.Service
		require.NoError(t, cl2.Get(ctx, client.ObjectKey{Namespace: cpNS, Name: name}, &svc))
		svc.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{{IP: gwIP.String()}}
		require.NoError(t, cl2.Status().Update(ctx, &svc))
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			prog, g := condition(ctx, cl2, key, gwv1.GatewayConditionProgrammed)
			require.NotNil(c, prog)
			require.Equal(c, string(gwv1.GatewayReasonPending), prog.Reason)
			require.Len(c, g.Status.Addresses, 1)
		}, wait, poll, "an address, but no available replica yet: not Programmed")

		k := &kubelet{t: t, c: c2, nodeName: "gw-node-2", ip: gwIP, dns: map[string]string{pilotName + ":15012": p.GRPCAddr()}}
		gwPod = k.start(&dep)

		require.EventuallyWithT(t, func(c *assert.CollectT) {
			prog, g := condition(ctx, cl2, key, gwv1.GatewayConditionProgrammed)
			require.NotNil(c, prog)
			require.Equal(c, metav1.ConditionTrue, prog.Status)
			require.Len(c, g.Status.Addresses, 1)
			require.Equal(c, gwIP.String(), g.Status.Addresses[0].Value)
			require.Len(c, g.Status.Listeners, 1)
			require.True(c, meta.IsStatusConditionTrue(g.Status.Listeners[0].Conditions, string(gwv1.ListenerConditionProgrammed)))
		}, wait, poll, "Programmed: the Service's address, an available replica")
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			got, err := request(ctx, src, webIP, cartHost, "hello")
			require.NoError(c, err)
			require.Equal(c, "cart-0 got hello", got)
		}, wait, poll, "web-0 (network-1) reaches cart-0 (network-2) through the gateway")
	})
	require.NotNil(t, gwPod, "the gateway ran")

	t.Run("deleting the Gateway removes what pilot deployed", func(t *testing.T) {
		require.NoError(t, cl2.Delete(ctx, gw))
		// No garbage collector runs here: pilot removes them itself.
		for _, o := range []client.Object{&corev1.ServiceAccount{}, &appsv1.Deployment{}, &corev1.Service{}} {
			require.EventuallyWithT(t, func(c *assert.CollectT) {
				err := cl2.Get(ctx, client.ObjectKey{Namespace: cpNS, Name: name}, o)
				require.True(c, apierrors.IsNotFound(err), "%T: %v", o, err)
			}, wait, poll, "%T removed", o)
		}
		// The kubelet stops the pod of the deleted Deployment.
		gwPod.stop()
		require.NoError(t, c2.Client.CoreV1().Pods(cpNS).Delete(ctx, gwPod.obj.Name, metav1.DeleteOptions{}))
		require.Eventually(t, func() bool {
			_, err := request(ctx, src, webIP, cartHost, "late")
			return err != nil
		}, wait, poll, "no path to network-2 once its gateway is gone")
	})
}
