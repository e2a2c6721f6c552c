package controller

import (
	"maps"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// recordingSink keeps the sink's view of one cluster: the activated state
// with every delta applied, and the last delta.
type recordingSink struct {
	workloads map[string]*model.Workload
	shards    map[model.ServiceKey][]model.Endpoint
	last      *model.ClusterDelta
}

func (r *recordingSink) Activate(_ model.ClusterID, _ uint64, st *model.ClusterState) {
	r.workloads, r.shards = maps.Clone(st.Workloads), maps.Clone(st.Shards) // another sink may hold st
	if r.shards == nil {
		r.shards = map[model.ServiceKey][]model.Endpoint{}
	}
	if r.workloads == nil {
		r.workloads = map[string]*model.Workload{}
	}
	for _, eps := range st.Shards {
		for _, e := range eps {
			if e.Workload.FromSlice {
				r.workloads[e.Workload.UID] = e.Workload
			}
		}
	}
}

func (r *recordingSink) Update(_ model.ClusterID, _ uint64, d *model.ClusterDelta) {
	r.last = d
	for uid, w := range d.Workloads {
		if w == nil {
			delete(r.workloads, uid)
		} else {
			r.workloads[uid] = w
		}
	}
	for k, eps := range d.Shards {
		if eps == nil {
			delete(r.shards, k)
		} else {
			r.shards[k] = eps
		}
	}
}

func (r *recordingSink) Deactivate(model.ClusterID, uint64) {}

func sliceOf(name string, eps ...discoveryv1.Endpoint) *sliceInfo {
	return convertSlice(&discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "db", Labels: map[string]string{discoveryv1.LabelServiceName: "pg"}},
		Ports:      []discoveryv1.EndpointPort{{Name: ptr.To("sql"), Port: ptr.To[int32](5432)}},
		Endpoints:  eps,
	})
}

func sliceEP(addr, node string, ready bool) discoveryv1.Endpoint {
	return discoveryv1.Endpoint{Addresses: []string{addr}, NodeName: ptr.To(node), Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(ready)}}
}

// TestSliceWorkloads: the workloads made from a selector-less service's
// EndpointSlice addresses are kept in its shard only, yet the sink sees
// every one of them; a slice update changes only the addresses that
// changed, a node's new locality reaches them, and a selector withdraws
// them.
func TestSliceWorkloads(t *testing.T) {
	sink := &recordingSink{}
	v := newView("c1", 1, model.DefaultDomain, "net1", sink)
	step := func(f func()) {
		v.mu.Lock()
		defer v.mu.Unlock()
		sink.last = nil
		f()
		v.finish()
	}
	pg := model.ServiceKey{Namespace: "db", Name: "pg"}
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "pg", Namespace: "db"},
		Spec: corev1.ServiceSpec{ClusterIP: "10.96.0.9", Ports: []corev1.ServicePort{{Name: "sql", Port: 5432, TargetPort: intstr.FromInt32(5432)}}}}
	step(func() {
		v.putNode("n1", model.Locality{Region: "r1", Zone: "z1"})
		v.putService(convertService("c1", svc))
		v.putSlice(sliceOf("pg-1", sliceEP("10.0.0.1", "n1", true), sliceEP("10.0.0.2", "n1", true)))
		v.putSlice(sliceOf("pg-2", sliceEP("10.0.0.3", "n2", true), sliceEP("10.0.0.2", "n1", true)))
	})
	assert.Empty(t, v.workloads, "made workloads are not indexed twice")
	v.activate()

	uid := func(addr string) string { return "c1/db/endpointslice.pg." + addr }
	require.Len(t, sink.workloads, 3, "an address in two slices is one workload")
	require.Len(t, sink.shards[pg], 3)
	w1 := sink.workloads[uid("10.0.0.1")]
	require.NotNil(t, w1)
	assert.Equal(t, "10.0.0.1", w1.Name)
	assert.Equal(t, model.Locality{Region: "r1", Zone: "z1"}, w1.Locality)
	assert.Equal(t, model.Network("net1"), w1.Network)
	assert.Same(t, w1.Placement, sink.workloads[uid("10.0.0.2")].Placement, "one placement per node and identity")
	assert.Equal(t, map[string][]model.PortMapping{"pg.db.svc.cluster.local": {{ServicePort: 5432, TargetPort: 5432}}}, w1.Services)

	// One address goes unready: the delta names that workload alone.
	step(func() {
		v.putSlice(sliceOf("pg-1", sliceEP("10.0.0.1", "n1", false), sliceEP("10.0.0.2", "n1", true)))
	})
	require.NotNil(t, sink.last)
	assert.Equal(t, []string{uid("10.0.0.1")}, keys(sink.last.Workloads))
	assert.False(t, sink.workloads[uid("10.0.0.1")].Ready)
	assert.Same(t, sink.workloads[uid("10.0.0.2")], sink.shards[pg][1].Workload, "unchanged addresses keep their value")

	// The node's locality changes: its addresses follow.
	step(func() { v.putNode("n1", model.Locality{Region: "r1", Zone: "z2"}) })
	require.NotNil(t, sink.last)
	assert.ElementsMatch(t, []string{uid("10.0.0.1"), uid("10.0.0.2")}, keys(sink.last.Workloads))
	assert.Equal(t, "z2", sink.workloads[uid("10.0.0.2")].Locality.Zone)

	// A slice goes: its only-there address goes with it.
	step(func() { v.removeSlice("db/pg-2") })
	assert.Equal(t, map[string]*model.Workload{uid("10.0.0.3"): nil}, sink.last.Workloads)
	assert.Len(t, sink.shards[pg], 2)

	// The service gains a selector that matches a pod: the made workloads
	// are withdrawn and the pod is the endpoint.
	step(func() {
		v.putPod(convertPod(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "pg-0", Namespace: "db", Labels: map[string]string{"app": "pg"}},
			Spec:   corev1.PodSpec{NodeName: "n1"},
			Status: corev1.PodStatus{PodIPs: []corev1.PodIP{{IP: "10.0.1.1"}}, Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}}}))
		withSelector := svc.DeepCopy()
		withSelector.Spec.Selector = map[string]string{"app": "pg"}
		v.putService(convertService("c1", withSelector))
	})
	assert.Len(t, sink.workloads, 1)
	require.Len(t, sink.shards[pg], 1)
	assert.Equal(t, "c1/db/pg-0", sink.shards[pg][0].Workload.UID)

	// And back: the slices' addresses return, the pod leaves the shard.
	step(func() { v.putService(convertService("c1", svc)) })
	require.Len(t, sink.shards[pg], 2)
	assert.Equal(t, uid("10.0.0.1"), sink.shards[pg][0].Workload.UID)
	assert.Len(t, sink.workloads, 3)
}

// TestSliceAddressOfAPod: a slice address whose targetRef names a pod of
// its namespace that has the address is a workload of the slice (its
// readiness the slice's) with the pod's identity and placement, and the
// pod's workload is bound to the service; the same state results whichever
// object comes first, and follows the pod's later changes and removal.
func TestSliceAddressOfAPod(t *testing.T) {
	pod := func(ready bool, sa string) *podInfo {
		cond := corev1.ConditionFalse
		if ready {
			cond = corev1.ConditionTrue
		}
		return convertPod(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "pg-0", Namespace: "db"},
			Spec: corev1.PodSpec{NodeName: "n2", ServiceAccountName: sa},
			Status: corev1.PodStatus{PodIPs: []corev1.PodIP{{IP: "10.0.1.1"}},
				Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: cond}}}})
	}
	slice := func(ready bool) *sliceInfo {
		ep := sliceEP("10.0.1.1", "n1", ready)
		ep.TargetRef = &corev1.ObjectReference{Kind: "Pod", Name: "pg-0"}
		other := sliceEP("10.0.0.7", "n1", true)
		other.TargetRef = &corev1.ObjectReference{Kind: "Pod", Name: "pg-0", Namespace: "elsewhere"}
		return sliceOf("pg-1", ep, other)
	}
	svc := convertService("c1", &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "pg", Namespace: "db"},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "sql", Port: 5432}}}})
	k := model.ServiceKey{Namespace: "db", Name: "pg"}
	const bound, loose = "c1/db/endpointslice.pg.10.0.1.1", "c1/db/endpointslice.pg.10.0.0.7"
	run := func(t *testing.T, steps ...func(v *view)) (*recordingSink, *view) {
		sink := &recordingSink{}
		v := newView("c1", 1, model.DefaultDomain, "net1", sink)
		v.mu.Lock()
		v.putNode("n2", model.Locality{Region: "r2"})
		v.finish()
		v.mu.Unlock()
		v.activate()
		for _, step := range steps {
			v.mu.Lock()
			step(v)
			v.finish()
			v.mu.Unlock()
		}
		return sink, v
	}
	podFirst, _ := run(t, func(v *view) { v.putPod(pod(true, "pg")) }, func(v *view) { v.putService(svc) }, func(v *view) { v.putSlice(slice(false)) })
	sliceFirst, v := run(t, func(v *view) { v.putSlice(slice(false)) }, func(v *view) { v.putService(svc) }, func(v *view) { v.putPod(pod(true, "pg")) })
	for name, sink := range map[string]*recordingSink{"pod first": podFirst, "slice first": sliceFirst} {
		eps := sink.shards[k]
		require.Len(t, eps, 2, name)
		assert.Equal(t, loose, eps[0].Workload.UID, "%s: a targetRef into another namespace is ignored", name)
		assert.Equal(t, "default", eps[0].Workload.ServiceAccount, name)
		w := eps[1].Workload
		assert.Equal(t, bound, w.UID, name)
		assert.Equal(t, "pg-0", w.Name, name)
		assert.False(t, w.Ready, "%s: the slice's readiness, not the pod's", name)
		assert.Same(t, sink.workloads["c1/db/pg-0"].Placement, w.Placement, "%s: the pod's identity and placement", name)
		assert.Equal(t, model.Locality{Region: "r2"}, w.Locality, name)
		assert.Contains(t, sink.workloads["c1/db/pg-0"].Services, "pg.db.svc.cluster.local", "%s: the pod is bound to the service", name)
		assert.Same(t, w, sink.workloads[bound], name)
	}
	assert.True(t, podFirst.workloads[bound].Equal(sliceFirst.workloads[bound]), "the same state in both orders")

	step := func(f func()) {
		v.mu.Lock()
		defer v.mu.Unlock()
		f()
		v.finish()
	}
	sink := sliceFirst
	// Another service's slice names no pod; the pod's service account
	// changes (it was recreated): the address naming it follows, alone.
	step(func() {
		v.putService(convertService("c1", &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "other", Namespace: "db"},
			Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "sql", Port: 5432}}}}))
		other := sliceOf("other-1", sliceEP("10.0.0.8", "n1", true))
		other.service = "other"
		v.putSlice(other)
	})
	step(func() { v.putPod(pod(true, "pg2")) })
	assert.Equal(t, "pg2", sink.workloads[bound].ServiceAccount)
	assert.True(t, sink.workloads[bound].SliceOfPod, "bound to its pod: reached over HBONE")
	assert.Equal(t, []string{bound, "c1/db/pg-0"}, sortedKeys(sink.last.Workloads), "only the pod and the address naming it")
	assert.Equal(t, []model.ServiceKey{k}, slices.Collect(maps.Keys(sink.last.Shards)), "only the shard naming it")
	// The slice turns ready: so does the address; the pod turning unready does not change it.
	step(func() { v.putSlice(slice(true)) })
	step(func() { v.putPod(pod(false, "pg2")) })
	assert.True(t, sink.workloads[bound].Ready)
	assert.False(t, sink.workloads["c1/db/pg-0"].Ready)
	// The pod goes: the address stands alone, with nothing of the dead pod.
	step(func() { v.removePod("db/pg-0") })
	w := sink.workloads[bound]
	assert.Equal(t, "10.0.1.1", w.Name)
	assert.Equal(t, "default", w.ServiceAccount)
	assert.False(t, w.SliceOfPod || w.Tunnelled(), "alone, the address has no ztunnel: reached in plaintext")
	assert.Equal(t, "n1", w.Node)
	assert.Nil(t, sink.workloads["c1/db/pg-0"])
	// The slice goes: the pod that comes back is bound to nothing.
	step(func() { v.removeSlice("db/pg-1") })
	step(func() { v.putPod(pod(true, "pg")) })
	assert.Empty(t, sink.workloads["c1/db/pg-0"].Services)
	assert.Nil(t, sink.shards[k])
	assert.Empty(t, v.podRefs, "no index entry outlives its slice")
}

func sortedKeys[V any](m map[string]V) []string {
	out := keys(m)
	slices.Sort(out)
	return out
}

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

// TestSliceAddressInTwoSlices: an address listed by two slices (as while one
// replaces another) is one endpoint, ready if either slice says so, and
// stays the same workload however often the slices are refreshed.
func TestSliceAddressInTwoSlices(t *testing.T) {
	sink := &recordingSink{}
	v := newView("c1", 1, model.DefaultDomain, "net1", sink)
	v.mu.Lock()
	v.putService(convertService("c1", &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "pg", Namespace: "db"},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "sql", Port: 5432}}}}))
	v.putSlice(sliceOf("pg-a", sliceEP("10.0.0.1", "n1", false)))
	v.putSlice(sliceOf("pg-b", sliceEP("10.0.0.1", "n1", true)))
	v.finish()
	v.mu.Unlock()
	v.activate()
	k := model.ServiceKey{Namespace: "db", Name: "pg"}
	require.Len(t, sink.shards[k], 1)
	w := sink.shards[k][0].Workload
	assert.True(t, w.Ready)
	for range 20 {
		v.mu.Lock()
		sink.last = nil
		v.refreshSlices(k)
		v.finish()
		v.mu.Unlock()
		assert.Nil(t, sink.last, "a refresh of unchanged slices changes nothing")
	}
	assert.Same(t, w, sink.shards[k][0].Workload)
}
