package vip_test

import (
	"context"
	"fmt"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/pilot/vip"
)

// env is one test's namespace in the config cluster.
type env struct {
	ns  string
	now atomic.Int64 // unix nanoseconds of the fake clock
}

func newEnv(t *testing.T) *env {
	t.Helper()
	e := &env{ns: fmt.Sprintf("vip-%d", time.Now().UnixNano())}
	require.NoError(t, clusters.Cluster("config").EnsureNamespace(context.Background(), e.ns, nil))
	e.now.Store(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	return e
}

func (e *env) clock() time.Time { return time.Unix(0, e.now.Load()).UTC() }

// start makes an allocator on the test's namespace and runs it until the
// test ends; it returns once the table is loaded.
func (e *env) start(t *testing.T, cfg vip.Config) *vip.Allocator {
	t.Helper()
	cfg.Namespace = e.ns
	a, err := vip.New(cfg, vip.Deps{Client: clusters.Cluster("config").Client, Now: e.clock})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	select {
	case <-a.Synced():
	case <-time.After(30 * time.Second):
		t.Fatal("allocator never loaded its table")
	}
	return a
}

func hosts(n int, prefix string) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s-%d.demo.svc.cluster.local", prefix, i)
	}
	return out
}

type pair struct{ v4, v6 netip.Addr }

func snapshot(a *vip.Allocator, hs []string) map[string]pair {
	m := map[string]pair{}
	for _, h := range hs {
		v4, v6 := a.Addresses(h)
		m[h] = pair{v4, v6}
	}
	return m
}

// TestAllocationAndRestart proves addresses come from the configured
// ranges, are distinct, and survive a restart of the allocator (a new
// instance on the same cluster) unchanged, before and after it syncs again.
func TestAllocationAndRestart(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	hs := hosts(200, "svc")
	a := e.start(t, vip.Config{})
	require.NoError(t, a.Sync(ctx, hs))
	before := snapshot(a, hs)
	seen := map[netip.Addr]bool{}
	for h, p := range before {
		require.True(t, netip.MustParsePrefix("240.240.0.0/16").Contains(p.v4), h)
		require.True(t, netip.MustParsePrefix("2001:2::/48").Contains(p.v6), h)
		require.False(t, seen[p.v4] || seen[p.v6], "address given twice: %v", p)
		seen[p.v4], seen[p.v6] = true, true
	}

	b := e.start(t, vip.Config{})
	require.Equal(t, before, snapshot(b, hs), "a new allocator reads the same table")
	require.NoError(t, b.Sync(ctx, append(hs, "new.demo.svc.cluster.local")))
	require.Equal(t, before, snapshot(b, hs), "and keeps it when it syncs")
	v4, _ := b.Addresses("new.demo.svc.cluster.local")
	require.True(t, v4.IsValid())
	require.EventuallyWithT(t, func(c *assertT) {
		got, _ := a.Addresses("new.demo.svc.cluster.local")
		require.Equal(c, v4, got, "the first allocator sees the second one's allocation through its watch")
	}, 30*time.Second, 10*time.Millisecond)
}

type assertT = assert.CollectT

// TestReplicasAgree proves two allocators writing at the same time to the
// same cluster lose nothing: each syncs the common hostnames plus its own
// (growing each round, as replicas whose registries lag each other would),
// and in the end the table holds every hostname either asked for, with
// distinct addresses, which both serve. Without the resourceVersion check
// one replica's write would overwrite the other's allocations.
func TestReplicasAgree(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	a, b := e.start(t, vip.Config{}), e.start(t, vip.Config{})
	common := hosts(20, "common")
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i, al := range []*vip.Allocator{a, b} {
		wg.Go(func() {
			for r := range 8 {
				if err := al.Sync(ctx, append(common, hosts(r+1, fmt.Sprint("replica", i))...)); err != nil {
					errs[i] = err
				}
			}
		})
	}
	wg.Wait()
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	all := append(append(common, hosts(8, "replica0")...), hosts(8, "replica1")...)
	fresh := snapshot(e.start(t, vip.Config{}), all)
	seen := map[netip.Addr]string{}
	for h, p := range fresh {
		require.True(t, p.v4.IsValid() && p.v6.IsValid(), "%s lost", h)
		for _, ad := range []netip.Addr{p.v4, p.v6} {
			require.NotContains(t, seen, ad, "%s and %s share %s", h, seen[ad], ad)
			seen[ad] = h
		}
	}
	require.EventuallyWithT(t, func(c *assertT) {
		require.Equal(c, fresh, snapshot(a, all))
		require.Equal(c, fresh, snapshot(b, all))
	}, 30*time.Second, 10*time.Millisecond)
}

// TestExhaustionAndGrace proves a tiny range gives a clear error naming the
// hostnames left without an address, keeps what it gave, that a freed
// address stays reserved for the grace period (and returns to its host if
// it comes back), and is reused after it.
func TestExhaustionAndGrace(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	cfg := vip.Config{IPv4Range: netip.MustParsePrefix("240.240.0.0/30"), IPv6Range: netip.MustParsePrefix("2001:2::/126"), Grace: time.Hour}
	a := e.start(t, cfg) // two addresses per family: .1 and .2
	require.NoError(t, a.Sync(ctx, []string{"a", "b"}))
	aV4, _ := a.Addresses("a")
	bV4, bV6 := a.Addresses("b")

	err := a.Sync(ctx, []string{"a", "b", "c"})
	require.ErrorIs(t, err, vip.ErrExhausted)
	require.ErrorContains(t, err, "c (IPv4 240.240.0.0/30)")
	require.ErrorContains(t, err, "c (IPv6 2001:2::/126)")
	got, _ := a.Addresses("a")
	require.Equal(t, aV4, got, "allocated addresses kept")

	require.NoError(t, a.Sync(ctx, []string{"a"})) // b freed, reserved
	got, _ = a.Addresses("b")
	require.Equal(t, bV4, got, "a freed hostname keeps its address during the grace period")
	require.ErrorIs(t, a.Sync(ctx, []string{"a", "c"}), vip.ErrExhausted, "b's address is reserved")
	require.NoError(t, a.Sync(ctx, []string{"a", "b"}), "b comes back within the grace period")
	got, _ = a.Addresses("b")
	require.Equal(t, bV4, got)

	require.NoError(t, a.Sync(ctx, []string{"a"}))
	e.now.Add(int64(2 * time.Hour))
	require.NoError(t, a.Sync(ctx, []string{"a", "c"}), "after the grace period b's address is reused")
	cV4, cV6 := a.Addresses("c")
	require.Equal(t, bV4, cV4)
	require.Equal(t, bV6, cV6)
	v4, _ := a.Addresses("b")
	require.False(t, v4.IsValid(), "b is gone")
}

// TestMalformedConfigMap proves an unreadable table gives a clear error,
// is not written over, and that the allocator keeps serving the last good
// table; once fixed, syncing works again.
func TestMalformedConfigMap(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	a := e.start(t, vip.Config{})
	hs := hosts(3, "svc")
	require.NoError(t, a.Sync(ctx, hs))
	good := snapshot(a, hs)

	cms := clusters.Cluster("config").Client.CoreV1().ConfigMaps(e.ns)
	cm, err := cms.Get(ctx, vip.DefaultConfig().ConfigMap, metav1.GetOptions{})
	require.NoError(t, err)
	goodData := cm.Data[vip.DataKey]
	for _, bad := range []string{
		`{"version":1,"entries":{"x":{"v4":"not-an-ip"}}}`,
		`{"version":1,"entries":{"x":{"v4":"240.240.0.9"},"y":{"v4":"240.240.0.9"}}}`,
		`{"version":7,"entries":{}}`,
		`garbage`,
	} {
		cm.Data[vip.DataKey] = bad
		cm, err = cms.Update(ctx, cm, metav1.UpdateOptions{})
		require.NoError(t, err)
		err = a.Sync(ctx, append(hs, "more.demo.svc.cluster.local"))
		require.ErrorIs(t, err, vip.ErrMalformed, bad)
		require.ErrorContains(t, err, e.ns+"/"+vip.DefaultConfig().ConfigMap)
		now, err := cms.Get(ctx, vip.DefaultConfig().ConfigMap, metav1.GetOptions{})
		require.NoError(t, err)
		require.Equal(t, bad, now.Data[vip.DataKey], "nothing written over it")
		require.Equal(t, good, snapshot(a, hs), "the last good table is still served")
	}

	b := e.start(t, vip.Config{}) // a restart while the table is broken
	require.ErrorIs(t, b.Sync(ctx, hs), vip.ErrMalformed)

	cm.Data[vip.DataKey] = goodData
	_, err = cms.Update(ctx, cm, metav1.UpdateOptions{})
	require.NoError(t, err)
	require.NoError(t, b.Sync(ctx, hs))
	require.Equal(t, good, snapshot(b, hs), "fixed: the same addresses")
}

// TestDeletedConfigMap proves a deleted ConfigMap is written back from the
// table the allocator knew, so no address changes.
func TestDeletedConfigMap(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	a := e.start(t, vip.Config{})
	hs := hosts(5, "svc")
	require.NoError(t, a.Sync(ctx, hs))
	good := snapshot(a, hs)
	cms := clusters.Cluster("config").Client.CoreV1().ConfigMaps(e.ns)
	require.NoError(t, cms.Delete(ctx, vip.DefaultConfig().ConfigMap, metav1.DeleteOptions{}))
	require.NoError(t, a.Sync(ctx, hs))
	require.Equal(t, good, snapshot(e.start(t, vip.Config{}), hs))
}

// TestConfig proves bad ranges are refused.
func TestConfig(t *testing.T) {
	_, err := vip.New(vip.Config{IPv4Range: netip.MustParsePrefix("2001:db8::/64"), IPv6Range: netip.MustParsePrefix("10.0.0.0/8")}, vip.Deps{})
	require.ErrorContains(t, err, "is not IPv4")
	require.ErrorContains(t, err, "is not IPv6")
	require.ErrorContains(t, err, "Client is required")
}
