package controller

import (
	"context"
	"fmt"
	"net/netip"
	"runtime"
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
	for range b.N {
		heap0 := liveHeap()
		reg := registry.New(registry.Config{})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { _ = reg.Run(ctx); close(done) }()
		v := newView("c1", 1, model.DefaultDomain, "net1", reg)
		for s := range services {
			v.putService(convertService("c1", &corev1.Service{
				ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("svc-%d", s), Namespace: "bench"},
				Spec: corev1.ServiceSpec{Selector: map[string]string{"app": fmt.Sprintf("svc-%d", s)}, ClusterIP: "10.96.0.1",
					ClusterIPs: []string{"10.96.0.1"}, Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080)}}},
			}))
		}
		v.activate()
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
		n := 0
		for _, s := range reg.Services() {
			n += s.EndpointCount()
		}
		if n != services*perService {
			b.Fatalf("%d endpoints, want %d", n, services*perService)
		}
		time.Sleep(100 * time.Millisecond) // let the change feed publish (and drop) its pending set
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

// BenchmarkViewHeapPerSliceEndpoint is BenchmarkViewHeapPerEndpoint for
// selector-less services: 100 services x 1,000 EndpointSlice addresses
// (10 slices of 100 each, on 50 nodes) that name no pod.
func BenchmarkViewHeapPerSliceEndpoint(b *testing.B) {
	const services, slicesPer, perSlice = 100, 10, 100
	for range b.N {
		heap0 := liveHeap()
		reg := registry.New(registry.Config{})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { _ = reg.Run(ctx); close(done) }()
		v := newView("c1", 1, model.DefaultDomain, "net1", reg)
		for s := range services {
			v.putService(convertService("c1", &corev1.Service{
				ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("svc-%d", s), Namespace: "bench"},
				Spec: corev1.ServiceSpec{ClusterIP: "10.96.0.1", ClusterIPs: []string{"10.96.0.1"},
					Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080)}}},
			}))
		}
		v.activate()
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
		n := 0
		for _, s := range reg.Services() {
			n += s.EndpointCount()
		}
		if n != services*slicesPer*perSlice {
			b.Fatalf("%d endpoints, want %d", n, services*slicesPer*perSlice)
		}
		time.Sleep(100 * time.Millisecond) // let the change feed publish (and drop) its pending set
		b.ReportMetric(float64(liveHeap()-heap0)/float64(n), "heap-B/endpoint")
		runtime.KeepAlive(v)
		runtime.KeepAlive(reg)
		cancel()
		<-done
	}
}
