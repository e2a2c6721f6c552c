package multicluster_test

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"k8s.io/client-go/rest"

	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// TestChurn runs 100 add/update/delete cycles of a remote and checks that
// no goroutine is left, that every Client built for the remote is garbage
// collected, and that the heap does not grow beyond noise.
//
// The churned remote speaks HTTP/1.1. Over HTTP/2, golang.org/x/net/http2
// keeps each closed ClientConn (and through it its Transport, TLS config
// and buffers, ~45 KB) reachable from runtime timers for up to
// IdleConnTimeout (90 s): the read loop's health-check timer is never
// stopped, and a stream forgotten after the read loop exits re-arms the
// idle timer. That memory is freed later, but within this test it would be
// ~9 MiB of growth hiding anything that multicluster itself retains. The
// Clients are collected over either protocol.
func TestChurn(t *testing.T) {
	ensurePods(t, "remote-1", "churn", 50)
	var built, freed atomic.Int64
	build := func(kc []byte, id model.ClusterID, overrides ...func(*rest.Config)) (*multicluster.Client, error) {
		http1 := func(c *rest.Config) { c.NextProtos = []string{"http/1.1"} }
		cl, err := multicluster.DefaultClientBuilder(kc, id, append(overrides, http1)...)
		if err == nil {
			built.Add(1)
			runtime.AddCleanup(cl, func(struct{}) { freed.Add(1) }, struct{}{})
		}
		return cl, err
	}
	e := startControllerWith(t, "mc-churn", nil, build)
	kcs := [][]byte{kubeconfig(t, "remote-1", "remote-1"), kubeconfig(t, "remote-1", "remote-1")}
	// One warm-up cycle so that lazily initialised globals (client-go's
	// metrics, codecs) are not counted as growth.
	cycle := func(i int) {
		e.applySecret("churn", map[string][]byte{"remote-1": kcs[i%2]})
		s := e.waitState("remote-1", multicluster.StateSynced, "")
		e.applySecret("churn", map[string][]byte{"remote-1": kcs[(i+1)%2]})
		require.Eventually(t, func() bool {
			cur, ok := e.ctl.Status("remote-1")
			return ok && cur.Generation > s.Generation && cur.State == multicluster.StateSynced
		}, 20*time.Second, 5*time.Millisecond)
		e.deleteSecret("churn")
		e.waitGone("remote-1")
	}
	cycle(0)
	settle := func() uint64 {
		var ms runtime.MemStats
		for range 3 {
			runtime.GC()
		}
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	require.Eventually(t, func() bool { return e.sink.count("remote-1") == 0 }, 10*time.Second, 10*time.Millisecond)
	time.Sleep(200 * time.Millisecond)
	baseline := goleak.IgnoreCurrent()
	heapBefore := settle()
	const cycles = 100
	for i := range cycles {
		cycle(i)
	}
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.NoError(c, goleak.Find(baseline))
	}, 15*time.Second, 50*time.Millisecond)
	// Cleanups run after a GC, on their own goroutine.
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		runtime.GC()
		require.Equal(c, built.Load(), freed.Load(), "clients built vs garbage collected")
	}, 10*time.Second, 50*time.Millisecond)
	require.EqualValues(t, 2*(cycles+1), built.Load(), "clients built")
	heapAfter := settle()
	growth := int64(heapAfter) - int64(heapBefore)
	t.Logf("heap after %d add/update/delete cycles: %+d KiB (before %d KiB, after %d KiB)", cycles, growth>>10, heapBefore>>10, heapAfter>>10)
	// Each cycle caches 50 pods in each of two generations; 2 MiB over 200
	// generations is ~10 KB each, far less than one generation's client,
	// transport, informers and pods.
	require.Less(t, growth, int64(2<<20), "heap grew by %d KiB over %d cycles", growth>>10, cycles)
}

// BenchmarkSecretToSynced5000Pods measures the time from a remote Secret's
// creation to the cluster being synced, for a remote with 5,000 pods.
func BenchmarkSecretToSynced5000Pods(b *testing.B) {
	const pods = 5000
	c := clusters.Cluster("remote-2")
	ctx := context.Background()
	require.NoError(b, c.EnsureNamespace(ctx, "bench", nil))
	existing, err := c.Client.CoreV1().Pods("bench").List(ctx, listLimit(1))
	require.NoError(b, err)
	if existing.RemainingItemCount == nil || *existing.RemainingItemCount+1 < pods {
		var wg sync.WaitGroup
		errs := make(chan error, pods)
		work := make(chan int)
		for range 32 {
			wg.Go(func() {
				for i := range work {
					_, err := c.CreatePod(ctx, framework.PodOptions{Namespace: "bench", Name: fmt.Sprintf("pod-%05d", i), Labels: map[string]string{"app": "bench"},
						IP: addrFor(i), Ready: true, Node: "node-0"})
					if err != nil {
						errs <- err
					}
				}
			})
		}
		for i := range pods {
			work <- i
		}
		close(work)
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(b, err)
		}
	}
	e := startController(b, "mc-bench", nil)
	kc := kubeconfig(b, "remote-2", "remote-2")
	b.ResetTimer()
	for b.Loop() {
		start := time.Now()
		e.applySecret("bench", map[string][]byte{"remote-2": kc})
		e.waitState("remote-2", multicluster.StateSynced, "")
		b.ReportMetric(float64(time.Since(start).Milliseconds()), "ms-to-synced")
		require.Equal(b, pods, e.sink.count("remote-2"))
		b.StopTimer()
		e.deleteSecret("bench")
		e.waitGone("remote-2")
		b.StartTimer()
	}
}
