package endpoints_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/registry"
	"github.com/isthmus-mesh/isthmus/pilot/xds"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// conflictGauge returns pilot's isthmus_registry_address_conflicts series
// of reason.
func conflictGauge(c *assert.CollectT, p *pilot, reason string) float64 {
	mfs, err := p.Metrics.Gather()
	require.NoError(c, err)
	for _, mf := range mfs {
		if mf.GetName() != "isthmus_registry_address_conflicts" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if m.GetLabel()[0].GetValue() == reason {
				return m.GetGauge().GetValue()
			}
		}
	}
	require.Fail(c, "no conflicts series", reason)
	return 0
}

// conflictsIn returns pilot's address conflicts of addresses with prefix
// (the clusters' own, such as the API servers' shared address in the
// kubernetes Services, are left out), and their losing claims by reason.
func conflictsIn(p *pilot, prefix string) ([]registry.AddressConflict, map[string]int) {
	var out []registry.AddressConflict
	counts := map[string]int{}
	for _, c := range p.Registry.AddressConflicts() {
		if strings.HasPrefix(c.Address, prefix) {
			out = append(out, c)
			for _, l := range c.Losers {
				counts[l.Reason]++
			}
		}
	}
	return out, counts
}

// TestSliceCannotTakeAnotherNamespacesPodAddress, as a tenant would try: a
// selector-less Service in namespace "tenant" whose EndpointSlice lists the
// address of a pod of namespace "victim" (in the same cluster, and in
// another cluster of the network). The pod keeps its address (its workload
// is the one served for it), the tenant's service does not get it as an
// endpoint, the claim is reported (metric, /debug/addressz), and deleting
// the slice leaves the pod as it was.
func TestSliceCannotTakeAnotherNamespacesPodAddress(t *testing.T) {
	ctx := context.Background()
	registerRemotes(t, "isthmus-takeover")
	p := startPilot(t, "isthmus-takeover")
	c1, c2 := clusters.Cluster("cluster-1"), clusters.Cluster("cluster-2")
	for _, c := range []*framework.Cluster{c1, c2} {
		require.NoError(t, c.EnsureNamespace(ctx, "victim", nil))
		require.NoError(t, c.EnsureNamespace(ctx, "tenant", nil))
	}
	// The victims: db-0 in cluster-1, cache-0 in cluster-2, each behind a Service.
	victims := map[string]string{"10.94.0.1": "cluster-1/victim/db-0", "10.94.0.2": "cluster-2/victim/cache-0"}
	for _, v := range []struct {
		c         *framework.Cluster
		name, app string
		addr      string
	}{{c1, "db-0", "db", "10.94.0.1"}, {c2, "cache-0", "cache", "10.94.0.2"}} {
		_, err := v.c.CreateService(ctx, "victim", v.app, map[string]string{"app": v.app}, framework.ServicePort{Name: "sql", Port: 5432, TargetPort: 5432})
		require.NoError(t, err)
		_, err = v.c.CreatePod(ctx, framework.PodOptions{Namespace: "victim", Name: v.name, Labels: map[string]string{"app": v.app},
			ServiceAccount: v.app, IP: netip.MustParseAddr(v.addr), Ready: true})
		require.NoError(t, err)
	}
	// The tenant's service in cluster-1 lists both victims and one address of its own.
	_, err := c1.CreateService(ctx, "tenant", "steal", nil, framework.ServicePort{Name: "sql", Port: 5432, TargetPort: 5432})
	require.NoError(t, err)
	require.NoError(t, putSlice(ctx, c1, "tenant", "steal-1", "steal",
		address{addr: "10.94.0.1", ready: true}, address{addr: "10.94.0.2", ready: true}, address{addr: "10.94.0.9", ready: true}))
	steal := model.ServiceKey{Namespace: "tenant", Name: "steal"}
	stolen := func(addr string) string { return model.SliceWorkloadPrefix("cluster-1", steal) + addr }

	require.EventuallyWithT(t, func(c *assert.CollectT) {
		for addr, uid := range victims {
			assert.Equal(c, []string{uid}, p.workloadsAt(c, addr), "the victim's workload is served for %s", addr)
			assert.False(c, p.Registry.OwnsAddresses(stolen(addr)))
		}
		assert.Equal(c, map[string]corev3.HealthStatus{"10.94.0.9:5432": corev3.HealthStatus_HEALTHY},
			p.edsHealth(c, xds.ClusterName("steal.tenant.svc.cluster.local", 5432)), "the tenant's service keeps only its own address")
		assert.Equal(c, []registry.AddressConflict{
			{Network: network, Address: "10.94.0.1", Owner: victims["10.94.0.1"], Losers: []registry.AddressLoser{{Workload: stolen("10.94.0.1"), Reason: registry.ReasonOtherNamespace, Dropped: true}}},
			{Network: network, Address: "10.94.0.2", Owner: victims["10.94.0.2"], Losers: []registry.AddressLoser{{Workload: stolen("10.94.0.2"), Reason: registry.ReasonOtherNamespace, Dropped: true}}},
		}, onlyConflicts(conflictsIn(p, "10.94.")))
		assert.Equal(c, 2.0, conflictGauge(c, p, registry.ReasonOtherNamespace))
	}, time.Minute, 20*time.Millisecond)

	// /debug/addressz shows the same.
	rec := httptest.NewRecorder()
	p.DebugMux().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/debug/addressz", nil))
	require.Equal(t, http.StatusOK, rec.Code)
	var addressz struct {
		Conflicts []registry.AddressConflict `json:"conflicts"`
		Counts    map[string]int             `json:"counts"`
	}
	require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &addressz))
	assert.Contains(t, addressz.Conflicts, registry.AddressConflict{Network: network, Address: "10.94.0.1", Owner: victims["10.94.0.1"],
		Losers: []registry.AddressLoser{{Workload: stolen("10.94.0.1"), Reason: registry.ReasonOtherNamespace, Dropped: true}}})
	assert.Equal(t, 2, addressz.Counts[registry.ReasonOtherNamespace])

	// The slice goes: the victims are untouched, nothing is left reported.
	before := map[string]*model.Workload{}
	for _, uid := range victims {
		before[uid] = p.Registry.Workload(uid)
	}
	require.NoError(t, c1.Client.DiscoveryV1().EndpointSlices("tenant").Delete(ctx, "steal-1", metav1.DeleteOptions{}))
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.Nil(c, p.Registry.Workload(stolen("10.94.0.1")))
		assert.Empty(c, onlyConflicts(conflictsIn(p, "10.94.")))
		assert.Equal(c, 0.0, conflictGauge(c, p, registry.ReasonOtherNamespace))
		for addr, uid := range victims {
			assert.Equal(c, []string{uid}, p.workloadsAt(c, addr))
			assert.Same(c, before[uid], p.Registry.Workload(uid), "the victim's workload did not change")
		}
		assert.Equal(c, map[string]corev3.HealthStatus{"10.94.0.1:5432": corev3.HealthStatus_HEALTHY},
			p.edsHealth(c, xds.ClusterName("db.victim.svc.cluster.local", 5432)))
	}, time.Minute, 20*time.Millisecond)
}

func onlyConflicts(c []registry.AddressConflict, _ map[string]int) []registry.AddressConflict {
	return c
}

// TestAddressClaimsResolveByTheRule: claims in one namespace resolve by the
// rule, and when the owner goes the other claimant is served in its place:
// a pod beats a slice address listing it (which stays an endpoint of its
// own service), the older of two pods with one address (in two clusters of
// the network) owns it, the older of two slice addresses owns theirs.
func TestAddressClaimsResolveByTheRule(t *testing.T) {
	ctx := context.Background()
	registerRemotes(t, "isthmus-claims")
	p := startPilot(t, "isthmus-claims")
	c1, c3 := clusters.Cluster("cluster-1"), clusters.Cluster("cluster-3")
	for _, c := range []*framework.Cluster{c1, c3} {
		require.NoError(t, c.EnsureNamespace(ctx, "shared", nil))
	}
	// Two pods at 10.95.0.1: cluster-3's first, then (a second later,
	// creation times have a one-second resolution) cluster-1's.
	older, err := c3.CreatePod(ctx, framework.PodOptions{Namespace: "shared", Name: "api-0", IP: netip.MustParseAddr("10.95.0.1"), Ready: true})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		return time.Since(older.CreationTimestamp.Time) > 1100*time.Millisecond
	}, 5*time.Second, 10*time.Millisecond)
	_, err = c1.CreatePod(ctx, framework.PodOptions{Namespace: "shared", Name: "api-1", IP: netip.MustParseAddr("10.95.0.1"), Ready: true})
	require.NoError(t, err)
	// Service "list" lists that address in its slice, naming no pod.
	for _, svc := range []string{"list", "first", "second"} {
		_, err := c1.CreateService(ctx, "shared", svc, nil, framework.ServicePort{Name: "sql", Port: 5432, TargetPort: 5432})
		require.NoError(t, err)
	}
	require.NoError(t, putSlice(ctx, c1, "shared", "list-1", "list", address{addr: "10.95.0.1", ready: true}))
	// Two services listing 10.95.0.7: "first"'s slice a second before "second"'s.
	require.NoError(t, putSlice(ctx, c1, "shared", "first-1", "first", address{addr: "10.95.0.7", ready: true}))
	first, err := c1.Client.DiscoveryV1().EndpointSlices("shared").Get(ctx, "first-1", metav1.GetOptions{})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		return time.Since(first.CreationTimestamp.Time) > 1100*time.Millisecond
	}, 5*time.Second, 10*time.Millisecond)
	require.NoError(t, putSlice(ctx, c1, "shared", "second-1", "second", address{addr: "10.95.0.7", ready: true}))

	slice := func(svc, addr string) string {
		return model.SliceWorkloadPrefix("cluster-1", model.ServiceKey{Namespace: "shared", Name: svc}) + addr
	}
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.Equal(c, []string{"cluster-3/shared/api-0"}, p.workloadsAt(c, "10.95.0.1"), "the older pod")
		assert.Equal(c, []string{slice("first", "10.95.0.7")}, p.workloadsAt(c, "10.95.0.7"), "the older slice address")
		assert.Equal(c, map[string]corev3.HealthStatus{"10.95.0.1:5432": corev3.HealthStatus_HEALTHY},
			p.edsHealth(c, xds.ClusterName("list.shared.svc.cluster.local", 5432)), "a same-namespace slice address stays an endpoint")
		_, counts := conflictsIn(p, "10.95.")
		assert.Equal(c, map[string]int{registry.ReasonDuplicatePod: 1, registry.ReasonPodAddress: 1, registry.ReasonDuplicateSlice: 1}, counts)
	}, time.Minute, 20*time.Millisecond)

	// The owners go; the other claims take over and are served.
	require.NoError(t, c3.Client.CoreV1().Pods("shared").Delete(ctx, "api-0", metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}))
	require.NoError(t, c1.Client.CoreV1().Services("shared").Delete(ctx, "first", metav1.DeleteOptions{}))
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.Equal(c, []string{"cluster-1/shared/api-1"}, p.workloadsAt(c, "10.95.0.1"))
		assert.Equal(c, []string{slice("second", "10.95.0.7")}, p.workloadsAt(c, "10.95.0.7"))
		_, counts := conflictsIn(p, "10.95.")
		assert.Equal(c, map[string]int{registry.ReasonPodAddress: 1}, counts)
	}, time.Minute, 20*time.Millisecond)
	require.NoError(t, c1.Client.CoreV1().Pods("shared").Delete(ctx, "api-1", metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}))
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.Equal(c, []string{slice("list", "10.95.0.1")}, p.workloadsAt(c, "10.95.0.1"), "the slice address, last")
		assert.Empty(c, onlyConflicts(conflictsIn(p, "10.95.")))
	}, time.Minute, 20*time.Millisecond)
}
