package server_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

var (
	exportGVR = schema.GroupVersionResource{Group: "multicluster.x-k8s.io", Version: "v1beta1", Resource: "serviceexports"}
	importGVR = schema.GroupVersionResource{Group: "multicluster.x-k8s.io", Version: "v1beta1", Resource: "serviceimports"}
)

// TestServiceImports: exporting a service in the remote cluster makes
// pilot write a ServiceImport, with the service's ports and its allocated
// clusterset address, in every cluster where the namespace exists (here
// both); the import goes with the last export.
func TestServiceImports(t *testing.T) {
	ctx := context.Background()
	const ns = "mcs-system"
	dyn := func(c *framework.Cluster) dynamic.Interface {
		d, err := dynamic.NewForConfig(c.Config)
		require.NoError(t, err)
		return d
	}
	primary, remote := clusters.Cluster("primary"), clusters.Cluster("remote")
	for _, c := range []*framework.Cluster{primary, remote} {
		require.NoError(t, c.InstallCRDs("../../manifests/base/crds"))
		require.NoError(t, c.EnsureNamespace(ctx, "shop", nil))
	}
	require.NoError(t, primary.EnsureNamespace(ctx, ns, nil))
	_, err := remote.CreateService(ctx, "shop", "cart", map[string]string{"app": "cart"},
		framework.ServicePort{Name: "http", Port: 80, TargetPort: 8080}, framework.ServicePort{Name: "grpc", Port: 9090, TargetPort: 9090})
	require.NoError(t, err)
	runPilot(t, server.Config{ClusterID: "primary", Namespace: ns, Network: "network-1", NoLeaderElection: true,
		DebugAddr: defaults.Disabled, MonitoringAddr: defaults.Disabled, GRPCAddr: defaults.Disabled})
	registerRemote(t, ns, "network-2")

	exp := &unstructured.Unstructured{}
	exp.SetGroupVersionKind(schema.GroupVersionKind{Group: "multicluster.x-k8s.io", Version: "v1beta1", Kind: "ServiceExport"})
	exp.SetNamespace("shop")
	exp.SetName("cart")
	_, err = dyn(remote).Resource(exportGVR).Namespace("shop").Create(ctx, exp, metav1.CreateOptions{})
	require.NoError(t, err)
	for _, c := range []*framework.Cluster{primary, remote} {
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			si, err := dyn(c).Resource(importGVR).Namespace("shop").Get(ctx, "cart", metav1.GetOptions{})
			require.NoError(ct, err)
			typ, _, _ := unstructured.NestedString(si.Object, "spec", "type")
			require.Equal(ct, "ClusterSetIP", typ)
			ports, _, _ := unstructured.NestedSlice(si.Object, "spec", "ports")
			require.Len(ct, ports, 2)
			ips, _, _ := unstructured.NestedStringSlice(si.Object, "spec", "ips")
			require.Len(ct, ips, 1)
			a, err := netip.ParseAddr(ips[0])
			require.NoError(ct, err)
			require.True(ct, netip.MustParsePrefix("240.240.0.0/16").Contains(a), a)
		}, 30*time.Second, 50*time.Millisecond, "ServiceImport in %s", c.Name)
	}
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		e, err := dyn(remote).Resource(exportGVR).Namespace("shop").Get(ctx, "cart", metav1.GetOptions{})
		require.NoError(ct, err)
		conds, _, _ := unstructured.NestedSlice(e.Object, "status", "conditions")
		require.NotEmpty(ct, conds, "the export's conditions are written")
	}, 30*time.Second, 50*time.Millisecond)

	require.NoError(t, dyn(remote).Resource(exportGVR).Namespace("shop").Delete(ctx, "cart", metav1.DeleteOptions{}))
	for _, c := range []*framework.Cluster{primary, remote} {
		require.Eventually(t, func() bool {
			_, err := dyn(c).Resource(importGVR).Namespace("shop").Get(ctx, "cart", metav1.GetOptions{})
			return apierrors.IsNotFound(err)
		}, 30*time.Second, 50*time.Millisecond, "the import goes with the last export (%s)", c.Name)
	}
}

// TestImportedEndpointSlicesAcrossClusters: with both clusters on one
// network, an export in the remote cluster gets an imported EndpointSlice
// of its endpoints in both clusters (in the primary written with the
// primary's client, in the remote with the reader identity), owned by each
// cluster's ServiceImport; a new endpoint appears in both; the slices go
// with the export.
func TestImportedEndpointSlicesAcrossClusters(t *testing.T) {
	ctx := context.Background()
	const ns, app = "mcs-slices", "bank"
	primary, remote := clusters.Cluster("primary"), clusters.Cluster("remote")
	for _, c := range []*framework.Cluster{primary, remote} {
		require.NoError(t, c.InstallCRDs("../../manifests/base/crds"))
		require.NoError(t, c.EnsureNamespace(ctx, app, nil))
	}
	require.NoError(t, primary.EnsureNamespace(ctx, ns, nil))
	_, err := remote.CreateService(ctx, app, "ledger", map[string]string{"app": "ledger"}, framework.ServicePort{Name: "http", Port: 80, TargetPort: 8080})
	require.NoError(t, err)
	// TEST-NET-1 addresses: nothing dials them (an EndpointSlice may not
	// hold a loopback address).
	_, err = remote.CreatePod(ctx, framework.PodOptions{Namespace: app, Name: "ledger-0", Labels: map[string]string{"app": "ledger"},
		Node: "node-r", IP: netip.MustParseAddr("192.0.2.20"), Ready: true})
	require.NoError(t, err)
	runPilot(t, server.Config{ClusterID: "primary", Namespace: ns, Network: "network-1", NoLeaderElection: true,
		DebugAddr: defaults.Disabled, MonitoringAddr: defaults.Disabled, GRPCAddr: defaults.Disabled})
	registerRemote(t, ns, "network-1")
	exp := &unstructured.Unstructured{}
	exp.SetGroupVersionKind(schema.GroupVersionKind{Group: "multicluster.x-k8s.io", Version: "v1beta1", Kind: "ServiceExport"})
	exp.SetNamespace(app)
	exp.SetName("ledger")
	_, err = dynOf(t, remote).Resource(exportGVR).Namespace(app).Create(ctx, exp, metav1.CreateOptions{})
	require.NoError(t, err)

	addrsIn := func(ct require.TestingT, c *framework.Cluster) []string {
		list, err := c.Client.DiscoveryV1().EndpointSlices(app).List(ctx, metav1.ListOptions{LabelSelector: "multicluster.kubernetes.io/service-name=ledger"})
		require.NoError(ct, err)
		require.Len(ct, list.Items, 1)
		es := list.Items[0]
		require.Equal(ct, "remote", es.Labels["multicluster.kubernetes.io/source-cluster"])
		si, err := dynOf(t, c).Resource(importGVR).Namespace(app).Get(ctx, "ledger", metav1.GetOptions{})
		require.NoError(ct, err)
		require.Len(ct, es.OwnerReferences, 1)
		require.Equal(ct, si.GetUID(), es.OwnerReferences[0].UID, "owned by this cluster's ServiceImport")
		var out []string
		for _, ep := range es.Endpoints {
			out = append(out, ep.Addresses...)
		}
		return out
	}
	for _, c := range []*framework.Cluster{primary, remote} {
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			require.Equal(ct, []string{"192.0.2.20"}, addrsIn(ct, c))
		}, 30*time.Second, 50*time.Millisecond, "imported slice in %s", c.Name)
	}

	_, err = remote.CreatePod(ctx, framework.PodOptions{Namespace: app, Name: "ledger-1", Labels: map[string]string{"app": "ledger"},
		Node: "node-r", IP: netip.MustParseAddr("192.0.2.21"), Ready: true})
	require.NoError(t, err)
	for _, c := range []*framework.Cluster{primary, remote} {
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			require.Equal(ct, []string{"192.0.2.20", "192.0.2.21"}, addrsIn(ct, c))
		}, 30*time.Second, 50*time.Millisecond, "the new endpoint in %s", c.Name)
	}

	require.NoError(t, dynOf(t, remote).Resource(exportGVR).Namespace(app).Delete(ctx, "ledger", metav1.DeleteOptions{}))
	for _, c := range []*framework.Cluster{primary, remote} {
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			list, err := c.Client.DiscoveryV1().EndpointSlices(app).List(ctx, metav1.ListOptions{LabelSelector: "multicluster.kubernetes.io/service-name=ledger"})
			require.NoError(ct, err)
			require.Empty(ct, list.Items)
		}, 30*time.Second, 50*time.Millisecond, "the slices go with the import (%s)", c.Name)
	}
}

func dynOf(t *testing.T, c *framework.Cluster) dynamic.Interface {
	t.Helper()
	d, err := dynamic.NewForConfig(c.Config)
	require.NoError(t, err)
	return d
}
