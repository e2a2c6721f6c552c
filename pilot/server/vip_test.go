package server_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// TestAllocatedAddressesSurviveRestart: a service that runs only in the
// remote cluster (network-2) gets an allocated address for network-1's
// clients, and a restarted pilot (a new process's worth of state) serves the
// same one.
func TestAllocatedAddressesSurviveRestart(t *testing.T) {
	ctx := context.Background()
	const ns = "vip-system"
	primary, remote := clusters.Cluster("primary"), clusters.Cluster("remote")
	require.NoError(t, primary.EnsureNamespace(ctx, ns, nil))
	require.NoError(t, remote.EnsureNamespace(ctx, "vipdemo", nil))
	_, err := remote.CreateService(ctx, "vipdemo", "only-there", map[string]string{"app": "x"}, framework.ServicePort{Name: "http", Port: 80, TargetPort: 8080})
	require.NoError(t, err)
	const host = "only-there.vipdemo.svc.cluster.local"
	cfg := server.Config{ClusterID: "primary", Namespace: ns, Network: "network-1", NoLeaderElection: true,
		DebugAddr: defaults.Disabled, MonitoringAddr: defaults.Disabled, GRPCAddr: defaults.Disabled}
	first, cancel := runPilotCancel(t, cfg)
	registerRemote(t, ns, "network-2")
	var v4 netip.Addr
	require.Eventually(t, func() bool {
		v4, _ = first.VIP.Addresses(host)
		return v4.IsValid()
	}, 30*time.Second, 20*time.Millisecond)
	require.True(t, netip.MustParsePrefix("240.240.0.0/16").Contains(v4), v4)
	cancel()

	second, _ := runPilotCancel(t, cfg)
	require.Eventually(t, func() bool {
		got, _ := second.VIP.Addresses(host)
		return got == v4
	}, 30*time.Second, 20*time.Millisecond, "the restarted pilot serves the same address")
}
