package xdsclient_test

import (
	"maps"
	"net/netip"
	"slices"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/wrapperspb"

	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
	"github.com/isthmus-mesh/isthmus/ztunnel/xdsclient"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestSyncUpdateRemove proves the initial wildcard sync (with the node's
// id and CLUSTER_ID/NETWORK metadata) fills the store with workloads,
// services, VIPs of the client's network only and the gateway named by a
// split-horizon workload; that an update replaces a workload; and that
// removals remove the workload, the service and the gateway.
func TestSyncUpdateRemove(t *testing.T) {
	c := newCache(map[string]types.Resource{
		"c1/default/a":  wl("c1/default/a", "127.0.0.10", "node-a"),
		"c1/default/b":  wl("c1/default/b", "127.0.0.11", "node-b"),
		splitName("n2"): split("n2", "127.0.0.20"),
		echoKey: svc(
			&workloadv1.NetworkAddress{Network: "n1", Address: addrB("10.96.0.1")},
			&workloadv1.NetworkAddress{Network: "n2", Address: addrB("10.97.0.1")},
		),
	})
	srv := startXDS(t, c, "127.0.0.1:0")
	cl, store := client(t, srv.addr, nil)

	eventually(t, store, func(c *assert.CollectT, s *state.Snapshot) {
		require.Len(c, s.Workloads(), 3)
		require.Len(c, s.Services(), 1)
	})
	select {
	case <-cl.Synced():
	case <-time.After(5 * time.Second):
		t.Fatal("Synced not closed after the first response was applied")
	}
	require.True(t, cl.HasSynced())
	snap := store.Load()
	a, ok := snap.Workload("c1/default/a")
	require.True(t, ok)
	require.Equal(t, []netip.Addr{netip.MustParseAddr("127.0.0.10")}, a.Addresses)
	require.Equal(t, "node-a", a.Node)
	require.Equal(t, state.TunnelHBONE, a.Protocol)
	require.Equal(t, "spiffe://cluster.local/ns/default/sa/echo", a.Identity().String())
	tp, ok := a.TargetPort(echoKey, 80)
	require.True(t, ok)
	require.Equal(t, uint16(8080), tp)
	s, ok := snap.ServiceByHostname(echoHost)
	require.True(t, ok)
	require.Equal(t, []netip.Addr{netip.MustParseAddr("10.96.0.1")}, s.VIPs, "only VIPs of the client's network")
	require.Len(t, snap.Endpoints(echoKey), 3)
	gws := snap.Gateways()
	require.Len(t, gws, 1)
	require.Equal(t, netip.MustParseAddrPort("127.0.0.20:15008"), gws[0].AddrPort())
	sp, ok := snap.Workload(splitName("n2"))
	require.True(t, ok)
	require.True(t, sp.Synthetic())

	first := srv.initialRequests()
	require.Len(t, first, 1)
	req := first[0]
	require.Equal(t, "ztunnel~node-a", req.GetNode().GetId())
	md := req.GetNode().GetMetadata().GetFields()
	require.Equal(t, "c1", md["CLUSTER_ID"].GetStringValue())
	require.Equal(t, "n1", md["NETWORK"].GetStringValue())
	require.Equal(t, []string{"*"}, req.GetResourceNamesSubscribe())
	require.Equal(t, workloadv1.TypeURL, req.GetTypeUrl())
	require.Empty(t, req.GetInitialResourceVersions())

	// Update: a moves to another address.
	require.NoError(t, c.UpdateResource("c1/default/a", wl("c1/default/a", "127.0.0.12", "node-a")))
	eventually(t, store, func(c *assert.CollectT, s *state.Snapshot) {
		_, ok := s.WorkloadByAddr(netip.MustParseAddr("127.0.0.12"))
		require.True(c, ok)
		_, ok = s.WorkloadByAddr(netip.MustParseAddr("127.0.0.10"))
		require.False(c, ok)
	})

	// Removal of b, the split-horizon workload and the service.
	require.NoError(t, c.UpdateResources(nil, []string{"c1/default/b", splitName("n2"), echoKey}))
	eventually(t, store, func(c *assert.CollectT, s *state.Snapshot) {
		require.Len(c, s.Workloads(), 1)
		require.Empty(c, s.Services())
		require.Empty(c, s.Gateways())
	})
	require.Equal(t, []string{"c1/default/a"}, slices.Sorted(maps.Keys(cl.Versions())))
	require.Zero(t, cl.Stats().NACKs)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.GreaterOrEqual(c, cl.Stats().ACKs, int64(3))
	}, 5*time.Second, 5*time.Millisecond)
}

// TestNACKKeepsLastGoodState proves that a resource that does not
// unmarshal, and one that does not validate, are NACKed with an
// error_detail naming them while the store keeps their last good version
// and still applies the good resources of the same response; and that the
// next good version is applied and ACKed.
func TestNACKKeepsLastGoodState(t *testing.T) {
	c := newCache(map[string]types.Resource{
		"c1/default/a": wl("c1/default/a", "127.0.0.10", "node-a"),
		"c1/default/b": wl("c1/default/b", "127.0.0.11", "node-b"),
	})
	srv := startXDS(t, c, "127.0.0.1:0")
	cl, store := client(t, srv.addr, nil)
	eventually(t, store, func(c *assert.CollectT, s *state.Snapshot) { require.Len(c, s.Workloads(), 2) })

	// Field 1 (workload) holding bytes that are not a Workload message.
	garbage := wrapperspb.Bytes([]byte{0xff, 0xff, 0xff, 0xff})
	badAddr := wl("c1/default/b", "127.0.0.13", "node-b")
	badAddr.GetWorkload().Addresses = [][]byte{{127, 0, 0}}
	require.NoError(t, c.UpdateResources(map[string]types.Resource{
		"c1/default/a": garbage,
		"c1/default/b": badAddr,
		"c1/default/c": wl("c1/default/c", "127.0.0.14", "node-c"),
	}, nil))

	var nack *discovery.DeltaDiscoveryRequest
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		for _, r := range srv.allRequests() {
			if r.GetErrorDetail() != nil {
				nack = r
			}
		}
		require.NotNil(c, nack)
	}, 10*time.Second, 5*time.Millisecond)
	require.Equal(t, int32(codes.InvalidArgument), nack.GetErrorDetail().GetCode())
	require.Contains(t, nack.GetErrorDetail().GetMessage(), `"c1/default/a"`)
	require.Contains(t, nack.GetErrorDetail().GetMessage(), `"c1/default/b"`)
	require.NotEmpty(t, nack.GetResponseNonce())
	require.Equal(t, int64(1), cl.Stats().NACKs)

	snap := store.Load()
	a, ok := snap.Workload("c1/default/a")
	require.True(t, ok, "last good a kept")
	require.Equal(t, netip.MustParseAddr("127.0.0.10"), a.Addresses[0])
	b, ok := snap.Workload("c1/default/b")
	require.True(t, ok, "last good b kept")
	require.Equal(t, netip.MustParseAddr("127.0.0.11"), b.Addresses[0])
	_, ok = snap.Workload("c1/default/c")
	require.True(t, ok, "good resource of the NACKed response applied")

	// The next good version is applied and ACKed.
	require.NoError(t, c.UpdateResource("c1/default/a", wl("c1/default/a", "127.0.0.15", "node-a")))
	eventually(t, store, func(c *assert.CollectT, s *state.Snapshot) {
		a, ok := s.Workload("c1/default/a")
		require.True(c, ok)
		require.Equal(c, netip.MustParseAddr("127.0.0.15"), a.Addresses[0])
	})
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		reqs := srv.allRequests()
		last := reqs[len(reqs)-1]
		require.Nil(c, last.GetErrorDetail())
		require.NotEmpty(c, last.GetResponseNonce())
		require.NotEqual(c, nack.GetResponseNonce(), last.GetResponseNonce())
	}, 10*time.Second, 5*time.Millisecond)
	require.Equal(t, int64(1), cl.Stats().NACKs)
}

// TestReconnectResumes proves that while pilot is away the store keeps the
// last good state, and that the reconnected stream starts with
// initial_resource_versions of everything held, after which the server
// sends only the changed and added resources (counted on the server) and
// reports the deleted one removed.
func TestReconnectResumes(t *testing.T) {
	c := newCache(map[string]types.Resource{
		"c1/default/a": wl("c1/default/a", "127.0.0.10", "node-a"),
		"c1/default/b": wl("c1/default/b", "127.0.0.11", "node-b"),
		"c1/default/c": wl("c1/default/c", "127.0.0.12", "node-c"),
		echoKey:        svc(),
	})
	srv := startXDS(t, c, "127.0.0.1:0")
	cl, store := client(t, srv.addr, nil)
	eventually(t, store, func(c *assert.CollectT, s *state.Snapshot) { require.Len(c, s.Workloads(), 3) })
	held := cl.Versions()
	require.Len(t, held, 4)

	srv.stop()
	require.Eventually(t, func() bool { return !cl.Connected() }, 5*time.Second, 5*time.Millisecond)
	before := store.Load()
	// Pilot changes while the client is away.
	require.NoError(t, c.UpdateResources(map[string]types.Resource{
		"c1/default/b": wl("c1/default/b", "127.0.0.21", "node-b"),
		"c1/default/d": wl("c1/default/d", "127.0.0.22", "node-d"),
	}, []string{"c1/default/c"}))
	// State is served unchanged while disconnected.
	require.Equal(t, before, store.Load())
	require.Len(t, store.Load().Workloads(), 3)

	srv.restart()
	eventually(t, store, func(c *assert.CollectT, s *state.Snapshot) {
		_, ok := s.Workload("c1/default/d")
		require.True(c, ok)
		_, ok = s.Workload("c1/default/c")
		require.False(c, ok)
		b, ok := s.Workload("c1/default/b")
		require.True(c, ok)
		require.Equal(c, netip.MustParseAddr("127.0.0.21"), b.Addresses[0])
	})

	first := srv.initialRequests()
	require.Len(t, first, 2)
	require.Equal(t, held, first[1].GetInitialResourceVersions())
	require.Equal(t, map[string]int{"c1/default/b": 1, "c1/default/d": 1}, srv.lastStreamSent(),
		"unchanged resources are not resent")
	require.Len(t, store.Load().Workloads(), 3)
	_, ok := store.Load().ServiceByHostname(echoHost)
	require.True(t, ok)
}

// TestOnDemand proves that with OnDemandOnly the client gets only the
// names it subscribes to, that the subscription survives a reconnect, and
// that unsubscribing removes the resource from the store.
func TestOnDemand(t *testing.T) {
	c := newCache(map[string]types.Resource{
		"c1/default/a": wl("c1/default/a", "127.0.0.10", "node-a"),
		"c1/default/b": wl("c1/default/b", "127.0.0.11", "node-b"),
		echoKey:        svc(),
	})
	srv := startXDS(t, c, "127.0.0.1:0")
	cl, store := client(t, srv.addr, func(cfg *xdsclient.Config) { cfg.OnDemandOnly = true })
	require.Eventually(t, cl.Connected, 5*time.Second, 5*time.Millisecond)
	require.NoError(t, cl.Subscribe("c1/default/b", echoKey))
	eventually(t, store, func(c *assert.CollectT, s *state.Snapshot) {
		require.Len(c, s.Workloads(), 1)
		require.Len(c, s.Services(), 1)
	})
	_, ok := store.Load().Workload("c1/default/a")
	require.False(t, ok, "not subscribed")

	srv.stop()
	srv.restart()
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		first := srv.initialRequests()
		require.Len(c, first, 2)
		require.ElementsMatch(c, []string{"c1/default/b", echoKey}, first[1].GetResourceNamesSubscribe())
	}, 10*time.Second, 5*time.Millisecond)

	require.NoError(t, cl.Unsubscribe("c1/default/b"))
	eventually(t, store, func(c *assert.CollectT, s *state.Snapshot) {
		require.Empty(c, s.Workloads())
		require.Len(c, s.Services(), 1)
	})
}
