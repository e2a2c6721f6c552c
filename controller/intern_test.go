package controller

import (
	"fmt"
	"net/netip"
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

// TestInternTablesStayFlat: 1,000 rollouts — each replaces a deployment's
// three pods by three with a new pod-template-hash and a new container port
// (so new label sets, port lists and services maps), and a selector-less
// service's slice by one with a new port — leave the intern tables within
// twice their live size plus minSweep after every rollout, and a sweep
// leaves exactly what is live. Without sweeping, each table would hold
// over a thousand entries.
func TestInternTablesStayFlat(t *testing.T) {
	const rollouts, replicas = 1000, 3
	v := newView("c1", 1, model.DefaultDomain, "net1", &recordingSink{})
	step := func(f func()) {
		v.mu.Lock()
		defer v.mu.Unlock()
		f()
		v.finish()
	}
	web := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "shop"},
		Spec: corev1.ServiceSpec{ClusterIP: "10.96.0.1", Selector: map[string]string{"app": "web"},
			Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromString("http")}}}}
	db := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "db", Namespace: "shop"},
		Spec: corev1.ServiceSpec{ClusterIP: "10.96.0.2", Ports: []corev1.ServicePort{{Name: "sql", Port: 5432}}}}
	step(func() {
		v.putService(convertService("c1", web))
		v.putService(convertService("c1", db))
	})
	v.activate()
	pod := func(r, i int) *corev1.Pod {
		return &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("web-%d-%d", r, i), Namespace: "shop",
				Labels: map[string]string{"app": "web", "pod-template-hash": fmt.Sprintf("h%d", r)}},
			Spec: corev1.PodSpec{NodeName: "n1", Containers: []corev1.Container{{Name: "web",
				Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: int32(8000 + r)}}}}},
			Status: corev1.PodStatus{PodIPs: []corev1.PodIP{{IP: netip.AddrFrom4([4]byte{10, byte(r >> 8), byte(r), byte(i + 1)}).String()}},
				Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}},
		}
	}
	slice := func(r int) *discoveryv1.EndpointSlice {
		return &discoveryv1.EndpointSlice{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("db-%d", r), Namespace: "shop", Labels: map[string]string{discoveryv1.LabelServiceName: "db"}},
			Ports:      []discoveryv1.EndpointPort{{Name: ptr.To("sql"), Port: ptr.To(int32(15000 + r))}},
			Endpoints:  []discoveryv1.Endpoint{{Addresses: []string{"10.9.0.1"}, NodeName: ptr.To("n1")}},
		}
	}
	peak := [3]int{}
	for r := range rollouts {
		step(func() {
			for i := range replicas {
				v.putPod(convertPod(pod(r, i)))
			}
			v.putSlice(convertSlice(slice(r)))
		})
		step(func() {
			if r > 0 {
				for i := range replicas {
					v.removePod(fmt.Sprintf("shop/web-%d-%d", r-1, i))
				}
				v.removeSlice(fmt.Sprintf("shop/db-%d", r-1))
			}
		})
		l, s, p := v.interned.sizes()
		peak = [3]int{max(peak[0], l), max(peak[1], s), max(peak[2], p)}
	}
	// Live now: one label set; the pods' services map and the slice
	// address's; the pods' port list and the slice's.
	bound := 2*2 + minSweep
	assert.LessOrEqual(t, peak[0], bound, "label sets")
	assert.LessOrEqual(t, peak[1], bound, "services maps")
	assert.LessOrEqual(t, peak[2], bound, "port lists")
	assert.Greater(t, v.interned.sweeps, rollouts/minSweep, "swept along the way")

	v.mu.Lock()
	v.sweepInterned()
	l, s, p := v.interned.sizes()
	v.mu.Unlock()
	assert.Equal(t, [3]int{1, 2, 2}, [3]int{l, s, p}, "after a sweep: exactly the live values")

	// What is served still shares them: the three pods hold one label set.
	w := v.workloads[model.WorkloadUID("c1", "shop", fmt.Sprintf("web-%d-0", rollouts-1))]
	require.NotNil(t, w)
	w1 := v.workloads[model.WorkloadUID("c1", "shop", fmt.Sprintf("web-%d-1", rollouts-1))]
	require.NotNil(t, w1)
	assert.Equal(t, fmt.Sprintf("%p", w.Labels), fmt.Sprintf("%p", w1.Labels), "one shared label set")
	assert.Equal(t, fmt.Sprintf("%p", w.Services), fmt.Sprintf("%p", w1.Services), "one shared services map")
	assert.Equal(t, []model.PortMapping{{ServicePort: 80, TargetPort: uint16(8000 + rollouts - 1)}}, w.Services["web.shop.svc.cluster.local"])
	require.Len(t, v.shards[model.ServiceKey{Namespace: "shop", Name: "db"}].eps, 1)
}
