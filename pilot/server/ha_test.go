package server_test

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
	"github.com/isthmus-mesh/isthmus/ztunnel/xdsclient"
)

// TestTwoReplicas runs two pilot replicas on the same clusters. Both serve
// xDS; exactly one, the leader, writes shared state: an Event on a remote
// Secret appears once per transition, not once per replica. When the
// leader stops, the other takes over the Lease and the writing, and a
// ztunnel's xDS client that was connected to the stopped replica resumes on
// the other from the versions it holds: nothing is sent again, and its
// state is never emptied.
func TestTwoReplicas(t *testing.T) {
	ctx := context.Background()
	const ns = "ha-system"
	primary, remote := clusters.Cluster("primary"), clusters.Cluster("remote")
	require.NoError(t, primary.EnsureNamespace(ctx, ns, nil))
	require.NoError(t, remote.EnsureNamespace(ctx, "ha-demo", nil))
	require.NoError(t, remote.EnsureNamespace(ctx, ns, nil))
	for i := range 3 {
		_, err := remote.CreateService(ctx, "ha-demo", "svc-"+string(rune('a'+i)), map[string]string{"app": "x"},
			framework.ServicePort{Name: "http", Port: 80, TargetPort: 8080})
		require.NoError(t, err)
	}
	cfg := func(id string) server.Config {
		return server.Config{ClusterID: "primary", Namespace: ns, Network: "network-1", Identity: id,
			DebugAddr: defaults.Disabled, MonitoringAddr: defaults.Disabled, GRPCAddr: defaults.Disabled, XDSPlaintextAddr: "127.0.0.1:0",
			LeaderElection: server.LeaderElection{LeaseDuration: 3 * time.Second, RenewDeadline: 2 * time.Second, RetryPeriod: 200 * time.Millisecond}}
	}
	pa, stopA := runPilotCancel(t, cfg("replica-a"))
	pb, stopB := runPilotCancel(t, cfg("replica-b"))
	registerRemote(t, ns, "network-2")
	holder := func() string {
		l, err := primary.Client.CoordinationV1().Leases(ns).Get(ctx, server.LeaseName, metav1.GetOptions{})
		if err != nil || l.Spec.HolderIdentity == nil {
			return ""
		}
		return *l.Spec.HolderIdentity
	}
	require.Eventually(t, func() bool { return holder() != "" }, 30*time.Second, 50*time.Millisecond)
	require.Eventually(t, func() bool { return pa.Leading() != pb.Leading() }, 10*time.Second, 20*time.Millisecond,
		"exactly one replica leads")
	leader, follower, stopLeader := pa, pb, stopA
	if pb.Leading() {
		leader, follower, stopLeader = pb, pa, stopB
	}

	// A transition of the remote: a broken kubeconfig in a second key is
	// refused, with one Event however many replicas see it.
	sec, err := primary.Client.CoreV1().Secrets(ns).Get(ctx, "istio-remote-secret-remote", metav1.GetOptions{})
	require.NoError(t, err)
	warningsLeft := leftToLeader(t, follower)
	sec.Data["broken"] = []byte("not a kubeconfig")
	_, err = primary.Client.CoreV1().Secrets(ns).Update(ctx, sec, metav1.UpdateOptions{})
	require.NoError(t, err)
	events := func() int {
		l, err := primary.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
		require.NoError(t, err)
		n := 0
		for _, e := range l.Items {
			if e.InvolvedObject.Name == sec.Name && e.Type == corev1.EventTypeWarning {
				n += int(max(e.Count, 1))
			}
		}
		return n
	}
	require.Eventually(t, func() bool { return events() >= 1 }, 30*time.Second, 50*time.Millisecond)
	// The follower has seen the transition too and left its Event to the
	// leader: no second Event can still be on its way.
	require.Eventually(t, func() bool { return leftToLeader(t, follower) > warningsLeft }, 30*time.Second, 50*time.Millisecond)
	require.Equal(t, 1, events(), "one Event for one transition")

	// A ztunnel's xDS client, connected to the leader (plaintext: this is
	// about resuming, not authorization).
	var target atomic.Value
	target.Store(leader.XDSPlaintextAddr())
	store := state.NewStore()
	xc, err := xdsclient.New(xdsclient.Config{Address: "127.0.0.1:9" /* the dialer picks the replica */, NodeID: "ztunnel~node-1.ha-system", NodeName: "node-1",
		ClusterID: "primary", Network: "network-1", InitialBackoff: 50 * time.Millisecond, MaxBackoff: 200 * time.Millisecond},
		xdsclient.Deps{Store: store, Credentials: insecure.NewCredentials(), DialOptions: []grpc.DialOption{
			grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
				return (&net.Dialer{}).DialContext(ctx, "tcp", target.Load().(string))
			})}})
	require.NoError(t, err)
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- xc.Run(cctx) }()
	t.Cleanup(func() { cancel(); <-done })
	require.Eventually(t, func() bool {
		return leader.Registry.Service("svc-c.ha-demo.svc.cluster.local") != nil
	}, 30*time.Second, 20*time.Millisecond, "the remote's services are federated")
	require.Eventually(t, func() bool {
		_, ok := store.Load().ServiceByHostname("svc-c.ha-demo.svc.cluster.local")
		return ok
	}, 30*time.Second, 20*time.Millisecond)
	// The steady state first: the remote's services get their network-1
	// VIPs (allocated through a ConfigMap both replicas watch) some time
	// after they appear, a real change that must not count as a resend;
	// and the other replica serves the same state, as a second client of it
	// sees. The claim is that nothing is sent again from there.
	other := watchReplica(t, cctx, follower.XDSPlaintextAddr())
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		for _, h := range []string{"svc-a", "svc-b", "svc-c"} {
			s, ok := store.Load().ServiceByHostname(h + ".ha-demo.svc.cluster.local")
			require.True(c, ok, h)
			require.NotEmpty(c, s.Allocated, "%s has its network-1 VIP", h)
		}
		require.Equal(c, store.Load().Services(), other.Load().Services())
	}, 30*time.Second, 20*time.Millisecond, "the steady state, served by both replicas")
	require.Eventually(t, func() bool { return xc.Stats().ACKs == xc.Stats().Responses }, 10*time.Second, 20*time.Millisecond)
	before := xc.Stats()
	held := len(store.Load().Services())
	minServices := held
	watch := make(chan struct{})
	go func() { // the state is never emptied during the switch
		defer close(watch)
		for cctx.Err() == nil {
			snap := store.Load()
			minServices = min(minServices, len(snap.Services()))
			select {
			case <-snap.Stale():
			case <-cctx.Done():
			}
		}
	}()

	// The leader goes; the follower takes over, the client moves to it.
	target.Store(follower.XDSPlaintextAddr())
	stopLeader()
	require.Eventually(t, follower.Leading, 30*time.Second, 20*time.Millisecond, "the other replica takes over")
	require.Eventually(t, func() bool { return xc.Stats().Streams > before.Streams && xc.Connected() }, 30*time.Second, 20*time.Millisecond)
	// Give a resend, if there were one, time to arrive.
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.GreaterOrEqual(c, xc.Stats().Responses, before.Responses)
	}, 5*time.Second, 50*time.Millisecond)
	time.Sleep(time.Second)
	after := xc.Stats()
	require.Equal(t, before.Resources, after.Resources, "nothing sent again on the other replica")
	require.Equal(t, before.Removals, after.Removals)
	require.Equal(t, held, len(store.Load().Services()))
	cancel()
	<-watch
	require.Equal(t, held, minServices, "the state was never emptied")
}

// leftToLeader is how many Warning Events on remote Secrets replica p left
// to the leader.
func leftToLeader(t *testing.T, p *server.Server) float64 {
	t.Helper()
	mfs, err := p.Metrics.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "isthmus_remote_secret_kube_events_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["type"] == corev1.EventTypeWarning && labels["outcome"] == "left_to_leader" {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

// watchReplica runs an xDS client of another node against one replica's
// plaintext address until ctx ends, and returns its store.
func watchReplica(t *testing.T, ctx context.Context, addr string) *state.Store {
	t.Helper()
	return watchXDS(t, ctx, addr, "ztunnel~node-2.ha-system", "primary", "network-1")
}

// watchXDS runs the xDS client of a ztunnel (node-2, with nodeID) of
// cluster on network against pilot's plaintext address until ctx ends, and
// returns its store.
func watchXDS(t *testing.T, ctx context.Context, addr, nodeID, cluster, network string) *state.Store {
	t.Helper()
	store := state.NewStore()
	xc, err := xdsclient.New(xdsclient.Config{Address: addr, NodeID: nodeID, NodeName: "node-2",
		ClusterID: cluster, Network: network, InitialBackoff: 50 * time.Millisecond, MaxBackoff: 200 * time.Millisecond},
		xdsclient.Deps{Store: store, Credentials: insecure.NewCredentials()})
	require.NoError(t, err)
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- xc.Run(cctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return store
}
