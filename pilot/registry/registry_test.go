package registry

import (
	"context"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// recorder collects change sets.
type recorder struct {
	mu   sync.Mutex
	sets []model.ChangeSet
	at   []time.Time
}

func (r *recorder) fn(cs model.ChangeSet) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sets = append(r.sets, cs)
	r.at = append(r.at, time.Now())
}

func (r *recorder) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.sets)
}

func (r *recorder) all() []model.ChangeSet {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]model.ChangeSet(nil), r.sets...)
}

func run(t *testing.T, cfg Config) (*Registry, *recorder) {
	t.Helper()
	reg := New(cfg)
	rec := &recorder{}
	reg.Subscribe(rec.fn)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = reg.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return reg, rec
}

func svc(cluster model.ClusterID, ns, name string, created time.Time, ports ...model.Port) *model.ClusterService {
	return &model.ClusterService{Cluster: cluster, Name: name, Namespace: ns, Ports: ports, Selector: map[string]string{"app": name},
		Created: created, VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.1")}}
}

func ep(cluster model.ClusterID, net model.Network, addr string) model.Endpoint {
	w := &model.Workload{UID: string(cluster) + "/demo/" + addr, Addresses: []netip.Addr{netip.MustParseAddr(addr)},
		Placement: &model.Placement{Cluster: cluster, Network: net, Namespace: "demo", ServiceAccount: "default"}, Ready: true}
	return model.Endpoint{Workload: w, Ports: []model.PortMapping{{ServicePort: 80, TargetPort: 8080}}}
}

func state(services []*model.ClusterService, shards map[model.ServiceKey][]model.Endpoint) *model.ClusterState {
	st := &model.ClusterState{Services: map[model.ServiceKey]*model.ClusterService{}, Shards: shards, Workloads: map[string]*model.Workload{}}
	for _, s := range services {
		st.Services[s.Key()] = s
	}
	return st
}

var (
	t0       = time.Unix(1000, 0)
	httpPort = model.Port{Name: "http", Port: 80, TargetPort: 8080, Protocol: model.TCP}
	echo     = model.ServiceKey{Namespace: "demo", Name: "echo"}
)

func TestNamespaceSamenessAndPortConflicts(t *testing.T) {
	reg, _ := run(t, Config{})
	grpc2 := model.Port{Name: "grpc", Port: 9090, TargetPort: 9090, Protocol: model.TCP}
	reg.Activate("c1", 1, state([]*model.ClusterService{svc("c1", "demo", "echo", t0, httpPort)},
		map[model.ServiceKey][]model.Endpoint{echo: {ep("c1", "n1", "10.0.0.1")}}))
	conflicting := model.Port{Name: "http", Port: 8000, TargetPort: 8080, Protocol: model.TCP}
	reg.Activate("c2", 1, state([]*model.ClusterService{svc("c2", "demo", "echo", t0.Add(time.Hour), conflicting, grpc2)},
		map[model.ServiceKey][]model.Endpoint{echo: {ep("c2", "n2", "10.1.0.1"), ep("c2", "n2", "10.1.0.2")}}))

	s := reg.Service("echo.demo.svc.cluster.local")
	require.NotNil(t, s)
	require.Equal(t, []model.ClusterID{"c1", "c2"}, s.Clusters)
	require.Equal(t, []model.Port{httpPort, grpc2}, s.Ports, "ports merged by name, the oldest definition wins")
	require.Len(t, s.PortConflicts, 1)
	require.Contains(t, s.PortConflicts[0], "c2")
	require.Len(t, s.Shards["c1"], 1)
	require.Len(t, s.Shards["c2"], 2)
	require.Len(t, s.VIPs, 2)
	require.Equal(t, model.ScopeGlobal, s.Scope)
	require.True(t, s.ShardVisible("c2", "c1"))
}

func TestClusterLocalAndExportMode(t *testing.T) {
	reg, _ := run(t, Config{ExportMode: true})
	ks := svc("c2", "kube-system", "kube-dns", t0, httpPort)
	exported := svc("c2", "demo", "echo", t0, httpPort)
	exported.Exported = true
	notExported := svc("c2", "demo", "private", t0, httpPort)
	reg.Activate("c2", 1, state([]*model.ClusterService{ks, exported, notExported}, nil))

	dns := reg.Service("kube-dns.kube-system.svc.cluster.local")
	require.Equal(t, model.ScopeClusterLocal, dns.Scope)
	require.False(t, dns.ShardVisible("c2", "c1"), "kube-system never leaves its cluster")
	require.True(t, dns.ShardVisible("c2", "c2"))

	require.True(t, reg.Service("echo.demo.svc.cluster.local").ShardVisible("c2", "c1"))
	require.NotNil(t, reg.Service("echo.demo.svc.clusterset.local"), "exported services resolve in clusterset.local")
	private := reg.Service("private.demo.svc.cluster.local")
	require.False(t, private.ShardVisible("c2", "c1"), "not exported: local to its cluster")
	require.Nil(t, reg.Service("private.demo.svc.clusterset.local"))
}

func TestEqualActivationAndUpdatesEmitNothing(t *testing.T) {
	reg, rec := run(t, Config{QuietPeriod: 10 * time.Millisecond})
	shards := map[model.ServiceKey][]model.Endpoint{echo: {ep("c1", "n1", "10.0.0.1")}}
	reg.Activate("c1", 1, state([]*model.ClusterService{svc("c1", "demo", "echo", t0, httpPort)}, shards))
	require.Eventually(t, func() bool { return rec.count() == 1 }, time.Second, time.Millisecond)

	// A new generation with equal state (a rotated token) changes nothing.
	reg.Activate("c1", 2, state([]*model.ClusterService{svc("c1", "demo", "echo", t0, httpPort)},
		map[model.ServiceKey][]model.Endpoint{echo: {ep("c1", "n1", "10.0.0.1")}}))
	// An equal update of the serving generation changes nothing either.
	reg.Update("c1", 2, &model.ClusterDelta{Shards: map[model.ServiceKey][]model.Endpoint{echo: {ep("c1", "n1", "10.0.0.1")}}})
	// The old generation's updates and removal are ignored.
	reg.Update("c1", 1, &model.ClusterDelta{Shards: map[model.ServiceKey][]model.Endpoint{echo: nil}})
	reg.Deactivate("c1", 1)
	// A change to another service, made after them: the next change set
	// holds it alone. Anything the calls above had emitted would come
	// before it or with it (the registry applies calls in order).
	reg.Update("c1", 2, &model.ClusterDelta{Services: map[model.ServiceKey]*model.ClusterService{{Namespace: "demo", Name: "marker"}: svc("c1", "demo", "marker", t0, httpPort)}})
	require.Eventually(t, func() bool { return rec.count() >= 2 }, time.Second, time.Millisecond)
	require.Equal(t, 2, rec.count())
	require.Equal(t, []model.Change{{Kind: model.ServiceChange, Op: model.Added, Key: "marker.demo.svc.cluster.local"}}, rec.all()[1].Changes)
	require.Len(t, reg.Service("echo.demo.svc.cluster.local").Shards["c1"], 1)

	// A real change is published.
	reg.Update("c1", 2, &model.ClusterDelta{Shards: map[model.ServiceKey][]model.Endpoint{echo: {ep("c1", "n1", "10.0.0.2")}}})
	require.Eventually(t, func() bool { return rec.count() == 3 }, time.Second, time.Millisecond)
	require.Equal(t, []model.Change{{Kind: model.ServiceChange, Op: model.Updated, Key: "echo.demo.svc.cluster.local"}}, rec.all()[2].Changes)
}

func TestDeactivateRemovesEverythingInOneEvent(t *testing.T) {
	reg, rec := run(t, Config{QuietPeriod: 10 * time.Millisecond})
	w := &model.Workload{UID: "c2/demo/echo-0", Placement: &model.Placement{Cluster: "c2", Node: "n", Namespace: "demo", ServiceAccount: "echo", Network: "net-2"}}
	st := state([]*model.ClusterService{svc("c2", "demo", "echo", t0, httpPort), svc("c2", "demo", "other", t0, httpPort)},
		map[model.ServiceKey][]model.Endpoint{echo: {ep("c2", "n2", "10.1.0.1")}})
	st.Workloads[w.UID] = w
	st.Gateways = []model.NetworkGateway{{Network: "n2", Cluster: "c2", Address: netip.MustParseAddr("10.1.255.1"), HBONEPort: 15008}}
	reg.Activate("c1", 1, state([]*model.ClusterService{svc("c1", "demo", "echo", t0, httpPort)}, nil))
	reg.Activate("c2", 1, st)
	require.Eventually(t, func() bool { return reg.Service("other.demo.svc.cluster.local") != nil }, time.Second, time.Millisecond)
	require.True(t, reg.ServiceAccountOnNode("c2", "n", "demo", "echo"))
	require.False(t, reg.ServiceAccountOnNode("c2", "", "demo", "echo"), "a pod always names its node")
	require.Equal(t, []model.Network{"net-2"}, reg.IdentityNetworks("c2", "n", "demo", "echo"))
	require.Equal(t, []model.Network{"net-2"}, reg.IdentityNetworks("c2", "", "demo", "echo"), "anywhere in c2")
	require.Empty(t, reg.IdentityNetworks("c1", "", "demo", "echo"))
	require.Empty(t, reg.IdentityNetworks("c2", "other-node", "demo", "echo"))
	time.Sleep(30 * time.Millisecond)
	before := rec.count()

	reg.Deactivate("c2", 1)
	require.Eventually(t, func() bool { return rec.count() == before+1 }, time.Second, time.Millisecond)
	time.Sleep(30 * time.Millisecond)
	require.Equal(t, before+1, rec.count(), "one event")
	last := rec.all()[before]
	require.ElementsMatch(t, []model.Change{
		{Kind: model.ServiceChange, Op: model.Updated, Key: "echo.demo.svc.cluster.local"},
		{Kind: model.ServiceChange, Op: model.Removed, Key: "other.demo.svc.cluster.local"},
		{Kind: model.WorkloadChange, Op: model.Removed, Key: "c2/demo/echo-0"},
		{Kind: model.GatewayChange, Op: model.Removed, Key: "n2"},
	}, last.Changes)
	require.Equal(t, []model.ClusterID{"c1"}, reg.Service("echo.demo.svc.cluster.local").Clusters)
	require.False(t, reg.ServiceAccountOnNode("c2", "n", "demo", "echo"))
	require.Empty(t, reg.IdentityNetworks("c2", "", "demo", "echo"))
}

func TestStaleClusterKeptThenRemovedAfterGrace(t *testing.T) {
	reg, _ := run(t, Config{StaleGrace: 100 * time.Millisecond})
	reg.Activate("c2", 1, state([]*model.ClusterService{svc("c2", "demo", "echo", t0, httpPort)}, nil))
	reg.SetReachable("c2", false)
	require.Contains(t, reg.StaleClusters(), model.ClusterID("c2"))
	require.NotNil(t, reg.Service("echo.demo.svc.cluster.local"), "last state kept while stale")
	require.Eventually(t, func() bool { return reg.Service("echo.demo.svc.cluster.local") == nil }, 2*time.Second, 5*time.Millisecond)

	// Reachable again before the grace: nothing is removed.
	reg.Activate("c3", 1, state([]*model.ClusterService{svc("c3", "demo", "echo", t0, httpPort)}, nil))
	reg.SetReachable("c3", false)
	reg.SetReachable("c3", true)
	time.Sleep(200 * time.Millisecond)
	require.NotNil(t, reg.Service("echo.demo.svc.cluster.local"))
	require.Empty(t, reg.StaleClusters())
}

func TestDebounceLeadingEdgeBurstAndMaxDelay(t *testing.T) {
	put := func(reg *Registry, i int) {
		reg.Update("c1", 1, &model.ClusterDelta{Workloads: map[string]*model.Workload{
			"c1/default/w": {UID: "c1/default/w", Placement: &model.Placement{Cluster: "c1"}, Addresses: []netip.Addr{netip.AddrFrom4([4]byte{10, 0, byte(i >> 8), byte(i)})}},
		}})
	}
	t.Run("leading edge", func(t *testing.T) {
		// With an hour of quiet period, only the leading edge can publish.
		reg, rec := run(t, Config{QuietPeriod: time.Hour, MaxDelay: time.Hour})
		reg.Activate("c1", 1, state(nil, nil))
		put(reg, 0)
		require.Eventually(t, func() bool { return rec.count() == 1 }, 10*time.Second, time.Millisecond)
		put(reg, 1) // within the quiet period: held back
		time.Sleep(100 * time.Millisecond)
		require.Equal(t, 1, rec.count())
	})
	t.Run("burst merged", func(t *testing.T) {
		// The leading push is held in its subscriber until the whole burst
		// has arrived: whatever the machine's speed, the 199 changes that
		// follow it wait in the feed and leave in one merged push.
		reg := New(Config{QuietPeriod: 50 * time.Millisecond, MaxDelay: time.Hour})
		rec := &recorder{}
		entered, release := make(chan struct{}), make(chan struct{})
		var once sync.Once
		reg.Subscribe(func(cs model.ChangeSet) {
			once.Do(func() { close(entered); <-release })
			rec.fn(cs)
		})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { _ = reg.Run(ctx); close(done) }()
		t.Cleanup(func() { cancel(); <-done })

		reg.Activate("c1", 1, state(nil, nil))
		put(reg, 0)
		<-entered
		for i := 1; i < 200; i++ {
			put(reg, i)
		}
		close(release)
		require.Eventually(t, func() bool { return rec.count() == 2 }, 10*time.Second, time.Millisecond)
		require.Equal(t, netip.AddrFrom4([4]byte{10, 0, 0, 199}), reg.Workload("c1/default/w").Addresses[0])
		// A sentinel change comes alone in the next push: nothing of the
		// burst was left behind for a third one.
		reg.Update("c1", 1, &model.ClusterDelta{Workloads: map[string]*model.Workload{
			"c1/default/sentinel": {UID: "c1/default/sentinel", Placement: &model.Placement{Cluster: "c1"}},
		}})
		require.Eventually(t, func() bool { return rec.count() == 3 }, 10*time.Second, time.Millisecond)
		sets := rec.all()
		require.Equal(t, []model.Change{{Kind: model.WorkloadChange, Op: model.Updated, Key: "c1/default/w"}}, sets[1].Changes,
			"200 changes cost the leading push and one merged push")
		require.Equal(t, []model.Change{{Kind: model.WorkloadChange, Op: model.Added, Key: "c1/default/sentinel"}}, sets[2].Changes)
	})
	t.Run("max delay", func(t *testing.T) {
		// The quiet period never ends while changes keep coming; MaxDelay publishes anyway.
		reg, rec := run(t, Config{QuietPeriod: time.Hour, MaxDelay: 20 * time.Millisecond})
		reg.Activate("c1", 1, state(nil, nil))
		for i := 0; rec.count() < 3 && i < 5000; i++ {
			put(reg, i)
			time.Sleep(time.Millisecond)
		}
		require.GreaterOrEqual(t, rec.count(), 3)
	})
}

// TestWorkloadsFromSlicesLiveInShards: workloads made from EndpointSlice
// addresses come only inside their service's shard, yet the registry
// serves, announces, counts and removes them like any other.
func TestWorkloadsFromSlicesLiveInShards(t *testing.T) {
	reg, rec := run(t, Config{QuietPeriod: 5 * time.Millisecond})
	k := model.ServiceKey{Namespace: "db", Name: "pg"}
	made := func(addr string, ready bool) model.Endpoint {
		uid := model.SliceWorkloadPrefix("c1", k) + addr
		return model.Endpoint{Workload: &model.Workload{UID: uid, Name: addr, Addresses: []netip.Addr{netip.MustParseAddr(addr)},
			Placement: &model.Placement{Cluster: "c1", Network: "n1", Node: "node-a", Namespace: "db", ServiceAccount: "default"},
			Ready:     ready, FromSlice: true}, Ports: []model.PortMapping{{ServicePort: 80, TargetPort: 8080}}}
	}
	a, b := made("10.0.0.1", true), made("10.0.0.2", true)
	pgSvc := svc("c1", "db", "pg", t0, httpPort)
	pgSvc.Selector = nil
	st := state([]*model.ClusterService{pgSvc}, map[model.ServiceKey][]model.Endpoint{k: {a, b}})
	reg.Activate("c1", 1, st)
	assert.Same(t, a.Workload, reg.Workload(a.Workload.UID))
	assert.ElementsMatch(t, []*model.Workload{a.Workload, b.Workload}, reg.Workloads())
	assert.True(t, reg.ServiceAccountOnNode("c1", "node-a", "db", "default"))
	require.Eventually(t, func() bool { return rec.count() > 0 }, time.Second, time.Millisecond)
	assert.Subset(t, rec.all()[0].Changes, []model.Change{
		{Kind: model.WorkloadChange, Op: model.Added, Key: a.Workload.UID},
		{Kind: model.WorkloadChange, Op: model.Added, Key: b.Workload.UID},
	})

	// b goes unready and a goes: the delta names both, with the new shard.
	b2 := made("10.0.0.2", false)
	before := rec.count()
	reg.Update("c1", 1, &model.ClusterDelta{
		Shards:    map[model.ServiceKey][]model.Endpoint{k: {b2}},
		Workloads: map[string]*model.Workload{a.Workload.UID: nil, b2.Workload.UID: b2.Workload},
	})
	assert.Nil(t, reg.Workload(a.Workload.UID))
	assert.Same(t, b2.Workload, reg.Workload(b2.Workload.UID))
	assert.Equal(t, []*model.Workload{b2.Workload}, reg.Workloads())
	require.Eventually(t, func() bool { return rec.count() > before }, time.Second, time.Millisecond)
	assert.Subset(t, rec.all()[before].Changes, []model.Change{
		{Kind: model.WorkloadChange, Op: model.Removed, Key: a.Workload.UID},
		{Kind: model.WorkloadChange, Op: model.Updated, Key: b2.Workload.UID},
	})

	// The cluster goes: so do they, and the identity with them.
	before = rec.count()
	reg.Deactivate("c1", 1)
	assert.Empty(t, reg.Workloads())
	assert.False(t, reg.ServiceAccountOnNode("c1", "node-a", "db", "default"))
	require.Eventually(t, func() bool { return rec.count() > before }, time.Second, time.Millisecond)
	assert.Contains(t, rec.all()[before].Changes, model.Change{Kind: model.WorkloadChange, Op: model.Removed, Key: b2.Workload.UID})
}

// TestServiceScopeConflict: echo is global in c1 and local in c2. A client
// in c2 sees both shards (its own, and c1's global one); clients in c1 and
// in c3 (which does not define echo) see only c1's. A Service relabelled
// local in its last global cluster leaves every shard local; and in export
// mode a shard crosses clusters only if global and exported.
func TestServiceScopeConflict(t *testing.T) {
	reg, _ := run(t, Config{})
	global := svc("c1", "demo", "echo", t0, httpPort)
	local := svc("c2", "demo", "echo", t0, httpPort)
	local.ScopeLocal = true
	reg.Activate("c1", 1, state([]*model.ClusterService{global}, map[model.ServiceKey][]model.Endpoint{echo: {ep("c1", "n1", "10.0.0.1")}}))
	reg.Activate("c2", 1, state([]*model.ClusterService{local}, map[model.ServiceKey][]model.Endpoint{echo: {ep("c2", "n2", "10.0.1.1")}}))
	s := reg.Service("echo.demo.svc.cluster.local")
	require.Equal(t, map[model.ClusterID]bool{"c2": true}, s.LocalClusters)
	for _, tc := range []struct {
		shard, client model.ClusterID
		want          bool
	}{
		{"c1", "c2", true}, {"c2", "c2", true}, {"c1", "c1", true}, {"c2", "c1", false}, {"c1", "c3", true}, {"c2", "c3", false},
	} {
		require.Equal(t, tc.want, s.ShardVisible(tc.shard, tc.client), "shard %s to a client in %s", tc.shard, tc.client)
	}

	relabelled := *global
	relabelled.ScopeLocal = true
	reg.Update("c1", 1, &model.ClusterDelta{Services: map[model.ServiceKey]*model.ClusterService{echo: &relabelled}})
	s = reg.Service("echo.demo.svc.cluster.local")
	require.Equal(t, map[model.ClusterID]bool{"c1": true, "c2": true}, s.LocalClusters)
	require.False(t, s.ShardVisible("c1", "c2"))

	mcs, _ := run(t, Config{ExportMode: true})
	exportedLocal := svc("c1", "demo", "echo", t0, httpPort)
	exportedLocal.Exported, exportedLocal.ScopeLocal = true, true
	exportedGlobal := svc("c2", "demo", "echo", t0, httpPort)
	exportedGlobal.Exported = true
	mcs.Activate("c1", 1, state([]*model.ClusterService{exportedLocal}, nil))
	require.Nil(t, mcs.Service("echo.demo.svc.clusterset.local"), "exported but local: not in the clusterset")
	mcs.Activate("c2", 1, state([]*model.ClusterService{exportedGlobal}, nil))
	s = mcs.Service("echo.demo.svc.clusterset.local")
	require.NotNil(t, s)
	require.Equal(t, map[model.ClusterID]bool{"c1": true}, s.LocalClusters)
}
