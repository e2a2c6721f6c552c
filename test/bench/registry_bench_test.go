// Package bench holds the end-to-end benchmarks of the control plane on
// real kube-apiservers (see BENCHMARKS.md for the figures).
package bench_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

const (
	numClusters = 10
	numServices = 100
	// samples of isolated changes per size (a fixed count, whatever b.N is:
	// each sample waits out the quiet period).
	samples = 100
)

// env is a running federation of numClusters clusters under one pilot.
type env struct {
	set    *framework.ClusterSet
	pilot  *server.Server
	cancel context.CancelFunc
	done   chan error
	ns     string

	mu      sync.Mutex
	waiters map[string]chan time.Time
}

func clusterName(i int) string { return fmt.Sprintf("cluster-%d", i) }

func startEnv(b *testing.B) *env {
	b.Helper()
	names := make([]string, numClusters)
	for i := range names {
		names[i] = clusterName(i)
	}
	start := time.Now()
	set, err := framework.Start(framework.Options{Names: names})
	require.NoError(b, err)
	b.Logf("%d clusters started in %v", numClusters, time.Since(start).Round(time.Millisecond))
	return &env{set: set, ns: "isthmus-system", waiters: map[string]chan time.Time{}}
}

func (e *env) stop(b *testing.B) {
	if e.cancel != nil {
		e.cancel()
		require.NoError(b, <-e.done)
	}
	require.NoError(b, e.set.Stop())
}

// startPilot runs pilot on cluster-0 and registers the others; it returns
// once every cluster is synced.
func (e *env) startPilot(b *testing.B) { e.startPilotWith(b, defaults.Disabled, false) }

// startPilotWith also serves plaintext xDS on xdsAddr (defaults.Disabled: none); with
// oneNetwork every cluster is on network-0 (else cluster-i on network-i).
func (e *env) startPilotWith(b *testing.B, xdsAddr string, oneNetwork bool) {
	b.Helper()
	ctx := context.Background()
	c0 := e.set.Cluster(clusterName(0))
	require.NoError(b, c0.EnsureNamespace(ctx, e.ns, nil))
	p, err := server.New(server.Config{
		Namespace: e.ns, ClusterID: model.ClusterID(clusterName(0)), Network: "network-0",
		DebugAddr: defaults.Disabled, MonitoringAddr: defaults.Disabled, GRPCAddr: defaults.Disabled, XDSPlaintextAddr: xdsAddr, Logger: slog.New(slog.DiscardHandler),
	}, c0.Config, nil)
	require.NoError(b, err)
	p.Registry.Subscribe(e.onChange)
	rctx, cancel := context.WithCancel(ctx)
	e.pilot, e.cancel, e.done = p, cancel, make(chan error, 1)
	go func() { e.done <- p.Run(rctx) }()
	e.registerRemotes(b, oneNetwork)
	e.waitSynced(b)
}

// registerRemotes creates in cluster-0 the remote secret of every other
// cluster; with oneNetwork all are on network-0 (else cluster-i on
// network-i).
func (e *env) registerRemotes(b *testing.B, oneNetwork bool) {
	b.Helper()
	ctx := context.Background()
	c0 := e.set.Cluster(clusterName(0))
	require.NoError(b, c0.EnsureNamespace(ctx, e.ns, nil))
	for i := 1; i < numClusters; i++ {
		c := e.set.Cluster(clusterName(i))
		kc, err := c.ReaderKubeconfig(ctx, c.Name, remotesecret.ReaderOptions{})
		require.NoError(b, err)
		sec := remotesecret.Secret(c.Name, e.ns, kc)
		sec.Annotations[remotesecret.NetworkAnnotation] = fmt.Sprintf("network-%d", i)
		if oneNetwork {
			sec.Annotations[remotesecret.NetworkAnnotation] = "network-0"
		}
		_, err = c0.Client.CoreV1().Secrets(e.ns).Create(ctx, sec, metav1.CreateOptions{})
		require.NoError(b, err)
	}
}

func (e *env) waitSynced(b *testing.B) {
	b.Helper()
	require.Eventually(b, func() bool {
		st := e.pilot.Multicluster.Statuses()
		n := 0
		for _, s := range st {
			if s.State == "synced" && s.Pending == nil {
				n++
			}
		}
		return n == numClusters
	}, 10*time.Minute, 50*time.Millisecond)
}

func (e *env) onChange(cs model.ChangeSet) {
	now := time.Now()
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, c := range cs.Changes {
		if ch, ok := e.waiters[c.Key]; ok {
			ch <- now
			delete(e.waiters, c.Key)
		}
	}
}

// measure runs change (a write to some cluster) and returns the time until
// the registry publishes a change of key, and the time until a plain watch
// of the written object (w, opened before the write) saw it: the API
// server's own share, measured on the same write as the baseline.
func (e *env) measure(b *testing.B, key string, open func() (watch.Interface, error), change func() error) (total, apiserver time.Duration) {
	b.Helper()
	w := openWatch(b, open)
	defer w.Stop()
	ch := make(chan time.Time, 1)
	e.mu.Lock()
	e.waiters[key] = ch
	e.mu.Unlock()
	start := time.Now()
	require.NoError(b, change())
	timeout := time.After(30 * time.Second)
	for total == 0 || apiserver == 0 {
		select {
		case at := <-ch:
			total = at.Sub(start)
		case ev, ok := <-w.ResultChan():
			if !ok {
				b.Fatalf("baseline watch of %s closed", key)
			}
			if ev.Type == watch.Modified && apiserver == 0 {
				apiserver = time.Since(start)
			}
		case <-timeout:
			b.Fatalf("no change event for %s", key)
		}
	}
	return total, apiserver
}

// openWatch opens the baseline watch and makes sure the API server kept it
// (a watch from a resource version its cache has not reached yet is ended
// at once): it retries until the watch stays open for 50 ms or delivers the
// initial Added event of a watch from "now".
func openWatch(b *testing.B, open func() (watch.Interface, error)) watch.Interface {
	for range 20 {
		w, err := open()
		require.NoError(b, err)
		select {
		case ev, ok := <-w.ResultChan():
			if ok && ev.Type == watch.Added {
				return w // the initial state of a watch from "now": established
			}
			// Ended (or an error event) before the write: open it again.
			w.Stop()
			time.Sleep(50 * time.Millisecond)
		case <-time.After(50 * time.Millisecond):
			return w
		}
	}
	b.Fatal("baseline watch never stayed open")
	return nil
}

// reportLatency reports p50/p99 of the registry's latency, of the API
// server's (baseline) and of the registry's own share (total - baseline).
func reportLatency(b *testing.B, total, api []time.Duration) {
	own := make([]time.Duration, len(total))
	for i := range total {
		own[i] = total[i] - api[i]
	}
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	b.ReportMetric(ms(percentile(total, 0.5)), "p50-ms")
	b.ReportMetric(ms(percentile(total, 0.99)), "p99-ms")
	b.ReportMetric(ms(percentile(api, 0.5)), "apiserver-watch-p50-ms")
	b.ReportMetric(ms(percentile(api, 0.99)), "apiserver-watch-p99-ms")
	b.ReportMetric(ms(percentile(own, 0.5)), "registry-own-p50-ms")
	b.ReportMetric(ms(percentile(own, 0.99)), "registry-own-p99-ms")
}

// populatePods creates, in every cluster, namespace ns with numServices
// selector services and perCluster ready pods spread over them.
func (e *env) populatePods(b *testing.B, ns string, perCluster int) {
	b.Helper()
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make(chan error, numClusters)
	for ci, c := range e.set.Clusters {
		wg.Go(func() {
			if err := c.EnsureNamespace(ctx, ns, nil); err != nil {
				errs <- err
				return
			}
			for s := range numServices {
				if _, err := c.CreateService(ctx, ns, fmt.Sprintf("svc-%d", s), map[string]string{"app": fmt.Sprintf("svc-%d", s)},
					framework.ServicePort{Name: "http", Port: 80, TargetPort: 8080}); err != nil {
					errs <- err
					return
				}
			}
			work := make(chan int)
			var inner sync.WaitGroup
			for range 8 {
				inner.Go(func() {
					for i := range work {
						// Addresses are data only: nothing dials them.
						ip := netip.AddrFrom4([4]byte{10, byte(ci), byte(i >> 8), byte(i)})
						_, err := c.CreatePod(ctx, framework.PodOptions{Namespace: ns, Name: fmt.Sprintf("pod-%d", i), ServiceAccount: "sa",
							Labels: map[string]string{"app": fmt.Sprintf("svc-%d", i%numServices)}, Node: "node-0", IP: ip, Ready: true})
						if err != nil {
							errs <- err
							return
						}
					}
				})
			}
			for i := range perCluster {
				work <- i
			}
			close(work)
			inner.Wait()
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(b, err)
	}
}

func heapAfterGC() uint64 {
	var ms runtime.MemStats
	for range 3 {
		runtime.GC()
	}
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

func endpoints(p *server.Server) int {
	n := 0
	for _, s := range p.Registry.Services() {
		n += s.EndpointCount()
	}
	return n
}

func percentile(d []time.Duration, p float64) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[min(len(s)-1, int(float64(len(s))*p))]
}

// BenchmarkRegistryPods: 10 clusters with selector services; an isolated
// Pod status write in a remote cluster -> the registry's change event, at
// two sizes (500 and 5,000 pods per cluster), and heap bytes per endpoint.
func BenchmarkRegistryPods(b *testing.B) {
	e := startEnv(b)
	defer e.stop(b)
	heap0 := heapAfterGC()
	e.startPilot(b)
	var lastHeap uint64
	var lastEPs int
	for _, size := range []struct {
		ns         string
		perCluster int
	}{{"small", 500}, {"large", 4500}} {
		start := time.Now()
		e.populatePods(b, size.ns, size.perCluster)
		b.Logf("created %d pods per cluster in %v", size.perCluster, time.Since(start).Round(time.Millisecond))
		total := 0
		require.Eventually(b, func() bool { total = endpoints(e.pilot); return total >= lastEPs+numClusters*size.perCluster }, 10*time.Minute, 100*time.Millisecond)
		heap := heapAfterGC()
		name := fmt.Sprintf("endpoints=%d", total)
		b.Run(name, func(b *testing.B) {
			var lat, api []time.Duration
			ctx := context.Background()
			for i := range samples {
				c := e.set.Clusters[1+i%(numClusters-1)]
				pod := fmt.Sprintf("pod-%d", (i*7)%size.perCluster)
				p, err := c.Client.CoreV1().Pods(size.ns).Get(ctx, pod, metav1.GetOptions{})
				require.NoError(b, err)
				ready := true
				for _, cond := range p.Status.Conditions {
					if cond.Type == corev1.PodReady {
						ready = cond.Status == corev1.ConditionTrue
					}
				}
				time.Sleep(150 * time.Millisecond) // isolated changes: longer than the quiet period
				open := func() (watch.Interface, error) {
					// From "now": the API server first replays the pod as Added.
					return c.Client.CoreV1().Pods(size.ns).Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + pod})
				}
				total, apiserver := e.measure(b, model.WorkloadUID(model.ClusterID(c.Name), size.ns, pod), open, func() error {
					_, err := c.SetPodStatus(ctx, p, netip.Addr{}, !ready)
					return err
				})
				lat, api = append(lat, total), append(api, apiserver)
			}
			reportLatency(b, lat, api)
			b.ReportMetric(float64(heap-heap0)/float64(total), "heap-B/endpoint")
			if lastEPs > 0 {
				b.ReportMetric(float64(heap-lastHeap)/float64(total-lastEPs), "marginal-heap-B/endpoint")
			}
		})
		lastHeap, lastEPs = heap, total
	}
}

// BenchmarkRegistryEndpointSlices: 100 selector-less services whose
// endpoints come from EndpointSlices spread over 10 clusters; an isolated
// EndpointSlice write -> the change event, at 10,000 and 100,000 endpoints.
func BenchmarkRegistryEndpointSlices(b *testing.B) {
	e := startEnv(b)
	defer e.stop(b)
	heap0 := heapAfterGC()
	e.startPilot(b)
	ctx := context.Background()
	var lastHeap uint64
	var lastEPs int
	for _, size := range []struct {
		ns       string
		perSlice int
	}{{"small", 10}, {"large", 90}} {
		var wg sync.WaitGroup
		errs := make([]error, len(e.set.Clusters))
		for ci, c := range e.set.Clusters {
			wg.Go(func() {
				if errs[ci] = c.EnsureNamespace(ctx, size.ns, nil); errs[ci] != nil {
					return
				}
				for s := range numServices {
					svc := fmt.Sprintf("svc-%d", s)
					if _, errs[ci] = c.CreateService(ctx, size.ns, svc, nil, framework.ServicePort{Name: "http", Port: 80, TargetPort: 8080}); errs[ci] != nil {
						return
					}
					addrs := make([]netip.Addr, size.perSlice)
					for j := range addrs {
						// Addresses are data only: nothing dials them.
						addrs[j] = netip.AddrFrom4([4]byte{10, byte(100 + ci), byte(s), byte(j)})
					}
					if _, errs[ci] = c.CreateEndpointSlice(ctx, size.ns, svc+"-1", svc, "http", 8080, addrs...); errs[ci] != nil {
						return
					}
				}
			})
		}
		wg.Wait()
		for _, err := range errs {
			require.NoError(b, err)
		}
		total := 0
		require.Eventually(b, func() bool {
			total = endpoints(e.pilot)
			return total >= lastEPs+numClusters*numServices*size.perSlice
		}, 10*time.Minute, 100*time.Millisecond)
		heap := heapAfterGC()
		b.Run(fmt.Sprintf("endpoints=%d", total), func(b *testing.B) {
			var lat, api []time.Duration
			for i := range samples {
				c := e.set.Clusters[1+i%(numClusters-1)]
				svc := fmt.Sprintf("svc-%d", (i*13)%numServices)
				es, err := c.Client.DiscoveryV1().EndpointSlices(size.ns).Get(ctx, svc+"-1", metav1.GetOptions{})
				require.NoError(b, err)
				j := i % len(es.Endpoints)
				ready := es.Endpoints[j].Conditions.Ready == nil || *es.Endpoints[j].Conditions.Ready
				flipped := !ready
				es.Endpoints[j].Conditions = discoveryv1.EndpointConditions{Ready: &flipped}
				time.Sleep(150 * time.Millisecond)
				open := func() (watch.Interface, error) {
					return c.Client.DiscoveryV1().EndpointSlices(size.ns).Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + svc + "-1", ResourceVersion: es.ResourceVersion})
				}
				total, apiserver := e.measure(b, model.Hostname(svc, size.ns, ""), open, func() error {
					_, err := c.Client.DiscoveryV1().EndpointSlices(size.ns).Update(ctx, es, metav1.UpdateOptions{})
					return err
				})
				lat, api = append(lat, total), append(api, apiserver)
			}
			reportLatency(b, lat, api)
			b.ReportMetric(float64(heap-heap0)/float64(total), "heap-B/endpoint")
			if lastEPs > 0 {
				b.ReportMetric(float64(heap-lastHeap)/float64(total-lastEPs), "marginal-heap-B/endpoint")
			}
		})
		lastHeap, lastEPs = heap, total
	}
}
