// Package distribution_test is the acceptance test of traffic
// distribution (spec.trafficDistribution and the routing-preference
// annotations) end to end: real API servers, pilot in-process on the
// config cluster (cluster-1, network-1) with cluster-2 (network-2) as a
// remote, node ztunnels and network-2's east-west gateway in-process, each
// pod, node and gateway on its own loopback address.
package distribution_test

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"

	"github.com/isthmus-mesh/isthmus/controller"
	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/test/meshtest"
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
	ns       = "shop"
	echoHost = "echo.shop.svc.cluster.local:80"
	wait     = time.Minute
	poll     = 20 * time.Millisecond
)

// Topology labels of the nodes.
const (
	regionLabel = "topology.kubernetes.io/region"
	zoneLabel   = "topology.kubernetes.io/zone"
)

// TestPreferSameZone: web-0 (cluster-1, network-1, zone a) calls echo,
// which runs in zone a (echo-a) and zone b (echo-b) of cluster-1 and in
// zone a of cluster-2 on network-2 (echo-c). With no preference
// (routing-preference NONE) its connections reach all three; with
// spec.trafficDistribution PreferSameZone they reach echo-a while it is
// ready, echo-b when it is not, and echo-c (through network-2's gateway)
// only when cluster-1 has no ready endpoint; and come back as endpoints
// return. The EDS pilot serves an Envoy of cluster-1 in zone a carries the
// same order as priorities.
func TestPreferSameZone(t *testing.T) {
	ctx := t.Context()
	c1, c2 := clusters.Cluster("cluster-1"), clusters.Cluster("cluster-2")
	for _, c := range []*framework.Cluster{c1, c2} {
		require.NoError(t, c.InstallCRDs("../../manifests/base/crds"))
		require.NoError(t, c.EnsureNamespace(ctx, meshtest.Namespace, nil))
		require.NoError(t, c.EnsureNamespace(ctx, ns, nil))
	}
	for _, n := range []struct {
		c          *framework.Cluster
		name, zone string
	}{{c1, "node-1a", "a"}, {c1, "node-1b", "b"}, {c2, "node-2a", "a"}} {
		_, err := n.c.CreateNode(ctx, n.name, map[string]string{regionLabel: "r1", zoneLabel: n.zone})
		require.NoError(t, err)
	}
	a := meshtest.NewAddrs()
	pilotIP, z1a, z1b, z2a, gw2 := a.Next(), a.Next(), a.Next(), a.Next(), a.Next()
	webIP := a.Next()
	apps := map[string]netip.AddrPort{}
	for _, n := range []string{"echo-a", "echo-b", "echo-c"} {
		apps[n] = netip.AddrPortFrom(a.Next(), 8080)
		meshtest.EchoApp(t, apps[n], n)
	}

	// Pilot also serves plaintext xDS (development only) for the EDS check
	// below, which has no workload certificate.
	p := meshtest.RunPilot(t, c1, pilotIP, func(cfg *server.Config) { cfg.XDSPlaintextAddr = netip.AddrPortFrom(pilotIP, 0).String() })
	meshtest.RegisterRemote(t, c1, c2, "cluster-2", "network-2", nil)
	meshtest.GatewayService(t, c2, "network-2", gw2)

	// echo in both clusters; cluster-1's definition (the client's cluster)
	// decides web-0's preference. It starts with no preference at all.
	for _, c := range []*framework.Cluster{c1, c2} {
		_, err := c.CreateService(ctx, ns, "echo", map[string]string{"app": "echo"}, framework.ServicePort{Name: "tcp", Port: 80, TargetPort: 8080})
		require.NoError(t, err)
	}
	updateEcho(t, c1, func(s *corev1.Service) {
		s.Annotations = map[string]string{controller.RoutingPreferenceAnnotation: "NONE"}
	})
	pods := []struct {
		c         *framework.Cluster
		name, nod string
		ip        netip.Addr
	}{
		{c1, "echo-a", "node-1a", apps["echo-a"].Addr()},
		{c1, "echo-b", "node-1b", apps["echo-b"].Addr()},
		{c2, "echo-c", "node-2a", apps["echo-c"].Addr()},
	}
	for _, po := range pods {
		_, err := po.c.CreatePod(ctx, framework.PodOptions{Namespace: ns, Name: po.name, Labels: map[string]string{"app": "echo"},
			ServiceAccount: "echo", Node: po.nod, IP: po.ip, Ready: true})
		require.NoError(t, err)
	}
	_, err := c1.CreatePod(ctx, framework.PodOptions{Namespace: ns, Name: "web-0", Labels: map[string]string{"app": "web"},
		ServiceAccount: "web", Node: "node-1a", IP: webIP, Ready: true})
	require.NoError(t, err)

	zt := func(c *framework.Cluster, mode node.Mode, name, nodeName, sa, network string, ip netip.Addr) *meshtest.Ztunnel {
		return meshtest.RunZtunnel(t, p, pilotIP, meshtest.ZtunnelOptions{Mode: mode, Cluster: c.Name, Network: network, Node: nodeName,
			ServiceAccount: sa, Token: meshtest.ProxyPod(t, c, name, nodeName, sa, ip), IP: ip})
	}
	src := zt(c1, node.ModeNode, "ztunnel-node-1a", "node-1a", "ztunnel", "network-1", z1a)
	zt(c1, node.ModeNode, "ztunnel-node-1b", "node-1b", "ztunnel", "network-1", z1b)
	zt(c2, node.ModeNode, "ztunnel-node-2a", "node-2a", "ztunnel", "network-2", z2a)
	zt(c2, node.ModeGateway, "eastwest-gateway-2", "gw-node-2", "eastwest-gateway", "network-2", gw2)

	// who answers one new connection from web-0 to echo.
	who := func() (string, error) {
		c, err := meshtest.DialVia(ctx, src, webIP, echoHost)
		if err != nil {
			return "", err
		}
		defer c.Close()
		got, err := meshtest.Exchange(c, "hi")
		if err != nil {
			return "", err
		}
		name, _, _ := strings.Cut(got, " ")
		return name, nil
	}
	// only waits until every one of n connections is answered by want.
	only := func(t *testing.T, want string, n int) {
		t.Helper()
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			for range n {
				got, err := who()
				require.NoError(c, err)
				require.Equal(c, want, got)
			}
		}, wait, poll)
	}

	// No preference: every endpoint is as likely; 60 connections reach all
	// three (the chance that one is missed is below 1e-10).
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		seen := map[string]int{}
		for range 60 {
			got, err := who()
			require.NoError(c, err)
			seen[got]++
		}
		require.Len(c, seen, 3, "answered by %v", seen)
	}, wait, poll)

	// PreferSameZone: the client's zone while it is healthy.
	updateEcho(t, c1, func(s *corev1.Service) {
		s.Annotations = nil
		td := corev1.ServiceTrafficDistributionPreferSameZone
		s.Spec.TrafficDistribution = &td
	})
	only(t, "echo-a", 20)
	// Envoy's EDS, for a client of cluster-1 in zone a, carries the same
	// order as priorities: echo-a, echo-b, then network-2's gateway (its
	// SNI passthrough port: Envoy does not speak HBONE).
	requireEDS(t, p.XDSPlaintextAddr(), [][]string{
		{apps["echo-a"].String()}, {apps["echo-b"].String()}, {netip.AddrPortFrom(gw2, 15443).String()},
	})
	// The other zone when it goes unready.
	setReady(t, c1, "echo-a", false)
	only(t, "echo-b", 20)
	// The other network only when the client's cluster has none.
	setReady(t, c1, "echo-b", false)
	only(t, "echo-c", 10)
	// And back, tier by tier.
	setReady(t, c1, "echo-b", true)
	only(t, "echo-b", 20)
	setReady(t, c1, "echo-a", true)
	only(t, "echo-a", 20)
}

// requireEDS waits until the ClusterLoadAssignment of echo port 80 that
// pilot (plaintext xDS at addr) serves an Envoy of cluster-1, network-1, in
// zone a of region r1 lists want, priority by priority, and checks it with
// Validate.
func requireEDS(t *testing.T, addr string, want [][]string) {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer cc.Close()
	md, err := structpb.NewStruct(map[string]any{"NETWORK": "network-1", "CLUSTER_ID": "cluster-1"})
	require.NoError(t, err)
	node := &corev3.Node{Id: "envoy-a", Metadata: md, Locality: &corev3.Locality{Region: "r1", Zone: "a"}}
	name := "outbound|80||echo.shop.svc.cluster.local"
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		stream, err := discovery.NewAggregatedDiscoveryServiceClient(cc).StreamAggregatedResources(ctx)
		require.NoError(c, err)
		require.NoError(c, stream.Send(&discovery.DiscoveryRequest{Node: node, TypeUrl: resource.EndpointType, ResourceNames: []string{name}}))
		resp, err := stream.Recv()
		require.NoError(c, err)
		require.Len(c, resp.GetResources(), 1)
		cla := &endpointv3.ClusterLoadAssignment{}
		require.NoError(c, resp.GetResources()[0].UnmarshalTo(cla))
		require.NoError(c, cla.Validate())
		var got [][]string
		for _, le := range cla.GetEndpoints() {
			for int(le.GetPriority()) >= len(got) {
				got = append(got, nil)
			}
			for _, e := range le.GetLbEndpoints() {
				sa := e.GetEndpoint().GetAddress().GetSocketAddress()
				got[le.GetPriority()] = append(got[le.GetPriority()], netip.AddrPortFrom(netip.MustParseAddr(sa.GetAddress()), uint16(sa.GetPortValue())).String())
			}
		}
		require.Equal(c, want, got)
	}, wait, poll)
}

// updateEcho changes cluster c's echo Service with mut.
func updateEcho(t *testing.T, c *framework.Cluster, mut func(*corev1.Service)) {
	t.Helper()
	svcs := c.Client.CoreV1().Services(ns)
	require.NoError(t, retry.RetryOnConflict(retry.DefaultRetry, func() error {
		s, err := svcs.Get(context.Background(), "echo", metav1.GetOptions{})
		if err != nil {
			return err
		}
		mut(s)
		_, err = svcs.Update(context.Background(), s, metav1.UpdateOptions{})
		return err
	}))
}

// setReady sets the Ready condition of pod name in c.
func setReady(t *testing.T, c *framework.Cluster, name string, ready bool) {
	t.Helper()
	require.NoError(t, retry.RetryOnConflict(retry.DefaultRetry, func() error {
		pod, err := c.Client.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		ip, err := netip.ParseAddr(pod.Status.PodIP)
		if err != nil {
			return err
		}
		_, err = c.SetPodStatus(context.Background(), pod, ip, ready)
		return err
	}))
}
