package xds_test

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/peer"
	grpcxds "google.golang.org/grpc/xds"

	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/xds/xdstest"
)

// echoServer is a real gRPC server (the health service) on a loopback address.
func echoServer(t *testing.T, host string) netip.AddrPort {
	t.Helper()
	lis, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	require.NoError(t, err)
	gs := grpc.NewServer()
	healthpb.RegisterHealthServer(gs, health.NewServer())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = gs.Serve(lis)
	}()
	t.Cleanup(func() {
		gs.Stop()
		<-done
	})
	return netip.MustParseAddrPort(lis.Addr().String())
}

// TestProxylessGRPC proves a real grpc-go xDS client dialing
// xds:///<hostname>:<port> resolves through LDS/RDS/CDS/EDS served here,
// balances over the instances of one service in two clusters, and sends
// every call to the remaining cluster within 2 s of the other's shard going.
func TestProxylessGRPC(t *testing.T) {
	a1 := echoServer(t, "127.0.10.1")
	a2 := echoServer(t, "127.0.20.1")
	reg := xdstest.New()
	p1 := xdstest.Pod("c1", "net1", ns, "echo-1", a1.Addr())
	p2 := xdstest.Pod("c2", "net1", ns, "echo-2", a2.Addr())
	ports := []model.Port{{Name: "grpc", Port: 7070, Protocol: model.TCP, AppProtocol: "grpc"}}
	svc, ws := xdstest.Backing("echo", ns, ports, nil, p1, p2)
	// Each instance listens on its own port: resolve the target port per endpoint.
	for cl, port := range map[model.ClusterID]uint16{"c1": a1.Port(), "c2": a2.Port()} {
		for i := range svc.Shards[cl] {
			svc.Shards[cl][i].Ports = []model.PortMapping{{ServicePort: 7070, TargetPort: port}}
		}
	}
	publish(reg, svc, ws)
	e := start(t, reg)

	bootstrap := fmt.Sprintf(`{
		"xds_servers": [{"server_uri": %q, "channel_creds": [{"type": "insecure"}], "server_features": ["xds_v3"]}],
		"node": {"id": "proxyless-1", "metadata": {"NETWORK": "net1", "CLUSTER_ID": "c1"}}
	}`, e.addr)
	rb, err := grpcxds.NewXDSResolverWithConfigForTesting([]byte(bootstrap))
	require.NoError(t, err)
	cc, err := grpc.NewClient("xds:///"+svc.Hostname+":7070", grpc.WithResolvers(rb), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer cc.Close()
	client := healthpb.NewHealthClient(cc)

	call := func() (netip.AddrPort, error) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		var p peer.Peer
		if _, err := client.Check(ctx, &healthpb.HealthCheckRequest{}, grpc.Peer(&p)); err != nil {
			return netip.AddrPort{}, err
		}
		return netip.ParseAddrPort(p.Addr.String())
	}

	seen := map[netip.AddrPort]int{}
	require.EventuallyWithT(t, func(ct *assertT) {
		for range 10 {
			a, err := call()
			if err == nil {
				seen[a]++
			}
		}
		assertEqual(ct, 2, len(seen))
	}, 10*time.Second, 50*time.Millisecond, "calls must reach both clusters")
	require.Contains(t, seen, a1)
	require.Contains(t, seen, a2)

	// Cluster c2's shard goes: within 2 s every call lands on c1.
	only, _ := xdstest.Backing("echo", ns, ports, nil, p1)
	only.Shards["c1"][0].Ports = []model.PortMapping{{ServicePort: 7070, TargetPort: a1.Port()}}
	reg.SetService(only)
	require.EventuallyWithT(t, func(ct *assertT) {
		for range 10 {
			a, err := call()
			if !assertNoError(ct, err) || !assertEqual(ct, a1, a) {
				return
			}
		}
	}, 2*time.Second, 20*time.Millisecond)
	// And it stays so.
	for range 20 {
		a, err := call()
		require.NoError(t, err)
		require.Equal(t, a1, a)
	}
}
