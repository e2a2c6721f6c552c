package state

import (
	"context"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func svcFoo() *Service {
	return &Service{Name: "foo", Namespace: "default", VIPs: []netip.Addr{netip.MustParseAddr("10.0.0.10")}, Ports: []uint16{80}}
}

const fooKey = "default/foo.default.svc.cluster.local"

func pod(uid, addr, network, cluster string, loc Locality) *Workload {
	w := &Workload{
		UID: uid, Name: uid, Namespace: "default", Network: network, Cluster: cluster, Locality: loc,
		TrustDomain: "cluster.local", ServiceAccount: "foo", Protocol: TunnelHBONE,
		Services: map[string]PortMap{fooKey: {80: 8080}},
	}
	if addr != "" {
		w.Addresses = []netip.Addr{netip.MustParseAddr(addr)}
	}
	return w
}

func TestStoreIndexesAndRemovals(t *testing.T) {
	st := NewStore()
	first := st.Load()
	snap := st.Update(func(tx *Tx) {
		tx.UpsertService(svcFoo())
		tx.UpsertWorkload(pod("a", "10.1.0.1", "n1", "c1", Locality{}))
		tx.UpsertWorkload(pod("b", "10.1.0.2", "n1", "c1", Locality{}))
		tx.UpsertWorkload(&Workload{UID: "split/n2/foo", Name: "foo", Namespace: "default", Network: "n2",
			Gateways: []*NetworkGateway{{Network: "n2", Address: netip.MustParseAddr("10.2.0.100"), HBONEPort: 15008}}})
	})
	select {
	case <-first.Stale():
	default:
		t.Fatal("old snapshot not marked stale")
	}
	require.Equal(t, uint64(1), snap.Version())
	svc, ok := snap.ServiceByHostname("foo.default.svc.cluster.local")
	require.True(t, ok)
	require.Equal(t, fooKey, svc.Key())
	byVIP, ok := snap.ServiceByVIP(netip.MustParseAddr("10.0.0.10"))
	require.True(t, ok)
	require.Same(t, svc, byVIP)
	w, ok := snap.WorkloadByAddr(netip.MustParseAddr("10.1.0.2"))
	require.True(t, ok)
	require.Equal(t, "b", w.UID)
	require.Len(t, snap.Endpoints(fooKey), 2)
	gws := snap.Gateways()
	require.Len(t, gws, 1)
	require.Equal(t, "10.2.0.100:15008", gws[0].AddrPort().String())

	// Move b to a new address, remove a and the service VIP changes.
	snap2 := st.Update(func(tx *Tx) {
		tx.RemoveWorkload("a")
		tx.UpsertWorkload(pod("b", "10.1.0.3", "n1", "c1", Locality{}))
		s := svcFoo()
		s.VIPs = []netip.Addr{netip.MustParseAddr("10.0.0.11")}
		tx.UpsertService(s)
		tx.RemoveWorkload("split/n2/foo")
	})
	_, ok = snap2.WorkloadByAddr(netip.MustParseAddr("10.1.0.1"))
	require.False(t, ok)
	_, ok = snap2.WorkloadByAddr(netip.MustParseAddr("10.1.0.2"))
	require.False(t, ok)
	_, ok = snap2.WorkloadByAddr(netip.MustParseAddr("10.1.0.3"))
	require.True(t, ok)
	_, ok = snap2.ServiceByVIP(netip.MustParseAddr("10.0.0.10"))
	require.False(t, ok)
	_, ok = snap2.ServiceByVIP(netip.MustParseAddr("10.0.0.11"))
	require.True(t, ok)
	require.Len(t, snap2.Endpoints(fooKey), 1)
	require.Empty(t, snap2.Gateways())

	// The old snapshot is untouched.
	require.Len(t, snap.Endpoints(fooKey), 2)
	_, ok = snap.WorkloadByAddr(netip.MustParseAddr("10.1.0.1"))
	require.True(t, ok)
}

func TestUpsertCopiesInput(t *testing.T) {
	st := NewStore()
	w := pod("a", "10.1.0.1", "n1", "c1", Locality{})
	snap := st.Update(func(tx *Tx) { tx.UpsertWorkload(w) })
	w.Addresses[0] = netip.MustParseAddr("10.9.9.9")
	w.Services[fooKey][80] = 1
	got, ok := snap.Workload("a")
	require.True(t, ok)
	require.Equal(t, "10.1.0.1", got.Addresses[0].String())
	tp, ok := got.TargetPort(fooKey, 80)
	require.True(t, ok)
	require.Equal(t, uint16(8080), tp)
}

func TestSelectPreference(t *testing.T) {
	src := Source{Network: "n1", Cluster: "c1", Locality: Locality{Region: "r1", Zone: "z1", Subzone: "s1"}}
	synthetic := &Workload{
		UID: "n2/foo", Name: "foo", Namespace: "default", Network: "n2", Status: StatusReady, Capacity: 3,
		Gateways: []*NetworkGateway{{Network: "n2", Address: netip.MustParseAddr("10.2.0.100"), HBONEPort: 15008}},
		Services: map[string]PortMap{fooKey: {80: 8080}},
	}
	tests := []struct {
		name      string
		workloads []*Workload
		want      []string // acceptable UIDs
	}{
		{
			name: "same network beats remote gateway",
			workloads: []*Workload{
				pod("local", "10.1.0.1", "n1", "c9", Locality{}), synthetic,
			},
			want: []string{"local"},
		},
		{
			name: "same cluster beats other cluster",
			workloads: []*Workload{
				pod("other", "10.1.0.1", "n1", "c2", Locality{Region: "r1", Zone: "z1", Subzone: "s1"}),
				pod("same", "10.1.0.2", "n1", "c1", Locality{}),
			},
			want: []string{"same"},
		},
		{
			name: "same zone beats same region",
			workloads: []*Workload{
				pod("region", "10.1.0.1", "n1", "c1", Locality{Region: "r1", Zone: "z2"}),
				pod("zone", "10.1.0.2", "n1", "c1", Locality{Region: "r1", Zone: "z1"}),
				pod("far", "10.1.0.3", "n1", "c1", Locality{Region: "r2", Zone: "z1"}),
			},
			want: []string{"zone"},
		},
		{
			name: "unready local fails over to gateway",
			workloads: func() []*Workload {
				l := pod("local", "10.1.0.1", "n1", "c1", Locality{})
				l.Status = StatusNotReady
				tm := pod("term", "10.1.0.2", "n1", "c1", Locality{})
				tm.Status = StatusTerminating
				return []*Workload{l, tm, synthetic}
			}(),
			want: []string{"n2/foo"},
		},
		{
			name: "workload without the port is skipped",
			workloads: func() []*Workload {
				l := pod("local", "10.1.0.1", "n1", "c1", Locality{})
				l.Services = map[string]PortMap{fooKey: {81: 8081}}
				return []*Workload{l, synthetic}
			}(),
			want: []string{"n2/foo"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			st := NewStore()
			snap := st.Update(func(tx *Tx) {
				tx.UpsertService(svcFoo())
				for _, w := range tc.workloads {
					tx.UpsertWorkload(w)
				}
			})
			svc, _ := snap.ServiceByHostname("foo.default.svc.cluster.local")
			for range 20 {
				ep, err := Selector{}.Select(snap, svc, 80, src)
				require.NoError(t, err)
				require.Contains(t, tc.want, ep.Workload.UID)
				require.Equal(t, uint16(8080), ep.TargetPort)
			}
		})
	}
}

func TestSelectNoEndpoint(t *testing.T) {
	st := NewStore()
	l := pod("local", "10.1.0.1", "n1", "c1", Locality{})
	l.Status = StatusNotReady
	snap := st.Update(func(tx *Tx) { tx.UpsertService(svcFoo()); tx.UpsertWorkload(l) })
	svc, _ := snap.ServiceByHostname("foo.default.svc.cluster.local")
	_, err := Selector{}.Select(snap, svc, 80, Source{Network: "n1"})
	require.ErrorIs(t, err, ErrNoEndpoint)
	_, err = Selector{}.Select(snap, svc, 81, Source{Network: "n1"})
	require.ErrorIs(t, err, ErrNoEndpoint)
}

func TestSelectWeightedByCapacity(t *testing.T) {
	st := NewStore()
	a := pod("a", "10.1.0.1", "n1", "c1", Locality{})
	a.Capacity = 3
	b := pod("b", "10.1.0.2", "n1", "c1", Locality{})
	snap := st.Update(func(tx *Tx) { tx.UpsertService(svcFoo()); tx.UpsertWorkload(a); tx.UpsertWorkload(b) })
	svc, _ := snap.ServiceByHostname("foo.default.svc.cluster.local")
	counts := map[string]int{}
	for n := range uint64(4) { // enumerate the whole [0, total) range
		sel := Selector{Rand: func(total uint64) uint64 { require.Equal(t, uint64(4), total); return n }}
		ep, err := sel.Select(snap, svc, 80, Source{Network: "n1", Cluster: "c1"})
		require.NoError(t, err)
		counts[ep.Workload.UID]++
	}
	require.Equal(t, map[string]int{"a": 3, "b": 1}, counts)
}

func TestConcurrentReadersSeeWholeSnapshots(t *testing.T) {
	st := NewStore()
	var (
		wg    sync.WaitGroup
		torn  atomic.Int64
		reads atomic.Int64
	)
	done := make(chan struct{})
	wg.Go(func() {
		for {
			select {
			case <-done:
				return
			default:
			}
			snap := st.Load()
			// Every update adds a workload and a service together.
			if len(snap.Workloads()) != len(snap.Services()) {
				torn.Add(1)
			}
			reads.Add(1)
		}
	})
	for i := range 200 {
		st.Update(func(tx *Tx) {
			w := pod(string(rune('a'+i%26))+string(rune('0'+i/26)), "", "n1", "c1", Locality{})
			w.Addresses = []netip.Addr{netip.AddrFrom4([4]byte{10, 3, byte(i / 256), byte(i)})}
			tx.UpsertWorkload(w)
			tx.UpsertService(&Service{Name: w.UID, Namespace: "default", Ports: []uint16{80}})
		})
	}
	close(done)
	wg.Wait()
	require.Len(t, st.Load().Workloads(), 200)
	require.Zero(t, torn.Load())
	require.Positive(t, reads.Load())
}

// TestAddressClaims: two workloads claiming one address (a misbehaving or
// lagging control plane) never leave the address to nobody: the owner is
// the smallest UID whatever the order of writes, and removing either
// claimant leaves the other's entry. hostNetwork workloads claim nothing.
func TestAddressClaims(t *testing.T) {
	addr := netip.MustParseAddr("10.1.0.7")
	for _, order := range [][]string{{"a", "b"}, {"b", "a"}} {
		st := NewStore()
		for _, uid := range order {
			st.Update(func(tx *Tx) { tx.UpsertWorkload(pod(uid, addr.String(), "n1", "c1", Locality{})) })
		}
		snap := st.Load()
		w, ok := snap.WorkloadByAddr(addr)
		require.True(t, ok)
		require.Equal(t, "a", w.UID, "order %v", order)
		require.Equal(t, map[netip.Addr][]string{addr: {"a", "b"}}, snap.Contested())

		// Removing the owner passes the address to the other claimant.
		snap = st.Update(func(tx *Tx) { tx.RemoveWorkload("a") })
		w, ok = snap.WorkloadByAddr(addr)
		require.True(t, ok)
		require.Equal(t, "b", w.UID)
		require.Empty(t, snap.Contested())

		// Removing the other instead keeps the owner.
		st.Update(func(tx *Tx) { tx.UpsertWorkload(pod("a", addr.String(), "n1", "c1", Locality{})) })
		snap = st.Update(func(tx *Tx) { tx.RemoveWorkload("b") })
		w, ok = snap.WorkloadByAddr(addr)
		require.True(t, ok)
		require.Equal(t, "a", w.UID)
		snap = st.Update(func(tx *Tx) { tx.RemoveWorkload("a") })
		_, ok = snap.WorkloadByAddr(addr)
		require.False(t, ok)
	}

	st := NewStore()
	hn := pod("ztunnel", "10.0.0.1", "n1", "c1", Locality{})
	hn.HostNetwork = true
	snap := st.Update(func(tx *Tx) { tx.UpsertWorkload(hn) })
	_, ok := snap.WorkloadByAddr(netip.MustParseAddr("10.0.0.1"))
	require.False(t, ok, "a hostNetwork workload owns no address")
	require.True(t, snap.KnownCluster("c1"))
	require.True(t, snap.KnownNetwork("n1"))
	require.False(t, snap.KnownCluster("c9"))
	snap = st.Update(func(tx *Tx) { tx.RemoveWorkload("ztunnel") })
	require.False(t, snap.KnownCluster("c1"), "a cluster no workload names is forgotten")
}

// TestFollowSeesTheLatestSnapshot: Follow hands fn the current snapshot,
// then a newer one after each update, and returns once ctx ends.
func TestFollowSeesTheLatestSnapshot(t *testing.T) {
	st := NewStore()
	ctx, cancel := context.WithCancel(t.Context())
	var seen atomic.Uint64
	done := make(chan struct{})
	go func() {
		defer close(done)
		st.Follow(ctx, func(s *Snapshot) { seen.Store(s.Version()) })
	}()
	require.Eventually(t, func() bool { return seen.Load() == st.Load().Version() }, 5*time.Second, time.Millisecond)
	for range 3 {
		st.Update(func(tx *Tx) { tx.UpsertService(svcFoo()) })
		want := st.Load().Version()
		require.Eventually(t, func() bool { return seen.Load() == want }, 5*time.Second, time.Millisecond)
	}
	cancel()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Follow did not return after ctx ended")
	}
}
