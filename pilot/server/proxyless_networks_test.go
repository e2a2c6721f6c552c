package server_test

import (
	"context"
	"fmt"
	"net/netip"
	"strconv"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	grpcxds "google.golang.org/grpc/xds"
	"google.golang.org/protobuf/types/known/structpb"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/pilot/xds"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// edsAddrs asks pilot's plaintext xDS, as node n over SotW ADS, for the load
// assignment of cluster and returns its endpoints as address:port.
func edsAddrs(t *testing.T, addr string, n *corev3.Node, cluster string) []string {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := discovery.NewAggregatedDiscoveryServiceClient(cc).StreamAggregatedResources(ctx)
	require.NoError(t, err)
	require.NoError(t, s.Send(&discovery.DiscoveryRequest{Node: n, TypeUrl: resource.EndpointType, ResourceNames: []string{cluster}}))
	r, err := s.Recv()
	require.NoError(t, err)
	var out []string
	for _, a := range r.GetResources() {
		cla := &endpointv3.ClusterLoadAssignment{}
		require.NoError(t, a.UnmarshalTo(cla))
		require.NoError(t, cla.ValidateAll())
		for _, le := range cla.GetEndpoints() {
			for _, lb := range le.GetLbEndpoints() {
				sa := lb.GetEndpoint().GetAddress().GetSocketAddress()
				out = append(out, sa.GetAddress()+":"+strconv.Itoa(int(sa.GetPortValue())))
			}
		}
	}
	return out
}

// TestProxylessGRPCIsSentOnlyReachableEndpoints: across two networks, a
// real grpc-go xDS client (no xDS security in its bootstrap: it cannot
// speak HBONE nor mTLS to a gateway) on network 1 is sent only network 1's
// endpoints of a service both networks run, so every call lands there; a
// service that runs only on network 2 gives it no endpoint at all (calls
// fail as unavailable, never towards the gateway), and pilot counts the
// withheld endpoints in isthmus_xds_endpoints_withheld_total. An Envoy node
// of the same network is sent network 2's gateway at its SNI passthrough
// port, never its HBONE port.
func TestProxylessGRPCIsSentOnlyReachableEndpoints(t *testing.T) {
	ctx := context.Background()
	primary, remote := clusters.Cluster("primary"), clusters.Cluster("remote")
	const ns, cpNS = "grpcnet", "isthmus-grpcnet"
	a1 := grpcEcho(t, "127.0.63.1:7070")
	a2 := grpcEcho(t, "127.0.64.1:7070")
	b2 := grpcEcho(t, "127.0.64.2:7070")
	for i, c := range []*framework.Cluster{primary, remote} {
		require.NoError(t, c.EnsureNamespace(ctx, ns, nil))
		require.NoError(t, c.EnsureNamespace(ctx, cpNS, nil))
		_, err := c.CreateService(ctx, ns, "echo", map[string]string{"app": "echo"}, framework.ServicePort{Name: "grpc", Port: 7070, TargetPort: 7070})
		require.NoError(t, err)
		_, err = c.CreatePod(ctx, framework.PodOptions{Namespace: ns, Name: "echo-0", Labels: map[string]string{"app": "echo"},
			IP: []netip.AddrPort{a1, a2}[i].Addr(), Ready: true})
		require.NoError(t, err)
	}
	_, err := remote.CreateService(ctx, ns, "only2", map[string]string{"app": "only2"}, framework.ServicePort{Name: "grpc", Port: 7070, TargetPort: 7070})
	require.NoError(t, err)
	_, err = remote.CreatePod(ctx, framework.PodOptions{Namespace: ns, Name: "only2-0", Labels: map[string]string{"app": "only2"}, IP: b2.Addr(), Ready: true})
	require.NoError(t, err)
	// Network 2's trusted east-west gateway, with HBONE and SNI passthrough.
	gw := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "eastwest", Namespace: cpNS, Labels: map[string]string{"topology.istio.io/network": "net2"},
			Annotations: map[string]string{model.GatewayServiceAccountsAnnotation: "eastwest"}},
		Spec: corev1.ServiceSpec{Type: corev1.ServiceTypeLoadBalancer, Selector: map[string]string{"app": "eastwest"},
			Ports: []corev1.ServicePort{{Name: "tls-hbone", Port: 15008, TargetPort: intstr.FromInt32(15008)},
				{Name: "tls", Port: 15443, TargetPort: intstr.FromInt32(15443)}}},
	}
	gw, err = remote.Client.CoreV1().Services(cpNS).Create(ctx, gw, metav1.CreateOptions{})
	require.NoError(t, err)
	gw.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{{IP: "127.0.64.254"}}
	_, err = remote.Client.CoreV1().Services(cpNS).UpdateStatus(ctx, gw, metav1.UpdateOptions{})
	require.NoError(t, err)

	p := runPilot(t, server.Config{
		Namespace: cpNS, ClusterID: "primary", Network: "net1", NoLeaderElection: true,
		DebugAddr: defaults.Disabled, MonitoringAddr: "127.0.0.1:0", GRPCAddr: defaults.Disabled, XDSPlaintextAddr: "127.0.0.1:0",
	})
	registerRemote(t, cpNS, "net2")
	require.Eventually(t, func() bool { return p.XDSPlaintextAddr() != "" && p.MonitoringAddr() != "" }, 30*time.Second, 10*time.Millisecond)

	meta := func() *structpb.Struct {
		return &structpb.Struct{Fields: map[string]*structpb.Value{xds.MetadataNetwork: structpb.NewStringValue("net1"),
			xds.MetadataClusterID: structpb.NewStringValue("primary")}}
	}
	echoCluster := xds.ClusterName("echo."+ns+".svc.cluster.local", 7070)
	// What Envoy is sent once pilot has both clusters and the gateway.
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		got := edsAddrs(t, p.XDSPlaintextAddr(), &corev3.Node{Id: "envoy~net1", UserAgentName: "envoy", Metadata: meta()}, echoCluster)
		assert.ElementsMatch(c, []string{a1.String(), "127.0.64.254:15443"}, got)
	}, 30*time.Second, 50*time.Millisecond)
	// What a gRPC node is sent: the same service, network 1 only.
	require.ElementsMatch(t, []string{a1.String()},
		edsAddrs(t, p.XDSPlaintextAddr(), &corev3.Node{Id: "grpc~net1", UserAgentName: "gRPC Go", Metadata: meta()}, echoCluster))

	bootstrap := fmt.Sprintf(`{
		"xds_servers": [{"server_uri": %q, "channel_creds": [{"type": "insecure"}], "server_features": ["xds_v3"]}],
		"node": {"id": "proxyless~grpc-net1", "metadata": {"NETWORK": "net1", "CLUSTER_ID": "primary"}}
	}`, p.XDSPlaintextAddr())
	rb, err := grpcxds.NewXDSResolverWithConfigForTesting([]byte(bootstrap))
	require.NoError(t, err)
	call := func(cc *grpc.ClientConn) (netip.AddrPort, error) {
		cctx, ccancel := context.WithTimeout(ctx, time.Second)
		defer ccancel()
		var pr peer.Peer
		if _, err := healthpb.NewHealthClient(cc).Check(cctx, &healthpb.HealthCheckRequest{}, grpc.Peer(&pr)); err != nil {
			return netip.AddrPort{}, err
		}
		return netip.ParseAddrPort(pr.Addr.String())
	}
	echo, err := grpc.NewClient("xds:///echo."+ns+".svc.cluster.local:7070", grpc.WithResolvers(rb), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer echo.Close()
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		_, err := call(echo)
		require.NoError(c, err)
	}, 30*time.Second, 50*time.Millisecond)
	for range 20 {
		a, err := call(echo)
		require.NoError(t, err)
		require.Equal(t, a1, a, "network 2's endpoint is reachable only through the gateway")
	}

	only2, err := grpc.NewClient("xds:///only2."+ns+".svc.cluster.local:7070", grpc.WithResolvers(rb), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer only2.Close()
	for range 3 {
		_, err := call(only2)
		require.Error(t, err)
		require.Contains(t, []codes.Code{codes.Unavailable, codes.DeadlineExceeded}, status.Code(err), "%v", err)
	}
	require.Positive(t, metricValue(t, "http://"+p.MonitoringAddr(), `isthmus_xds_endpoints_withheld_total{reason="client_without_tls"}`))
}
