package controller

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"

	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/registry"
)

// teeSink hands every call to each of its sinks.
type teeSink []Sink

func (t teeSink) Activate(c model.ClusterID, gen uint64, st *model.ClusterState) {
	for _, s := range t {
		s.Activate(c, gen, st)
	}
}

func (t teeSink) Update(c model.ClusterID, gen uint64, d *model.ClusterDelta) {
	for _, s := range t {
		s.Update(c, gen, d)
	}
}

func (t teeSink) Deactivate(c model.ClusterID, gen uint64) {
	for _, s := range t {
		s.Deactivate(c, gen)
	}
}

// replaceEvent is one thing a store is told: an object added or updated,
// a key deleted, or a relist (the objects listed).
type replaceEvent struct {
	name   string
	kind   string // "pods" or "slices"
	put    any
	delete string
	relist []any
}

// replaceWorld is the objects of the replaced-pod cases: a selector-less
// Service db/pg whose slice pg-1 names pod db-0 at 10.0.1.1.
type replaceWorld struct{}

func (replaceWorld) pod(uid, sa, node string, ip bool, ready bool) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "db-0", Namespace: "db", UID: types.UID(uid)},
		Spec: corev1.PodSpec{NodeName: node, ServiceAccountName: sa}}
	if ip {
		cond := corev1.ConditionFalse
		if ready {
			cond = corev1.ConditionTrue
		}
		p.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "10.0.1.1", PodIPs: []corev1.PodIP{{IP: "10.0.1.1"}},
			Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: cond}}}
	}
	return p
}

func (replaceWorld) slice(ready bool) *discoveryv1.EndpointSlice {
	return &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: "pg-1", Namespace: "db", Labels: map[string]string{discoveryv1.LabelServiceName: "pg"}},
		Ports:      []discoveryv1.EndpointPort{{Name: ptr.To("sql"), Port: ptr.To[int32](5432)}},
		Endpoints: []discoveryv1.Endpoint{{Addresses: []string{"10.0.1.1"}, NodeName: ptr.To("n2"),
			Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(ready)},
			TargetRef:  &corev1.ObjectReference{Kind: "Pod", Namespace: "db", Name: "db-0", UID: "uid-1"}}},
	}
}

// interleavings returns every merge of a and b that keeps the order of each.
func interleavings(a, b []replaceEvent) [][]replaceEvent {
	if len(a) == 0 || len(b) == 0 {
		return [][]replaceEvent{append(slices.Clone(a), b...)}
	}
	var out [][]replaceEvent
	for _, rest := range interleavings(a[1:], b) {
		out = append(out, append([]replaceEvent{a[0]}, rest...))
	}
	for _, rest := range interleavings(a, b[1:]) {
		out = append(out, append([]replaceEvent{b[0]}, rest...))
	}
	return out
}

// relisted returns evs with the events from i on missed by a watch that
// broke and replaced by a relist of final.
func relisted(evs []replaceEvent, i int, final []any) []replaceEvent {
	out := slices.Clone(evs[:i])
	return append(out, replaceEvent{name: "relist", kind: evs[0].kind, relist: final})
}

// TestSliceAddressFollowsReplacedPodInEveryOrder (#39): pod db-0, named by
// a selector-less service's slice, is deleted and created again under the
// same name and address (a new UID, another account and node), gets its
// address, then turns not ready, while its slice is left alone, rewritten,
// or deleted and created again; in every interleaving of the pod's and the
// slice's events, and with either watch broken at any point and relisted,
// the view ends as a view built afresh from the final objects, and the
// registry fed by it serves the new pod for the address (with the pod's
// readiness and identity) and binds the slice address to it.
func TestSliceAddressFollowsReplacedPodInEveryOrder(t *testing.T) {
	var w replaceWorld
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "pg", Namespace: "db"},
		Spec: corev1.ServiceSpec{ClusterIP: "10.96.0.9", Ports: []corev1.ServicePort{{Name: "sql", Port: 5432}}}}
	finalPod, finalSlice := w.pod("uid-2", "db-v2", "n3", true, false), w.slice(true)
	podEvents := []replaceEvent{
		{name: "delete db-0", kind: "pods", delete: "db/db-0"},
		{name: "create db-0", kind: "pods", put: w.pod("uid-2", "db-v2", "n3", false, false)},
		{name: "db-0 gets its address", kind: "pods", put: w.pod("uid-2", "db-v2", "n3", true, true)},
		{name: "db-0 not ready", kind: "pods", put: finalPod},
	}
	sliceCases := map[string][]replaceEvent{
		"slice unchanged": nil,
		"slice rewritten": {
			{name: "slice not ready", kind: "slices", put: w.slice(false)},
			{name: "slice ready", kind: "slices", put: finalSlice},
		},
		"slice re-created": {
			{name: "delete slice", kind: "slices", delete: "db/pg-1"},
			{name: "create slice", kind: "slices", put: finalSlice},
		},
	}
	// A view built from the final objects: what every order must give.
	want := &recordingSink{}
	fresh := newView("c1", 1, model.DefaultDomain, "net1", want)
	fresh.mu.Lock()
	for i, zone := range []string{"z1", "z2", "z3"} {
		fresh.putNode(fmt.Sprint("n", i+1), model.Locality{Region: "r1", Zone: zone})
	}
	fresh.putService(convertService("c1", svc))
	fresh.putPod(convertPod(finalPod))
	fresh.putSlice(convertSlice(finalSlice))
	fresh.finish()
	fresh.mu.Unlock()
	fresh.activate()

	const podUID, sliceUID = "c1/db/db-0", "c1/db/endpointslice.pg.10.0.1.1"
	run := func(t *testing.T, evs []replaceEvent) {
		t.Helper()
		sink := &recordingSink{}
		reg := registry.New(registry.Config{})
		v := newView("c1", 1, model.DefaultDomain, "net1", teeSink{sink, reg})
		pods := &store{v: v, put: func(obj any) { v.putPod(convertPod(obj.(*corev1.Pod))) }, remove: v.removePod, keys: map[string]struct{}{}}
		sls := &store{v: v, put: func(obj any) { v.putSlice(convertSlice(obj.(*discoveryv1.EndpointSlice))) }, remove: v.removeSlice, keys: map[string]struct{}{}}
		v.mu.Lock()
		for i, zone := range []string{"z1", "z2", "z3"} {
			v.putNode(fmt.Sprint("n", i+1), model.Locality{Region: "r1", Zone: zone})
		}
		v.putService(convertService("c1", svc))
		v.finish()
		v.mu.Unlock()
		require.NoError(t, pods.Replace([]any{w.pod("uid-1", "db", "n1", true, true)}, "1"))
		require.NoError(t, sls.Replace([]any{w.slice(true)}, "1"))
		v.activate()
		require.True(t, reg.OwnsAddresses(podUID), "the first pod is served for its address")
		var names []string
		for _, e := range evs {
			names = append(names, e.kind+": "+e.name)
			s := map[string]*store{"pods": pods, "slices": sls}[e.kind]
			switch {
			case e.relist != nil:
				require.NoError(t, s.Replace(e.relist, "2"))
			case e.put != nil:
				require.NoError(t, s.Update(e.put))
			default:
				require.NoError(t, s.Delete(cache.DeletedFinalStateUnknown{Key: e.delete}))
			}
		}
		order := strings.Join(names, ", ")
		require.Equal(t, sortedKeys(want.workloads), sortedKeys(sink.workloads), order)
		for uid, ww := range want.workloads {
			assert.True(t, ww.Equal(sink.workloads[uid]), "%s: workload %s: want %+v, got %+v", order, uid, ww, sink.workloads[uid])
		}
		pw, sw := sink.workloads[podUID], sink.workloads[sliceUID]
		require.NotNil(t, pw, order)
		require.NotNil(t, sw, order)
		assert.False(t, pw.Ready, "%s: the pod's readiness", order)
		assert.Equal(t, "db-v2", pw.ServiceAccount, order)
		assert.Contains(t, pw.Services, "pg.db.svc.cluster.local", "%s: the new pod is bound to the service", order)
		assert.True(t, sw.Ready, "%s: the slice address keeps the slice's readiness", order)
		assert.True(t, sw.NamesPod(pw), "%s: the slice address is bound to the new pod", order)
		assert.True(t, sw.SliceOfPod && sw.Tunnelled(), "%s: bound, the slice address is reached as the pod is", order)
		assert.True(t, reg.OwnsAddresses(podUID), "%s: the new pod is served for its address", order)
		assert.False(t, reg.OwnsAddresses(sliceUID), "%s: not the slice address", order)
		if got := reg.Workload(podUID); assert.NotNil(t, got, order) {
			assert.False(t, got.Ready, "%s: the registry has the pod's readiness", order)
		}
		assert.Empty(t, reg.AddressConflicts(), "%s: a slice address naming its pod is no conflict", order)
	}
	n := 0
	for _, name := range slices.Sorted(maps.Keys(sliceCases)) {
		sliceEvents := sliceCases[name]
		t.Run(name, func(t *testing.T) {
			for _, evs := range interleavings(podEvents, sliceEvents) {
				run(t, evs)
				n++
			}
			// The pod watch breaks after i events and lists again.
			for i := range podEvents {
				for _, evs := range interleavings(relisted(podEvents, i, []any{finalPod}), sliceEvents) {
					run(t, evs)
					n++
				}
			}
			// The slice watch breaks after i events and lists again.
			for i := range sliceEvents {
				for _, evs := range interleavings(podEvents, relisted(sliceEvents, i, []any{finalSlice})) {
					run(t, evs)
					n++
				}
			}
		})
	}
	t.Logf("%d orders", n)
}
