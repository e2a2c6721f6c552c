// Package mcs_test is the acceptance test of MCS (sigs.k8s.io/mcs-api)
// imports across networks: real API servers, pilot on the config cluster
// (cluster-1, network-1) with cluster-2 (network-2) as a remote, node
// ztunnels and network-2's east-west gateway in-process on loopback
// addresses. cart runs in both clusters and cluster-2 exports it: a client
// in cluster-1, whose network has a local instance and a local ClusterIP,
// resolves cart.shop.svc.clusterset.local to the ServiceImport IP with a
// real DNS query to its ztunnel and dials that IP.
package mcs_test

import (
	"context"
	"net"
	"net/netip"
	"testing"
	"time"

	mdns "github.com/miekg/dns"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	mcsv1beta1 "sigs.k8s.io/mcs-api/pkg/apis/v1beta1"

	"github.com/isthmus-mesh/isthmus/pilot/mcs"
	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/test/meshtest"
	"github.com/isthmus-mesh/isthmus/ztunnel/node"
)

const (
	wait = time.Minute
	poll = 20 * time.Millisecond
)

var exportGVR = schema.GroupVersionResource{Group: "multicluster.x-k8s.io", Version: "v1beta1", Resource: "serviceexports"}

// mesh is the running federation of the test.
type mesh struct {
	c1, c2       *framework.Cluster
	src          *meshtest.Ztunnel // node-1a, cluster-1: runs web-0 and cart-1
	webIP        netip.Addr
	cart1, cart2 *corev1.Pod
	clusterIP    netip.Addr // cart's ClusterIP in cluster-1
}

func startMesh(t *testing.T) *mesh {
	ctx := t.Context()
	m := &mesh{c1: clusters.Cluster("cluster-1"), c2: clusters.Cluster("cluster-2")}
	for _, c := range []*framework.Cluster{m.c1, m.c2} {
		require.NoError(t, c.InstallCRDs("../../manifests/base/crds"))
		require.NoError(t, c.EnsureNamespace(ctx, meshtest.Namespace, nil))
		require.NoError(t, c.EnsureNamespace(ctx, "shop", nil))
	}
	require.NoError(t, m.c1.EnsureNamespace(ctx, "front", nil))
	a := meshtest.NewAddrs()
	pilotIP, node1, node2, gw2 := a.Next(), a.Next(), a.Next(), a.Next()
	m.webIP = a.Next()
	cart1App, cart2App := netip.AddrPortFrom(a.Next(), 8080), netip.AddrPortFrom(a.Next(), 8080)

	p := meshtest.RunPilot(t, m.c1, pilotIP, nil)
	meshtest.RegisterRemote(t, m.c1, m.c2, "cluster-2", "network-2", nil)
	meshtest.GatewayService(t, m.c2, "network-2", gw2)
	svc1, err := m.c1.CreateService(ctx, "shop", "cart", map[string]string{"app": "cart"}, framework.ServicePort{Name: "tcp", Port: 80, TargetPort: 8080})
	require.NoError(t, err)
	m.clusterIP = netip.MustParseAddr(svc1.Spec.ClusterIP)
	_, err = m.c2.CreateService(ctx, "shop", "cart", map[string]string{"app": "cart"}, framework.ServicePort{Name: "tcp", Port: 80, TargetPort: 8080})
	require.NoError(t, err)
	m.cart1, err = m.c1.CreatePod(ctx, framework.PodOptions{Namespace: "shop", Name: "cart-1", Labels: map[string]string{"app": "cart"},
		ServiceAccount: "cart", Node: "node-1a", IP: cart1App.Addr(), Ready: true})
	require.NoError(t, err)
	m.cart2, err = m.c2.CreatePod(ctx, framework.PodOptions{Namespace: "shop", Name: "cart-2", Labels: map[string]string{"app": "cart"},
		ServiceAccount: "cart", Node: "node-2a", IP: cart2App.Addr(), Ready: true})
	require.NoError(t, err)
	_, err = m.c1.CreatePod(ctx, framework.PodOptions{Namespace: "front", Name: "web-0", Labels: map[string]string{"app": "web"},
		ServiceAccount: "web", Node: "node-1a", IP: m.webIP, Ready: true})
	require.NoError(t, err)
	meshtest.EchoApp(t, cart1App, "cart-1")
	meshtest.EchoApp(t, cart2App, "cart-2")

	tok1 := meshtest.ProxyPod(t, m.c1, "ztunnel-node-1a", "node-1a", "ztunnel", node1)
	tok2 := meshtest.ProxyPod(t, m.c2, "ztunnel-node-2a", "node-2a", "ztunnel", node2)
	tokGW := meshtest.ProxyPod(t, m.c2, "eastwest-gateway-0", "gw-node-2", "eastwest-gateway", gw2)
	m.src = meshtest.RunZtunnel(t, p, pilotIP, meshtest.ZtunnelOptions{Mode: node.ModeNode, Cluster: "cluster-1", Network: "network-1",
		Node: "node-1a", ServiceAccount: "ztunnel", Token: tok1, IP: node1, DNS: true})
	meshtest.RunZtunnel(t, p, pilotIP, meshtest.ZtunnelOptions{Mode: node.ModeGateway, Cluster: "cluster-2", Network: "network-2",
		Node: "gw-node-2", ServiceAccount: "eastwest-gateway", Token: tokGW, IP: gw2})
	meshtest.RunZtunnel(t, p, pilotIP, meshtest.ZtunnelOptions{Mode: node.ModeNode, Cluster: "cluster-2", Network: "network-2",
		Node: "node-2a", ServiceAccount: "ztunnel", Token: tok2, IP: node2})
	return m
}

func dynamicOf(t *testing.T, c *framework.Cluster) dynamic.Interface {
	t.Helper()
	d, err := dynamic.NewForConfig(c.Config)
	require.NoError(t, err)
	return d
}

// exportService creates the ServiceExport of shop/<name> in c.
func exportService(t *testing.T, c *framework.Cluster, name string) {
	t.Helper()
	exp := &unstructured.Unstructured{}
	exp.SetGroupVersionKind(schema.GroupVersionKind{Group: "multicluster.x-k8s.io", Version: "v1beta1", Kind: "ServiceExport"})
	exp.SetNamespace("shop")
	exp.SetName(name)
	_, err := dynamicOf(t, c).Resource(exportGVR).Namespace("shop").Create(t.Context(), exp, metav1.CreateOptions{})
	require.NoError(t, err)
}

// importIP waits for the ServiceImport of shop/<name> in c and returns its
// IP.
func importIP(t *testing.T, c *framework.Cluster, name string) netip.Addr {
	t.Helper()
	var ip netip.Addr
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		si, err := dynamicOf(t, c).Resource(mcs.ServiceImportGVR).Namespace("shop").Get(t.Context(), name, metav1.GetOptions{})
		require.NoError(ct, err)
		ips, _, _ := unstructured.NestedStringSlice(si.Object, "spec", "ips")
		require.Len(ct, ips, 1)
		ip, err = netip.ParseAddr(ips[0])
		require.NoError(ct, err)
	}, wait, poll, "ServiceImport shop/%s in %s", name, c.Name)
	return ip
}

// resolve asks the DNS proxy of z, from src, for name's A records.
func resolve(z *meshtest.Ztunnel, src netip.Addr, name string) ([]netip.Addr, error) {
	c := &mdns.Client{Net: "udp", Timeout: 5 * time.Second, Dialer: &net.Dialer{LocalAddr: &net.UDPAddr{IP: src.AsSlice()}}}
	q := new(mdns.Msg)
	q.SetQuestion(name, mdns.TypeA)
	r, _, err := c.Exchange(q, netip.AddrPortFrom(z.IP, 15053).String())
	if err != nil {
		return nil, err
	}
	if r.Rcode != mdns.RcodeSuccess {
		return nil, &net.DNSError{Err: mdns.RcodeToString[r.Rcode], Name: name}
	}
	var out []netip.Addr
	for _, rr := range r.Answer {
		if a, ok := rr.(*mdns.A); ok {
			addr, _ := netip.AddrFromSlice(a.A)
			out = append(out, addr.Unmap())
		}
	}
	return out, nil
}

// request dials dst from web-0 through its ztunnel and exchanges one line.
func (m *mesh) request(ctx context.Context, dst netip.AddrPort, msg string) (string, error) {
	c, err := meshtest.DialVia(ctx, m.src, m.webIP, dst.String())
	if err != nil {
		return "", err
	}
	defer c.Close()
	return meshtest.Exchange(c, msg)
}

// TestMCS runs one federation for both acceptance checks of MCS imports.
func TestMCS(t *testing.T) {
	m := startMesh(t)
	t.Run("ServiceImport IP dialled and resolved", func(t *testing.T) { serviceImportIP(t, m) })
	t.Run("imported EndpointSlices", func(t *testing.T) { importedEndpointSlices(t, m) })
}

// serviceImportIP: cart, exported by cluster-2, gets a ServiceImport
// in cluster-1 whose IP web-0 (cluster-1, network-1, where cart has a
// local ClusterIP and a local instance) resolves under clusterset.local
// and dials: answered by an instance; with the local instance unready,
// answered by cluster-2's through network-2's gateway. cluster.local keeps
// answering the local ClusterIP.
func serviceImportIP(t *testing.T, m *mesh) {
	ctx := t.Context()
	exportService(t, m.c2, "cart")
	ip := importIP(t, m.c1, "cart")
	require.Equal(t, ip, importIP(t, m.c2, "cart"), "one allocation for the clusterset")
	require.NotEqual(t, m.clusterIP, ip)

	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		got, err := resolve(m.src, m.webIP, "cart.shop.svc.clusterset.local.")
		require.NoError(ct, err)
		require.Equal(ct, []netip.Addr{ip}, got)
	}, wait, poll, "clusterset.local answers the ServiceImport IP")
	got, err := resolve(m.src, m.webIP, "cart.shop.svc.cluster.local.")
	require.NoError(t, err)
	require.Equal(t, []netip.Addr{m.clusterIP}, got, "cluster.local answers the local ClusterIP")

	dst := netip.AddrPortFrom(ip, 80)
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		got, err := m.request(ctx, dst, "hello")
		require.NoError(ct, err)
		require.Contains(ct, []string{"cart-1 got hello", "cart-2 got hello"}, got)
	}, wait, poll, "the ServiceImport IP is served on network-1, which has a local VIP")

	_, err = m.c1.SetPodStatus(ctx, m.cart1, netip.MustParseAddr(m.cart1.Status.PodIP), false)
	require.NoError(t, err)
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		got, err := m.request(ctx, dst, "again")
		require.NoError(ct, err)
		require.Equal(ct, "cart-2 got again", got)
	}, wait, poll, "the ServiceImport IP reaches cluster-2's instance through network-2's gateway")

}

// importedEndpointSlices: ledger, exported by cluster-2, gets an
// imported EndpointSlice in cluster-2, written by pilot with its reader
// identity there, listing ledger-0 (none in cluster-1: network-1 does not
// reach network-2's pod addresses); it follows ledger-0's readiness and
// goes with the export. ledger-0 has a TEST-NET-1 address, which the API
// accepts in a slice (the data-path test's loopback addresses it refuses);
// nothing dials it.
func importedEndpointSlices(t *testing.T, m *mesh) {
	ctx := t.Context()
	ledgerIP := netip.MustParseAddr("192.0.2.10")
	_, err := m.c2.CreateService(ctx, "shop", "ledger", map[string]string{"app": "ledger"}, framework.ServicePort{Name: "tcp", Port: 80, TargetPort: 9000})
	require.NoError(t, err)
	ledger, err := m.c2.CreatePod(ctx, framework.PodOptions{Namespace: "shop", Name: "ledger-0", Labels: map[string]string{"app": "ledger"},
		ServiceAccount: "ledger", Node: "node-2a", IP: ledgerIP, Ready: true})
	require.NoError(t, err)
	exportService(t, m.c2, "ledger")
	importIP(t, m.c1, "ledger")

	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		es := importedSlices(ct, t, m.c2, "ledger")
		require.Len(ct, es, 1)
		require.Equal(ct, "cluster-2", es[0].Labels[mcsv1beta1.LabelSourceCluster])
		require.Equal(ct, mcs.SliceManagedBy, es[0].Labels[discoveryv1.LabelManagedBy])
		require.Len(ct, es[0].Endpoints, 1)
		require.Equal(ct, []string{ledgerIP.String()}, es[0].Endpoints[0].Addresses)
		require.True(ct, *es[0].Endpoints[0].Conditions.Ready)
		require.Equal(ct, int32(9000), *es[0].Ports[0].Port)
	}, wait, poll, "ledger-0's imported EndpointSlice in cluster-2")
	require.Empty(t, importedSlices(t, t, m.c1, "ledger"), "ledger-0 is not reachable from network-1 by its address")

	_, err = m.c2.SetPodStatus(ctx, ledger, ledgerIP, false)
	require.NoError(t, err)
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		es := importedSlices(ct, t, m.c2, "ledger")
		require.Len(ct, es, 1)
		require.Len(ct, es[0].Endpoints, 1)
		require.False(ct, *es[0].Endpoints[0].Conditions.Ready)
	}, wait, poll, "the imported slice follows ledger-0's readiness")

	require.NoError(t, dynamicOf(t, m.c2).Resource(exportGVR).Namespace("shop").Delete(ctx, "ledger", metav1.DeleteOptions{}))
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		require.Empty(ct, importedSlices(ct, t, m.c2, "ledger"))
	}, wait, poll, "the imported slices go with the import")
}

// importedSlices lists the imported EndpointSlices of shop/<name> in c.
func importedSlices(ct require.TestingT, t *testing.T, c *framework.Cluster, name string) []discoveryv1.EndpointSlice {
	list, err := c.Client.DiscoveryV1().EndpointSlices("shop").List(t.Context(), metav1.ListOptions{LabelSelector: mcsv1beta1.LabelServiceName + "=" + name})
	require.NoError(ct, err)
	return list.Items
}
