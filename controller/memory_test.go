package controller

import (
	"context"
	"fmt"
	"net/netip"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/registry"
)

// BenchmarkViewHeapPerEndpoint feeds discovery's view and the federated
// registry with 100 services x 1,000 pods (no API server: the objects are
// built in memory) and reports the heap they hold per endpoint: the cost
// of the data structures alone, without client-go.
func BenchmarkViewHeapPerEndpoint(b *testing.B) {
	const services, perService = 100, 1000
	heapPerEndpoint(b, services, true, services*perService, func(v *view) {
		for i := range services * perService {
			v.mu.Lock()
			v.putPod(convertPod(&corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("pod-%d", i), Namespace: "bench",
					Labels: map[string]string{"app": fmt.Sprintf("svc-%d", i%services), "pod-template-hash": "5d9f7c8b6"}},
				Spec: corev1.PodSpec{ServiceAccountName: "sa", NodeName: fmt.Sprintf("node-%d", i%50)},
				Status: corev1.PodStatus{PodIPs: []corev1.PodIP{{IP: netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}).String()}},
					Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}},
			}))
			v.finish()
			v.mu.Unlock()
		}
	})
}

// BenchmarkViewHeapPerSliceEndpoint is BenchmarkViewHeapPerEndpoint for
// selector-less services: 100 services x 1,000 EndpointSlice addresses
// (10 slices of 100 each, on 50 nodes) that name no pod.
func BenchmarkViewHeapPerSliceEndpoint(b *testing.B) {
	const services, slicesPer, perSlice = 100, 10, 100
	heapPerEndpoint(b, services, false, services*slicesPer*perSlice, func(v *view) {
		i := 0
		for s := range services {
			for sl := range slicesPer {
				es := &discoveryv1.EndpointSlice{
					ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("svc-%d-%d", s, sl), Namespace: "bench",
						Labels: map[string]string{discoveryv1.LabelServiceName: fmt.Sprintf("svc-%d", s)}},
					Ports: []discoveryv1.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8080)}},
				}
				for range perSlice {
					es.Endpoints = append(es.Endpoints, discoveryv1.Endpoint{
						Addresses: []string{netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}).String()},
						NodeName:  ptr.To(fmt.Sprintf("node-%d", i%50)), Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)},
					})
					i++
				}
				v.mu.Lock()
				v.putSlice(convertSlice(es))
				v.finish()
				v.mu.Unlock()
			}
		}
	})
}

// heapPerEndpoint makes a view feeding a running registry, with services
// svc-0..svc-<services-1> (selecting app=svc-N, or selector-less), lets
// fill add want endpoints, and reports the live heap per endpoint.
func heapPerEndpoint(b *testing.B, services int, selector bool, want int, fill func(v *view)) {
	for range b.N {
		heap0 := liveHeap()
		reg := registry.New(registry.Config{})
		var announced atomic.Int64 // workload changes published
		unsubscribe := reg.Subscribe(func(cs model.ChangeSet) {
			for _, c := range cs.Changes {
				if c.Kind == model.WorkloadChange {
					announced.Add(1)
				}
			}
		})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { _ = reg.Run(ctx); close(done) }()
		v := newView("c1", 1, model.DefaultDomain, "net1", reg)
		for s := range services {
			svc := &corev1.Service{
				ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("svc-%d", s), Namespace: "bench"},
				Spec: corev1.ServiceSpec{ClusterIP: "10.96.0.1", ClusterIPs: []string{"10.96.0.1"},
					Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080)}}},
			}
			if selector {
				svc.Spec.Selector = map[string]string{"app": fmt.Sprintf("svc-%d", s)}
			}
			v.putService(convertService("c1", svc))
		}
		v.activate()
		fill(v)
		n := 0
		for _, s := range reg.Services() {
			n += s.EndpointCount()
		}
		if n != want {
			b.Fatalf("%d endpoints, want %d", n, want)
		}
		// Measure once the change feed has published (and dropped) its
		// pending set: one Added per workload.
		for deadline := time.Now().Add(time.Minute); announced.Load() < int64(want); time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				b.Fatalf("%d workload changes published, want %d", announced.Load(), want)
			}
		}
		unsubscribe()
		b.ReportMetric(float64(liveHeap()-heap0)/float64(n), "heap-B/endpoint")
		runtime.KeepAlive(v)
		runtime.KeepAlive(reg)
		cancel()
		<-done
	}
}

func liveHeap() uint64 {
	var ms runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}
