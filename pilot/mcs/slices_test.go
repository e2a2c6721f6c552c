package mcs_test

import (
	"context"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	mcsv1beta1 "sigs.k8s.io/mcs-api/pkg/apis/v1beta1"

	"github.com/isthmus-mesh/isthmus/pilot/mcs"
)

// slicesOf returns the EndpointSlices of import name in cluster, by source
// cluster and address type ("cluster-1/IPv4").
func (e *env) slicesOf(t *testing.T, cluster, name string) map[string]discoveryv1.EndpointSlice {
	t.Helper()
	list, err := e.dyn[cluster].Resource(mcs.EndpointSliceGVR).Namespace(e.ns).List(context.Background(),
		metav1.ListOptions{LabelSelector: mcsv1beta1.LabelServiceName + "=" + name})
	require.NoError(t, err)
	out := map[string]discoveryv1.EndpointSlice{}
	for _, u := range list.Items {
		var es discoveryv1.EndpointSlice
		require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &es))
		key := es.Labels[mcsv1beta1.LabelSourceCluster] + "/" + string(es.AddressType)
		require.NotContains(t, out, key, "one slice per source cluster and family here")
		out[key] = es
	}
	return out
}

func endpointsOf(es discoveryv1.EndpointSlice) map[string]discoveryv1.EndpointConditions {
	out := map[string]discoveryv1.EndpointConditions{}
	for _, ep := range es.Endpoints {
		out[ep.Addresses[0]] = ep.Conditions
	}
	return out
}

func conds(ready, serving, terminating bool) discoveryv1.EndpointConditions {
	return discoveryv1.EndpointConditions{Ready: &ready, Serving: &serving, Terminating: &terminating}
}

// TestImportedEndpointSlices proves, on two real API servers on two
// networks: beside each ServiceImport, an EndpointSlice per exporting
// cluster whose endpoints are on the importing cluster's network, per
// address family, with the MCS labels, the managed-by label, the endpoint
// conditions and target ports, owned by the ServiceImport; none for an
// exporting cluster on another network; the slices follow endpoint
// changes, are not rewritten when nothing changed, and go with the import;
// loopback and link-local addresses, which the API refuses, are left out;
// a slice Isthmus does not manage is left alone.
func TestImportedEndpointSlices(t *testing.T) {
	e := newEnv(t)
	e.networks = map[string]string{"cluster-1": "network-1", "cluster-2": "network-2"}
	ctx := context.Background()
	for _, c := range clusters.Clusters {
		require.NoError(t, c.EnsureNamespace(ctx, e.ns, nil))
	}
	w, err := mcs.New(mcs.Config{}, e.deps())
	require.NoError(t, err)
	http := []mcs.Port{{Name: "http", Port: 8080}}
	ep := func(nw string, ready, terminating bool, addrs ...string) mcs.Endpoint {
		out := mcs.Endpoint{Network: nw, Ready: ready && !terminating, Serving: ready, Terminating: terminating, Ports: http, Zone: "zone-a"}
		for _, a := range addrs {
			out.Addresses = append(out.Addresses, netip.MustParseAddr(a))
		}
		return out
	}
	echo := mcs.Service{Namespace: e.ns, Name: "echo", IPs: []netip.Addr{vip4}, Exports: []mcs.ClusterExport{
		{Cluster: "cluster-1", Created: created, Ports: []mcs.Port{{Name: "http", Port: 80}}, Endpoints: []mcs.Endpoint{
			ep("network-1", true, false, "10.1.0.1", "fd00:1::1"), ep("network-1", true, true, "10.1.0.2"),
			ep("network-1", true, false, "127.0.0.9", "fe80::9"), // refused by the API: left out
		}},
		{Cluster: "cluster-2", Created: created, Ports: []mcs.Port{{Name: "http", Port: 80}}, Endpoints: []mcs.Endpoint{
			ep("network-2", true, false, "10.2.0.1"),
		}},
	}}
	e.set(echo)
	require.NoError(t, w.Reconcile(ctx))

	si, ok := e.get(t, "cluster-1", e.ns, "echo")
	require.True(t, ok)
	got := e.slicesOf(t, "cluster-1", "echo")
	require.ElementsMatch(t, []string{"cluster-1/IPv4", "cluster-1/IPv6"}, keys(got), "cluster-2's endpoints are on network-2: not listed in cluster-1")
	v4 := got["cluster-1/IPv4"]
	require.Equal(t, map[string]discoveryv1.EndpointConditions{"10.1.0.1": conds(true, true, false), "10.1.0.2": conds(false, true, true)}, endpointsOf(v4))
	require.Equal(t, "zone-a", *v4.Endpoints[0].Zone)
	require.Equal(t, map[string]discoveryv1.EndpointConditions{"fd00:1::1": conds(true, true, false)}, endpointsOf(got["cluster-1/IPv6"]))
	require.Equal(t, mcs.SliceManagedBy, v4.Labels[discoveryv1.LabelManagedBy])
	require.Equal(t, "echo", v4.Labels[mcsv1beta1.LabelServiceName])
	require.NotContains(t, v4.Labels, discoveryv1.LabelServiceName, "no Service takes it for its own")
	require.Len(t, v4.Ports, 1)
	require.Equal(t, "http", *v4.Ports[0].Name)
	require.Equal(t, int32(8080), *v4.Ports[0].Port, "the endpoint's target port")
	require.Len(t, v4.OwnerReferences, 1)
	require.Equal(t, si.UID, v4.OwnerReferences[0].UID, "owned by the ServiceImport")
	require.Equal(t, "ServiceImport", v4.OwnerReferences[0].Kind)

	si2, _ := e.get(t, "cluster-2", e.ns, "echo")
	got2 := e.slicesOf(t, "cluster-2", "echo")
	require.ElementsMatch(t, []string{"cluster-2/IPv4"}, keys(got2))
	require.Equal(t, map[string]discoveryv1.EndpointConditions{"10.2.0.1": conds(true, true, false)}, endpointsOf(got2["cluster-2/IPv4"]))
	require.Equal(t, si2.UID, got2["cluster-2/IPv4"].OwnerReferences[0].UID)

	// A slice of the same service that Isthmus does not manage.
	foreign := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
		"metadata":  map[string]any{"name": "foreign", "namespace": e.ns, "labels": map[string]any{mcsv1beta1.LabelServiceName: "echo"}},
		"endpoints": []any{map[string]any{"addresses": []any{"10.9.9.9"}}},
	}}
	_, err = e.dyn["cluster-1"].Resource(mcs.EndpointSliceGVR).Namespace(e.ns).Create(ctx, foreign, metav1.CreateOptions{})
	require.NoError(t, err)

	// Nothing changed: nothing is written.
	require.NoError(t, w.Reconcile(ctx))
	require.Equal(t, v4.ResourceVersion, e.slicesOf(t, "cluster-1", "echo")["cluster-1/IPv4"].ResourceVersion)

	// The terminating endpoint goes, another arrives, the IPv6 address goes.
	echo.Exports[0].Endpoints = []mcs.Endpoint{ep("network-1", false, false, "10.1.0.1"), ep("network-1", true, false, "10.1.0.3")}
	e.set(echo)
	require.NoError(t, w.Reconcile(ctx))
	got = e.slicesOf(t, "cluster-1", "echo")
	delete(got, "/IPv4") // the foreign slice (no source-cluster label)
	require.ElementsMatch(t, []string{"cluster-1/IPv4"}, keys(got), "no IPv6 endpoint left: its slice is deleted")
	require.Equal(t, map[string]discoveryv1.EndpointConditions{"10.1.0.1": conds(false, false, false), "10.1.0.3": conds(true, true, false)},
		endpointsOf(got["cluster-1/IPv4"]))
	require.Equal(t, v4.Name, got["cluster-1/IPv4"].Name, "updated in place")

	// The last export goes: the slices go with the import.
	echo.Exports = nil
	e.set(echo)
	require.NoError(t, w.Reconcile(ctx))
	for _, c := range []string{"cluster-1", "cluster-2"} {
		_, ok := e.get(t, c, e.ns, "echo")
		require.False(t, ok, c)
	}
	require.ElementsMatch(t, []string{"/IPv4"}, keys(e.slicesOf(t, "cluster-1", "echo")), "only the unmanaged slice is left")
	require.Empty(t, e.slicesOf(t, "cluster-2", "echo"))
}

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

// TestImportedEndpointSlicesChunked: more than 100 endpoints are split
// into slices of at most 100, all listed, under a service name of the
// longest length (63), shortened in the slice names.
func TestImportedEndpointSlicesChunked(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	require.NoError(t, clusters.Cluster("cluster-1").EnsureNamespace(ctx, e.ns, nil))
	w, err := mcs.New(mcs.Config{}, e.deps())
	require.NoError(t, err)
	name := "a-service-with-the-longest-name-a-service-may-have-63-character"
	var eps []mcs.Endpoint
	for i := range 150 {
		eps = append(eps, mcs.Endpoint{Network: "network-1", Ready: true, Serving: true, Ports: []mcs.Port{{Name: "http", Port: 8080}},
			Addresses: []netip.Addr{netip.AddrFrom4([4]byte{10, 3, byte(i / 250), byte(1 + i%250)})}})
	}
	e.set(mcs.Service{Namespace: e.ns, Name: name, IPs: []netip.Addr{vip4}, Exports: []mcs.ClusterExport{
		{Cluster: "cluster-2", Created: created, Ports: []mcs.Port{{Name: "http", Port: 80}}, Endpoints: eps}}})
	require.NoError(t, w.Reconcile(ctx))
	list, err := e.dyn["cluster-1"].Resource(mcs.EndpointSliceGVR).Namespace(e.ns).List(ctx,
		metav1.ListOptions{LabelSelector: mcsv1beta1.LabelServiceName + "=" + name})
	require.NoError(t, err)
	require.Len(t, list.Items, 2)
	seen := map[string]bool{}
	for _, u := range list.Items {
		var es discoveryv1.EndpointSlice
		require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &es))
		require.LessOrEqual(t, len(es.Endpoints), 100)
		for _, ep := range es.Endpoints {
			seen[ep.Addresses[0]] = true
		}
	}
	require.Len(t, seen, 150)
}
