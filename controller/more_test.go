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
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/isthmus-mesh/isthmus/controller"
	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/registry"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// TestGatewaysAndSelectorlessServices: an east-west gateway Service is known
// per network, a selector-less service takes its endpoints from its
// EndpointSlices, and the control-plane namespace's network label sets the
// network of a cluster's pods.
func TestGatewaysAndSelectorlessServices(t *testing.T) {
	ctx := context.Background()
	c2 := clusters.Cluster("cluster-2")
	f := startFederation(t, "fed-gw", registry.Config{QuietPeriod: 10 * time.Millisecond}, controller.Config{})
	// The control-plane namespace of cluster-2 names its network.
	require.NoError(t, c2.EnsureNamespace(ctx, "fed-gw", map[string]string{controller.NetworkLabel: "network-7"}))
	f.register(t, "cluster-2", "network-2")

	require.NoError(t, c2.EnsureNamespace(ctx, "gw", nil))
	gw := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "eastwest", Namespace: "gw", Labels: map[string]string{controller.NetworkLabel: "network-7"}},
		Spec: corev1.ServiceSpec{Type: corev1.ServiceTypeLoadBalancer, Selector: map[string]string{"app": "eastwest"},
			Ports: []corev1.ServicePort{{Name: "tls-hbone", Port: 15008, TargetPort: intstr.FromInt32(15008)},
				{Name: "tls", Port: 15443, TargetPort: intstr.FromInt32(15443)}}},
	}
	gw, err := c2.Client.CoreV1().Services("gw").Create(ctx, gw, metav1.CreateOptions{})
	require.NoError(t, err)
	gw.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{{IP: "127.77.0.1"}}
	_, err = c2.Client.CoreV1().Services("gw").UpdateStatus(ctx, gw, metav1.UpdateOptions{})
	require.NoError(t, err)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		gws := f.reg.GatewaysOf("network-7")
		require.Len(c, gws, 1)
		// Outside the control-plane namespace: a candidate only (see
		// gateway_trust_test.go for trusted gateways).
		require.Equal(c, model.NetworkGateway{Network: "network-7", Cluster: "cluster-2", Address: netip.MustParseAddr("127.77.0.1"),
			HBONEPort: 15008, TLSPassthroughPort: 15443, Source: "gw/eastwest", Capacity: 1, Ignored: model.GatewayIgnoredUntrustedNamespace}, gws[0])
	}, 10*time.Second, 5*time.Millisecond)

	// A selector-less service with an EndpointSlice (addresses used as data only).
	_, err = c2.CreateService(ctx, "gw", "external-db", nil, framework.ServicePort{Name: "", Port: 5432, TargetPort: 5432})
	require.NoError(t, err)
	_, err = c2.CreateEndpointSlice(ctx, "gw", "external-db-1", "external-db", "", 5432, netip.MustParseAddr("10.200.0.1"), netip.MustParseAddr("10.200.0.2"))
	require.NoError(t, err)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		s := f.reg.Service("external-db.gw.svc.cluster.local")
		require.NotNil(c, s)
		sh := s.Shards["cluster-2"]
		require.Len(c, sh, 2)
		require.Equal(c, netip.MustParseAddr("10.200.0.1"), sh[0].Address())
		require.Equal(c, []model.PortMapping{{ServicePort: 5432, TargetPort: 5432}}, sh[0].Ports)
		require.Equal(c, model.Network("network-7"), sh[0].Network(), "the control-plane namespace's label wins over the secret's default")
	}, 10*time.Second, 5*time.Millisecond)
	require.NoError(t, c2.Client.DiscoveryV1().EndpointSlices("gw").Delete(ctx, "external-db-1", metav1.DeleteOptions{}))
	require.Eventually(t, func() bool {
		s := f.reg.Service("external-db.gw.svc.cluster.local")
		return s != nil && len(s.Shards["cluster-2"]) == 0
	}, 10*time.Second, 5*time.Millisecond)
}

// TestExportMode: only exported services are federated; a port conflict
// is written to the ServiceExports as a Conflict condition.
func TestExportMode(t *testing.T) {
	ctx := context.Background()
	c1, c2 := clusters.Cluster("cluster-1"), clusters.Cluster("cluster-2")
	for _, c := range []*framework.Cluster{c1, c2} {
		require.NoError(t, c.InstallCRDs("../manifests/base/crds"))
	}
	f := startFederation(t, "fed-mcs", registry.Config{QuietPeriod: 10 * time.Millisecond, ExportMode: true}, controller.Config{WatchServiceExports: true})
	f.register(t, "cluster-2", "network-2")
	ctlCtx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	writer := controller.NewExportStatusWriter(f.reg, f.ctl.KubeClient, nil)
	done := make(chan struct{})
	go func() { _ = writer.Run(ctlCtx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })

	for _, c := range []*framework.Cluster{c1, c2} {
		require.NoError(t, c.EnsureNamespace(ctx, "mcs", nil))
		_, err := c.CreateService(ctx, "mcs", "private", map[string]string{"app": "private"}, framework.ServicePort{Name: "http", Port: 80, TargetPort: 8080})
		require.NoError(t, err)
	}
	// echo: exported in both clusters, with conflicting definitions of port "http".
	_, err := c1.CreateService(ctx, "mcs", "echo", map[string]string{"app": "echo"}, framework.ServicePort{Name: "http", Port: 80, TargetPort: 8080})
	require.NoError(t, err)
	time.Sleep(1100 * time.Millisecond) // creation timestamps have a one-second resolution: make cluster-1's the oldest
	_, err = c2.CreateService(ctx, "mcs", "echo", map[string]string{"app": "echo"}, framework.ServicePort{Name: "http", Port: 8000, TargetPort: 8080})
	require.NoError(t, err)
	for _, c := range []*framework.Cluster{c1, c2} {
		export := &unstructured.Unstructured{}
		export.SetAPIVersion("multicluster.x-k8s.io/v1beta1")
		export.SetKind("ServiceExport")
		export.SetNamespace("mcs")
		export.SetName("echo")
		client, err := multicluster.NewClient(c.Config)
		require.NoError(t, err)
		_, err = client.Dynamic.Resource(controller.ServiceExportGVRs[0]).Namespace("mcs").Create(ctx, export, metav1.CreateOptions{})
		require.NoError(t, err)
	}

	require.EventuallyWithT(t, func(c *assert.CollectT) {
		echo := f.reg.Service("echo.mcs.svc.cluster.local")
		require.NotNil(c, echo)
		require.Empty(c, echo.LocalClusters, "exported in both clusters")
		require.True(c, echo.ShardVisible("cluster-2", "cluster-1"))
		require.NotNil(c, f.reg.Service("echo.mcs.svc.clusterset.local"))
		require.Len(c, echo.PortConflicts, 1)
		private := f.reg.Service("private.mcs.svc.cluster.local")
		require.NotNil(c, private)
		require.False(c, private.ShardVisible("cluster-2", "cluster-1"), "not exported: never federated")
		require.Nil(c, f.reg.Service("private.mcs.svc.clusterset.local"))
	}, 20*time.Second, 10*time.Millisecond)

	// The conflict is reported on the ServiceExport of both clusters.
	for _, c := range []*framework.Cluster{c1, c2} {
		client, err := multicluster.NewClient(c.Config)
		require.NoError(t, err)
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			u, err := client.Dynamic.Resource(controller.ServiceExportGVRs[0]).Namespace("mcs").Get(ctx, "echo", metav1.GetOptions{})
			require.NoError(ct, err)
			conds, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
			got := map[string]string{}
			for _, x := range conds {
				m := x.(map[string]any)
				got[m["type"].(string)] = m["status"].(string) + "/" + m["reason"].(string)
			}
			require.Equal(ct, "True/PortConflict", got["Conflict"])
			require.Equal(ct, "True/Valid", got["Valid"])
		}, 20*time.Second, 20*time.Millisecond)
	}
}
