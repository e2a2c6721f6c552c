package controller_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/controller"
	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/pilot/registry"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// Sizes of BenchmarkSelectedShareHeap: shareNamespaces namespaces, each with
// a selector service of sharePods pods and a selector-less service of
// shareSlices EndpointSlices of shareAddrs addresses.
const (
	shareNamespaces = 10
	sharePods       = 20
	shareSlices     = 10
	shareAddrs      = 100
)

// BenchmarkSelectedShareHeap: discovery (multicluster controller, discovery,
// registry) of a real cluster holding 10 namespaces of 1,020 endpoints
// each, with discovery selectors that select 0, 5 or 10 of them. It reports
// the heap held once synced, over a baseline taken before it started, in
// the same run: the heap follows the selected share.
func BenchmarkSelectedShareHeap(b *testing.B) {
	ctx := context.Background()
	c := clusters.Cluster("cluster-1")
	for n := range shareNamespaces {
		fillShareNamespace(b, c, n)
	}
	for _, selected := range []int{0, shareNamespaces / 2, shareNamespaces} {
		b.Run(fmt.Sprintf("selected=%d%%", selected*100/shareNamespaces), func(b *testing.B) {
			var values []string
			for n := range selected {
				values = append(values, fmt.Sprint(n))
			}
			sel := metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{Key: "share", Operator: metav1.LabelSelectorOpIn, Values: values}}}
			if selected == 0 {
				sel = metav1.LabelSelector{MatchLabels: map[string]string{"share": "none"}}
			}
			for range b.N {
				heap0 := liveHeap()
				endpoints, stop := runSelected(ctx, b, sel, selected*(sharePods+shareSlices*shareAddrs))
				heap1 := liveHeap()
				b.ReportMetric(float64(int64(heap1)-int64(heap0))/(1<<20), "heap-MB")
				if endpoints > 0 {
					b.ReportMetric(float64(int64(heap1)-int64(heap0))/float64(endpoints), "heap-B/endpoint")
				}
				stop()
			}
		})
	}
}

// fillShareNamespace makes namespace share-n (labelled share=n) with its
// services, pods and slices, unless it is there already.
func fillShareNamespace(b *testing.B, c *framework.Cluster, n int) {
	ctx := context.Background()
	ns := fmt.Sprintf("share-%d", n)
	require.NoError(b, c.EnsureNamespace(ctx, ns, map[string]string{"share": fmt.Sprint(n)}))
	if _, err := c.Client.CoreV1().Services(ns).Get(ctx, "web", metav1.GetOptions{}); err == nil {
		return
	}
	_, err := c.CreateService(ctx, ns, "web", map[string]string{"app": "web"}, framework.ServicePort{Name: "http", Port: 80, TargetPort: 8080})
	require.NoError(b, err)
	for i := range sharePods {
		ip := netip.AddrFrom4([4]byte{127, 40, byte(n), byte(i + 1)})
		_, err := c.CreatePod(ctx, framework.PodOptions{Namespace: ns, Name: fmt.Sprintf("web-%d", i), Labels: map[string]string{"app": "web"}, IP: ip, Ready: true})
		require.NoError(b, err)
	}
	_, err = c.CreateService(ctx, ns, "db", nil, framework.ServicePort{Name: "sql", Port: 5432, TargetPort: 5432})
	require.NoError(b, err)
	for s := range shareSlices {
		addrs := make([]netip.Addr, shareAddrs)
		for i := range addrs {
			addrs[i] = netip.AddrFrom4([4]byte{10, byte(40 + n), byte(s), byte(i + 1)})
		}
		_, err := c.CreateEndpointSlice(ctx, ns, fmt.Sprintf("db-%d", s), "db", "sql", 5432, addrs...)
		require.NoError(b, err)
	}
}

// runSelected runs discovery of cluster-1 with the selector until the
// registry holds want endpoints of the share-* namespaces; it returns
// how many it holds and a function that stops it.
func runSelected(ctx context.Context, b *testing.B, sel metav1.LabelSelector, want int) (int, func()) {
	ctx, cancel := context.WithCancel(ctx)
	log := slog.New(slog.DiscardHandler)
	reg := registry.New(registry.Config{Logger: log})
	local, err := multicluster.NewClient(clusters.Cluster("cluster-1").Config)
	require.NoError(b, err)
	ctl, err := multicluster.New(multicluster.Config{Namespace: "share-bench", ConfigClusterID: "cluster-1", ConfigClusterNetwork: "network-1",
		Logger: log, DiscoverySelectors: []metav1.LabelSelector{sel}}, local, nil)
	require.NoError(b, err)
	ctl.AddComponent("discovery", controller.NewBuilder(controller.Config{ControlPlaneNamespace: "share-bench", Logger: log}, reg))
	var wg sync.WaitGroup
	wg.Go(func() { _ = reg.Run(ctx) })
	wg.Go(func() { _ = ctl.Run(ctx) })
	count := func() int {
		n := 0
		for _, s := range reg.Services() {
			if strings.Contains(s.Hostname, ".share-") {
				n += s.EndpointCount()
			}
		}
		return n
	}
	require.Eventually(b, func() bool { return ctl.Ready() && count() == want }, 2*time.Minute, 20*time.Millisecond, "want %d endpoints", want)
	time.Sleep(500 * time.Millisecond) // the change feed publishes and drops its pending set
	runtime.KeepAlive(reg)
	return count(), func() { cancel(); wg.Wait() }
}

func liveHeap() uint64 {
	var ms runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}
