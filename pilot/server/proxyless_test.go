package server_test

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/peer"
	grpcxds "google.golang.org/grpc/xds"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// grpcEcho runs a real gRPC server (the health service) on addr.
func grpcEcho(t *testing.T, addr string) netip.AddrPort {
	t.Helper()
	lis, err := net.Listen("tcp", addr)
	require.NoError(t, err)
	gs := grpc.NewServer()
	healthpb.RegisterHealthServer(gs, health.NewServer())
	done := make(chan struct{})
	go func() { defer close(done); _ = gs.Serve(lis) }()
	t.Cleanup(func() { gs.Stop(); <-done })
	return netip.MustParseAddrPort(lis.Addr().String())
}

// TestProxylessGRPCAcrossRealClusters: a real grpc-go xDS client
// (xds:///echo.grpc.svc.cluster.local:7070, bootstrap pointing at pilot)
// calls a gRPC service whose instances run in two real clusters, as
// processes' listeners on their pod addresses; responses come from both;
// after the Service is deleted in one cluster, every call goes to the other.
func TestProxylessGRPCAcrossRealClusters(t *testing.T) {
	ctx := context.Background()
	primary, remote := clusters.Cluster("primary"), clusters.Cluster("remote")
	const ns, cpNS = "grpc", "isthmus-grpc"
	a1 := grpcEcho(t, "127.0.61.1:7070")
	a2 := grpcEcho(t, "127.0.62.1:7070")
	for i, c := range []*framework.Cluster{primary, remote} {
		require.NoError(t, c.EnsureNamespace(ctx, ns, nil))
		_, err := c.CreateService(ctx, ns, "echo", map[string]string{"app": "echo"}, framework.ServicePort{Name: "grpc", Port: 7070, TargetPort: 7070})
		require.NoError(t, err)
		ip := []netip.AddrPort{a1, a2}[i].Addr()
		_, err = c.CreatePod(ctx, framework.PodOptions{Namespace: ns, Name: "echo-0", Labels: map[string]string{"app": "echo"}, IP: ip, Ready: true})
		require.NoError(t, err)
	}
	require.NoError(t, primary.EnsureNamespace(ctx, cpNS, nil))

	p := runPilot(t, server.Config{
		Namespace: cpNS, ClusterID: "primary", Network: "net1", NoLeaderElection: true,
		DebugAddr: defaults.Disabled, MonitoringAddr: defaults.Disabled, GRPCAddr: defaults.Disabled, XDSPlaintextAddr: "127.0.0.1:0",
	})
	registerRemote(t, cpNS, "net1") // one network: endpoints are reached directly
	require.Eventually(t, func() bool { return p.XDSPlaintextAddr() != "" }, 30*time.Second, 10*time.Millisecond)

	bootstrap := fmt.Sprintf(`{
		"xds_servers": [{"server_uri": %q, "channel_creds": [{"type": "insecure"}], "server_features": ["xds_v3"]}],
		"node": {"id": "proxyless~grpc-client", "metadata": {"NETWORK": "net1", "CLUSTER_ID": "primary"}}
	}`, p.XDSPlaintextAddr())
	rb, err := grpcxds.NewXDSResolverWithConfigForTesting([]byte(bootstrap))
	require.NoError(t, err)
	cc, err := grpc.NewClient("xds:///echo.grpc.svc.cluster.local:7070", grpc.WithResolvers(rb), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer cc.Close()
	client := healthpb.NewHealthClient(cc)
	call := func() (netip.AddrPort, error) {
		cctx, ccancel := context.WithTimeout(ctx, time.Second)
		defer ccancel()
		var pr peer.Peer
		if _, err := client.Check(cctx, &healthpb.HealthCheckRequest{}, grpc.Peer(&pr)); err != nil {
			return netip.AddrPort{}, err
		}
		return netip.ParseAddrPort(pr.Addr.String())
	}

	seen := map[netip.AddrPort]int{}
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		for range 10 {
			if a, err := call(); err == nil {
				seen[a]++
			}
		}
		require.Len(c, seen, 2)
	}, 30*time.Second, 50*time.Millisecond, "calls must reach both clusters")
	require.Contains(t, seen, a1)
	require.Contains(t, seen, a2)

	start := time.Now()
	require.NoError(t, remote.Client.CoreV1().Services(ns).Delete(ctx, "echo", metav1.DeleteOptions{}))
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		for range 10 {
			a, err := call()
			require.NoError(c, err)
			require.Equal(c, a1, a)
		}
	}, 10*time.Second, 20*time.Millisecond)
	t.Logf("every call on the remaining cluster %v after the Service was deleted in the other", time.Since(start).Round(time.Millisecond))
	for range 20 {
		a, err := call()
		require.NoError(t, err)
		require.Equal(t, a1, a)
	}
}
