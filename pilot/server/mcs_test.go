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
