package controller_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/isthmus-mesh/isthmus/controller"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/registry"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// gatewayService creates a LoadBalancer Service labelled as network's
// east-west gateway, with an HBONE port and ingress address addr.
func gatewayService(t *testing.T, c *framework.Cluster, ns, name, network string, addr netip.Addr, annotations map[string]string) {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, c.EnsureNamespace(ctx, ns, nil))
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{controller.NetworkLabel: network}, Annotations: annotations},
		Spec: corev1.ServiceSpec{Type: corev1.ServiceTypeLoadBalancer, Selector: map[string]string{"app": name},
			Ports: []corev1.ServicePort{{Name: "tls-hbone", Port: 15008, TargetPort: intstr.FromInt32(15008)}}},
	}
	svc, err := c.Client.CoreV1().Services(ns).Create(ctx, svc, metav1.CreateOptions{})
	require.NoError(t, err)
	svc.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{{IP: addr.String()}}
	_, err = c.Client.CoreV1().Services(ns).UpdateStatus(ctx, svc, metav1.UpdateOptions{})
	require.NoError(t, err)
}

func gatewayBySource(gws []model.NetworkGateway, source string) (model.NetworkGateway, bool) {
	for _, g := range gws {
		if g.Source == source {
			return g, true
		}
	}
	return model.NetworkGateway{}, false
}

// TestOnlyTrustedGateways, as a tenant would try it: a Service in the
// tenant's own namespace, labelled with network-2 and given an external
// address, sorts before the real gateway but is only an ignored candidate;
// the real gateway, in the control-plane namespace, is trusted once its
// identity is known (its pods' service account, or an operator's
// annotation) and weighs as many as its ready pods.
func TestOnlyTrustedGateways(t *testing.T) {
	ctx := context.Background()
	c2 := clusters.Cluster("cluster-2")
	const cp = "fed-gwtrust"
	f := startFederation(t, cp, registry.Config{QuietPeriod: 10 * time.Millisecond}, controller.Config{})
	require.NoError(t, c2.EnsureNamespace(ctx, cp, nil))
	f.register(t, "cluster-2", "network-2")

	gatewayService(t, c2, "aaa-tenant", "eastwest", "network-2", netip.MustParseAddr("127.66.0.1"), nil)
	gatewayService(t, c2, cp, "eastwest", "network-2", netip.MustParseAddr("127.66.0.2"), nil)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		gws := f.reg.GatewaysOf("network-2")
		tenant, ok := gatewayBySource(gws, "aaa-tenant/eastwest")
		require.True(c, ok)
		require.Equal(c, model.GatewayIgnoredUntrustedNamespace, tenant.Ignored)
		real, ok := gatewayBySource(gws, cp+"/eastwest")
		require.True(c, ok)
		require.Equal(c, model.GatewayIgnoredNoIdentity, real.Ignored, "no pod and no annotation: nothing to verify it by")
	}, 10*time.Second, 5*time.Millisecond)

	// Its pods come up: trusted, with their service account and capacity.
	for i, ip := range []string{"127.66.1.1", "127.66.1.2"} {
		_, err := c2.CreatePod(ctx, framework.PodOptions{Namespace: cp, Name: "eastwest-" + string(rune('a'+i)), Labels: map[string]string{"app": "eastwest"},
			ServiceAccount: "eastwest-gateway", Node: "gw-node", IP: netip.MustParseAddr(ip), Ready: true})
		require.NoError(t, err)
	}
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		real, ok := gatewayBySource(f.reg.GatewaysOf("network-2"), cp+"/eastwest")
		require.True(c, ok)
		require.True(c, real.Trusted())
		require.Equal(c, []string{"eastwest-gateway"}, real.ServiceAccounts)
		require.Equal(c, uint32(2), real.Capacity)
		require.Equal(c, netip.MustParseAddr("127.66.0.2"), real.Address)
	}, 10*time.Second, 5*time.Millisecond)

	// A tenant pod labelled like the gateway's pods, in its own namespace,
	// changes nothing: a selector only reaches its own namespace.
	_, err := c2.CreatePod(ctx, framework.PodOptions{Namespace: "aaa-tenant", Name: "fake-gw", Labels: map[string]string{"app": "eastwest"},
		ServiceAccount: "evil", Node: "gw-node", IP: netip.MustParseAddr("127.66.1.9"), Ready: true})
	require.NoError(t, err)

	// An operator names the identity explicitly.
	gatewayService(t, c2, cp, "eastwest-lb", "network-2", netip.MustParseAddr("127.66.0.3"),
		map[string]string{model.GatewayServiceAccountsAnnotation: "lb-gw, lb-gw2"})
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		gws := f.reg.GatewaysOf("network-2")
		lb, ok := gatewayBySource(gws, cp+"/eastwest-lb")
		require.True(c, ok)
		require.True(c, lb.Trusted())
		require.Equal(c, []string{"lb-gw", "lb-gw2"}, lb.ServiceAccounts)
		real, _ := gatewayBySource(gws, cp+"/eastwest")
		require.Equal(c, []string{"eastwest-gateway"}, real.ServiceAccounts)
		tenant, _ := gatewayBySource(gws, "aaa-tenant/eastwest")
		require.False(c, tenant.Trusted())
	}, 10*time.Second, 5*time.Millisecond)
}

// TestGatewayNamespaceSelector: an operator trusts more namespaces by a
// label selector on namespaces (namespace labels are the cluster
// administrator's); labelling and unlabelling a namespace trusts and
// distrusts its gateways live.
func TestGatewayNamespaceSelector(t *testing.T) {
	ctx := context.Background()
	c2 := clusters.Cluster("cluster-2")
	const cp = "fed-gwsel"
	f := startFederation(t, cp, registry.Config{QuietPeriod: 10 * time.Millisecond},
		controller.Config{GatewayNamespaceSelector: labels.SelectorFromSet(labels.Set{"isthmus.io/gateways": "trusted"})})
	require.NoError(t, c2.EnsureNamespace(ctx, cp, nil))
	f.register(t, "cluster-2", "network-2")

	gatewayService(t, c2, "gw-team", "eastwest", "network-2", netip.MustParseAddr("127.66.2.1"),
		map[string]string{model.GatewayServiceAccountsAnnotation: "eastwest"})
	ignored := func(want string) {
		t.Helper()
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			g, ok := gatewayBySource(f.reg.GatewaysOf("network-2"), "gw-team/eastwest")
			require.True(c, ok)
			require.Equal(c, want, g.Ignored)
		}, 10*time.Second, 5*time.Millisecond)
	}
	ignored(model.GatewayIgnoredUntrustedNamespace)
	require.NoError(t, c2.EnsureNamespace(ctx, "gw-team", map[string]string{"isthmus.io/gateways": "trusted"}))
	ignored("")
	require.NoError(t, c2.EnsureNamespace(ctx, "gw-team", map[string]string{"isthmus.io/gateways": "no"}))
	ignored(model.GatewayIgnoredUntrustedNamespace)
}
