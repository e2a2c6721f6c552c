package registry

import (
	"net/netip"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// podAt is a pod workload of cluster/ns/name at addr on net1, created at
// second created.
func podAt(cluster model.ClusterID, ns, name, addr string, created int64) *model.Workload {
	return &model.Workload{UID: model.WorkloadUID(cluster, ns, name), Name: name, Addresses: []netip.Addr{netip.MustParseAddr(addr)},
		Placement: &model.Placement{Cluster: cluster, Network: "net1", Node: "n1", Namespace: ns, ServiceAccount: name},
		Ready:     true, Created: created}
}

// sliceAt is the endpoint service k of cluster makes of addr, listed in a
// slice created at second created.
func sliceAt(cluster model.ClusterID, k model.ServiceKey, addr string, created int64) model.Endpoint {
	uid := model.SliceWorkloadPrefix(cluster, k) + addr
	return model.Endpoint{Workload: &model.Workload{UID: uid, Name: addr, Addresses: []netip.Addr{netip.MustParseAddr(addr)},
		Placement: &model.Placement{Cluster: cluster, Network: "net1", Node: "n1", Namespace: k.Namespace, ServiceAccount: "default"},
		Ready:     true, FromSlice: true, Created: created}, Ports: []model.PortMapping{{ServicePort: 80, TargetPort: 8080}}}
}

func selectorless(cluster model.ClusterID, k model.ServiceKey) *model.ClusterService {
	s := svc(cluster, k.Namespace, k.Name, t0, httpPort)
	s.Selector = nil
	return s
}

// TestAddressOwnership: one owner per address per network, across
// clusters; a pod beats a slice address, the oldest claim beats a younger
// one; a slice address of another namespace's pod is dropped from its
// service; a loser takes over, announced, when the owner goes; a slice
// address naming its pod is no conflict; hostNetwork pods claim nothing;
// conflicts are counted by reason.
func TestAddressOwnership(t *testing.T) {
	metrics := prometheus.NewRegistry()
	reg, rec := run(t, Config{QuietPeriod: 5 * time.Millisecond, Registerer: metrics})
	conflicts := func(reason string) float64 {
		mfs, err := metrics.Gather()
		require.NoError(t, err)
		for _, mf := range mfs {
			for _, m := range mf.GetMetric() {
				if mf.GetName() == "isthmus_registry_address_conflicts" && m.GetLabel()[0].GetValue() == reason {
					return m.GetGauge().GetValue()
				}
			}
		}
		t.Fatalf("no conflicts series for %s", reason)
		return 0
	}
	ext := model.ServiceKey{Namespace: "tenant", Name: "ext"}
	victim := podAt("c2", "prod", "db-0", "10.1.0.5", 100)
	claim := sliceAt("c1", ext, "10.1.0.5", 50) // older, but a slice address
	published := func() {
		require.Eventually(t, func() bool {
			reg.feed.mu.Lock()
			defer reg.feed.mu.Unlock()
			return len(reg.feed.pending) == 0
		}, time.Second, time.Millisecond)
	}
	reg.Activate("c1", 1, state([]*model.ClusterService{selectorless("c1", ext)}, map[model.ServiceKey][]model.Endpoint{ext: {claim}}))
	published()
	require.True(t, reg.OwnsAddresses(claim.Workload.UID), "alone, the slice address owns it")
	require.Len(t, reg.Service("ext.tenant.svc.cluster.local").Shards["c1"], 1)

	// The pod of another namespace in another cluster of the network comes:
	// it owns its address, and the tenant's slice address is dropped.
	st2 := state(nil, nil)
	st2.Workloads[victim.UID] = victim
	before := rec.count()
	reg.Activate("c2", 1, st2)
	assert.True(t, reg.OwnsAddresses(victim.UID))
	assert.False(t, reg.OwnsAddresses(claim.Workload.UID))
	assert.Empty(t, reg.Service("ext.tenant.svc.cluster.local").Shards["c1"], "dropped from its service")
	assert.NotNil(t, reg.Workload(claim.Workload.UID), "still known, for the debug views")
	assert.Equal(t, []AddressConflict{{Network: "net1", Address: "10.1.0.5", Owner: victim.UID,
		Losers: []AddressLoser{{Workload: claim.Workload.UID, Reason: ReasonOtherNamespace, Dropped: true}}}}, reg.AddressConflicts())
	assert.Equal(t, 1.0, conflicts(ReasonOtherNamespace))
	published()
	announced(t, rec, before, []model.Change{
		{Kind: model.WorkloadChange, Op: model.Updated, Key: claim.Workload.UID},
		{Kind: model.ServiceChange, Op: model.Updated, Key: "ext.tenant.svc.cluster.local"},
	})

	// A second pod at the address, younger: the first keeps it. Then the
	// first goes: the second takes over, announced in the same change set.
	twin := podAt("c1", "prod", "db-1", "10.1.0.5", 200)
	reg.Update("c1", 1, &model.ClusterDelta{Workloads: map[string]*model.Workload{twin.UID: twin}})
	assert.False(t, reg.OwnsAddresses(twin.UID))
	published()
	assert.Equal(t, 1.0, conflicts(ReasonDuplicatePod))
	before = rec.count()
	reg.Deactivate("c2", 1)
	assert.True(t, reg.OwnsAddresses(twin.UID), "the other claimant takes over")
	assert.Empty(t, reg.Service("ext.tenant.svc.cluster.local").Shards["c1"], "still another namespace's pod address")
	published()
	announced(t, rec, before, []model.Change{
		{Kind: model.WorkloadChange, Op: model.Removed, Key: victim.UID},
		{Kind: model.WorkloadChange, Op: model.Updated, Key: twin.UID},
	})
	require.Len(t, rec.all()[before:], 1, "one change set")
	assert.Equal(t, 0.0, conflicts(ReasonDuplicatePod))

	// The pod goes: the slice address is the owner and back in its service.
	reg.Update("c1", 1, &model.ClusterDelta{Workloads: map[string]*model.Workload{twin.UID: nil}})
	assert.True(t, reg.OwnsAddresses(claim.Workload.UID))
	assert.Len(t, reg.Service("ext.tenant.svc.cluster.local").Shards["c1"], 1)
	assert.Empty(t, reg.AddressConflicts())
	assert.Equal(t, 0.0, conflicts(ReasonOtherNamespace))
}

// TestAddressOwnershipSameNamespace: in one namespace a pod beats a slice
// address listing it without naming it, which stays an endpoint of its
// service; one naming it by targetRef is no conflict at all; between two
// slice addresses the older wins; a hostNetwork pod claims nothing.
func TestAddressOwnershipSameNamespace(t *testing.T) {
	reg, _ := run(t, Config{QuietPeriod: 5 * time.Millisecond})
	a, b := model.ServiceKey{Namespace: "prod", Name: "a"}, model.ServiceKey{Namespace: "prod", Name: "b"}
	pod := podAt("c1", "prod", "db-0", "10.1.0.5", 100)
	listed := sliceAt("c1", a, "10.1.0.5", 50)
	named := sliceAt("c1", b, "10.1.0.5", 300)
	named.Workload.Name, named.Workload.Placement = pod.Name, pod.Placement // bound by its targetRef
	older, younger := sliceAt("c1", a, "10.2.0.1", 10), sliceAt("c1", b, "10.2.0.1", 20)
	node := podAt("c1", "kube-system", "agent", "10.2.0.1", 1)
	node.HostNetwork = true
	st := state([]*model.ClusterService{selectorless("c1", a), selectorless("c1", b)},
		map[model.ServiceKey][]model.Endpoint{a: {listed, older}, b: {named, younger}})
	st.Workloads[pod.UID], st.Workloads[node.UID] = pod, node
	reg.Activate("c1", 1, st)

	assert.True(t, reg.OwnsAddresses(pod.UID))
	assert.False(t, reg.OwnsAddresses(listed.Workload.UID))
	assert.False(t, reg.OwnsAddresses(named.Workload.UID))
	assert.True(t, reg.OwnsAddresses(older.Workload.UID))
	assert.False(t, reg.OwnsAddresses(younger.Workload.UID))
	assert.False(t, reg.OwnsAddresses(node.UID), "hostNetwork pods own no address")
	assert.Len(t, reg.Service("a.prod.svc.cluster.local").Shards["c1"], 2, "same-namespace losers stay endpoints")
	assert.Len(t, reg.Service("b.prod.svc.cluster.local").Shards["c1"], 2)
	assert.Equal(t, []AddressConflict{
		{Network: "net1", Address: "10.1.0.5", Owner: pod.UID, Losers: []AddressLoser{{Workload: listed.Workload.UID, Reason: ReasonPodAddress}}},
		{Network: "net1", Address: "10.2.0.1", Owner: older.Workload.UID, Losers: []AddressLoser{{Workload: younger.Workload.UID, Reason: ReasonDuplicateSlice}}},
	}, reg.AddressConflicts(), "the slice address naming its pod is not listed")
	assert.Equal(t, map[string]int{ReasonPodAddress: 1, ReasonDuplicateSlice: 1}, reg.ConflictCounts())
}

// announced waits until the change sets recorded since the i-th hold want:
// the feed clears its pending changes before its subscriber records them.
func announced(t *testing.T, rec *recorder, i int, want []model.Change) {
	t.Helper()
	assert.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.Subset(c, changesSince(rec, i), want)
	}, time.Second, time.Millisecond)
}

func changesSince(rec *recorder, i int) []model.Change {
	var out []model.Change
	for _, cs := range rec.all()[i:] {
		out = append(out, cs.Changes...)
	}
	return out
}
