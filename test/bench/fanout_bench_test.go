package bench_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/pilot/xds"
	"github.com/isthmus-mesh/isthmus/test/envoynode"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// Fan-out benchmark shape (issue 20): 100 selector-less services x 100
// endpoints from EndpointSlices in one real cluster.
const (
	fanNamespace = "fan"
	fanServices  = 100
	fanPerSlice  = 100
	fanSuffix    = "." + fanNamespace + ".svc.cluster.local"
	// fanSamples isolated changes per server, N and protocol.
	fanSamples = 40
	// fanWave clients connect at once (and get their initial state)
	// before the next wave.
	fanWave = 100
)

// fanServer is an xDS server under test, running as its own process.
type fanServer struct {
	name    string
	xdsAddr string
	pid     int
	// debugAddr serves /debug/pprof.
	debugAddr string
	// node returns the node of client i.
	node func(i int) *corev3.Node
	// goMetric reads one of the process's Go runtime metrics
	// (go_memstats_*).
	goMetric func(b *testing.B, name string) float64
	// gc makes the process collect garbage (through its pprof handler).
	gc func(b *testing.B)
	// flip prepares flipping the readiness of endpoint j of service svc:
	// it returns the endpoint's address, its readiness after the flip, and
	// the change itself, which the sample times.
	flip func(b *testing.B, svc string, j int) (addr string, ready bool, apply func())
	// sotwOnly servers serve no delta streams.
	sotwOnly bool
	// tcp servers serve length-prefixed messages over plain TCP (the
	// raw-TCP floor), not gRPC.
	tcp bool
}

// BenchmarkXDSFanout: one endpoint's readiness change -> the EDS update at
// every one of N Envoy-style ADS clients (SotW and delta; CDS wildcard, then
// EDS for every cluster), N = 100, 500 and 1,000, 10,000 endpoints over 100
// services in a real cluster. Each server runs as its own process, the
// clients in the benchmark's: pilot (cmd/pilot, default settings; the change
// is an EndpointSlice write) and the floor (./fanoutfloor, SotW only; the
// change is a call to it). Per N: the first, median and last client's
// latency (p50 and p99 over the samples), the first-to-last spread per
// client, and the server's RSS, Go heap, goroutine stacks and goroutines
// per connected idle client. Every sample asserts that every client got the
// changed resource, byte-identical across clients, with the endpoint's new
// health status. ISTHMUS_BENCH_FANOUT_N overrides the sizes ("100,500"),
// ISTHMUS_BENCH_FANOUT_PROTO runs one protocol only (sotw or delta).
// ISTHMUS_BENCH_FANOUT_BASELINE names a git revision of this repository
// (e.g. the commit before a change): pilot built from it runs side by side
// as server "pilot-base", measured in the same run.
// ISTHMUS_BENCH_FANOUT_ISTIOD (any value) adds istiod as server "istiod",
// built once per machine by hack/build-istiod.sh (~14 minutes).
// ISTHMUS_BENCH_FANOUT_NODE=envoy gives each client the node a real
// sidecar's Envoy sends (test/envoynode: 26 KB, most of it the extensions
// compiled in), with the server's metadata; by default a client's node
// holds its id and that metadata only.
func BenchmarkXDSFanout(b *testing.B) {
	set, err := framework.Start(framework.Options{Names: []string{clusterName(0)}})
	require.NoError(b, err)
	defer func() { require.NoError(b, set.Stop()) }()
	c0 := set.Cluster(clusterName(0))
	populateFanout(b, c0)

	servers := []*fanServer{pilotFanServer(b, c0, "pilot", "127.0.61.1", "")}
	if rev := os.Getenv("ISTHMUS_BENCH_FANOUT_BASELINE"); rev != "" {
		servers = append([]*fanServer{pilotFanServer(b, c0, "pilot-base", "127.0.61.2", checkout(b, rev))}, servers...)
	}
	if os.Getenv("ISTHMUS_BENCH_FANOUT_ISTIOD") != "" {
		servers = append([]*fanServer{istiodFanServer(b, c0, "127.0.61.3")}, servers...)
	}
	servers = append(servers, floorFanServer(b, "127.0.61.4", false), floorFanServer(b, "127.0.61.5", true))
	sizes := []int{100, 500, 1000}
	if v := os.Getenv("ISTHMUS_BENCH_FANOUT_N"); v != "" {
		sizes = nil
		for _, f := range strings.Split(v, ",") {
			n, err := strconv.Atoi(f)
			require.NoError(b, err)
			sizes = append(sizes, n)
		}
	}
	for _, delta := range []bool{false, true} {
		proto := map[bool]string{false: "sotw", true: "delta"}[delta]
		if only := os.Getenv("ISTHMUS_BENCH_FANOUT_PROTO"); only != "" && only != proto {
			continue
		}
		for _, n := range sizes {
			for _, srv := range servers {
				if delta && srv.sotwOnly {
					continue
				}
				b.Run(fmt.Sprintf("server=%s/proto=%s/N=%d", srv.name, proto, n), func(b *testing.B) {
					runFanout(b, srv, n, delta)
				})
			}
		}
	}
}

// fanNode returns the node of srv's client i (see
// ISTHMUS_BENCH_FANOUT_NODE).
func fanNode(srv *fanServer, i int) *corev3.Node {
	n := srv.node(i)
	if os.Getenv("ISTHMUS_BENCH_FANOUT_NODE") != "envoy" {
		return n
	}
	md := map[string]string{}
	for k, v := range n.GetMetadata().GetFields() {
		md[k] = v.GetStringValue()
	}
	return envoynode.Sidecar(n.GetId(), md)
}

// populateFanout writes fanServices selector-less services, each with one
// EndpointSlice of fanPerSlice ready endpoints (addresses are data only).
func populateFanout(b *testing.B, c *framework.Cluster) {
	ctx := context.Background()
	require.NoError(b, c.EnsureNamespace(ctx, fanNamespace, nil))
	work := make(chan int)
	errs := make(chan error, fanServices)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for s := range work {
				svc := fmt.Sprintf("svc-%d", s)
				if _, err := c.CreateService(ctx, fanNamespace, svc, nil, framework.ServicePort{Name: "http", Port: 80, TargetPort: 8080}); err != nil {
					errs <- err
					continue
				}
				addrs := make([]netip.Addr, fanPerSlice)
				for j := range addrs {
					addrs[j] = netip.AddrFrom4([4]byte{10, 200, byte(s), byte(j)})
				}
				if _, err := c.CreateEndpointSlice(ctx, fanNamespace, svc+"-1", svc, "http", 8080, addrs...); err != nil {
					errs <- err
				}
			}
		})
	}
	for s := range fanServices {
		work <- s
	}
	close(work)
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(b, err)
	}
}

// checkout writes the tree of git revision rev of this repository into a
// temporary folder and returns it.
func checkout(b *testing.B, rev string) string {
	b.Helper()
	dir := b.TempDir()
	archive := exec.Command("git", "archive", "--format=tar", rev)
	archive.Dir = repoRoot(b)
	untar := exec.Command("tar", "-x", "-C", dir)
	pipe, err := archive.StdoutPipe()
	require.NoError(b, err)
	untar.Stdin = pipe
	require.NoError(b, archive.Start())
	require.NoError(b, untar.Run())
	require.NoError(b, archive.Wait(), "git archive %s", rev)
	return dir
}

// pilotFanServer runs pilot built from src (this module when empty) on ip.
func pilotFanServer(b *testing.B, c0 *framework.Cluster, name, ip, src string) *fanServer {
	const ns = "isthmus-system"
	require.NoError(b, c0.EnsureNamespace(context.Background(), ns, nil))
	p := startPilotProcessAt(b, c0, ns, ip, src)
	return &fanServer{
		name: name, xdsAddr: p.xdsAddr, pid: p.cmd.Process.Pid, debugAddr: p.debugAddr,
		node: func(i int) *corev3.Node {
			return &corev3.Node{Id: fmt.Sprintf("envoy-%d", i), Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{
				xds.MetadataNetwork: structpb.NewStringValue("network-0"), xds.MetadataClusterID: structpb.NewStringValue(clusterName(0)),
			}}}
		},
		goMetric: p.metric,
		gc:       func(b *testing.B) { gcTwice(b, p.debugAddr) },
		flip:     flipSlice(c0),
	}
}

// profileFanout, when ISTHMUS_BENCH_FANOUT_PROFILE names a folder, writes
// there the server's heap profile with n idle clients, and starts CPU
// profiles of the samples, the server's and the clients' (this process),
// that the returned func ends and writes.
func profileFanout(b *testing.B, srv *fanServer, n int, delta bool) func() {
	dir := os.Getenv("ISTHMUS_BENCH_FANOUT_PROFILE")
	if dir == "" || srv.debugAddr == "" {
		return func() {}
	}
	base := filepath.Join(dir, fmt.Sprintf("%s-%s-%d", srv.name, map[bool]string{false: "sotw", true: "delta"}[delta], n))
	save := func(url, path string) {
		resp, err := http.Get(url)
		require.NoError(b, err)
		defer resp.Body.Close()
		f, err := os.Create(path)
		require.NoError(b, err)
		defer f.Close()
		_, err = io.Copy(f, resp.Body)
		require.NoError(b, err)
	}
	save("http://"+srv.debugAddr+"/debug/pprof/heap?gc=1", base+".heap")
	done := make(chan struct{})
	go func() {
		defer close(done)
		save("http://"+srv.debugAddr+"/debug/pprof/profile?seconds=15", base+".cpu")
	}()
	// The clients' side of the same samples, from this process.
	clients, err := os.Create(base + "-clients.cpu")
	require.NoError(b, err)
	require.NoError(b, pprof.StartCPUProfile(clients))
	return func() {
		<-done
		pprof.StopCPUProfile()
		require.NoError(b, clients.Close())
	}
}

// gcTwice makes the process behind debugAddr collect garbage twice (the
// second drops what sync.Pools only cached).
func gcTwice(b *testing.B, debugAddr string) {
	httpGet(b, "http://"+debugAddr+"/debug/pprof/heap?gc=1")
	httpGet(b, "http://"+debugAddr+"/debug/pprof/heap?gc=1")
}

func httpGet(b *testing.B, url string) {
	b.Helper()
	resp, err := http.Get(url)
	require.NoError(b, err)
	resp.Body.Close()
}

// The Go runtime's heap and goroutine stacks in use, and its goroutines,
// as every server exports them.
const (
	heapInuse  = "go_memstats_heap_inuse_bytes"
	stackInuse = "go_memstats_stack_inuse_bytes"
	goroutines = "go_goroutines"
)

// runFanout connects n clients to srv, measures the server's memory per
// idle client, then times fanSamples isolated endpoint changes.
//
// Memory per client is what the last n-1 clients add to the first's: the
// first client of a server builds what every client then shares (pilot's
// view of the client's class and its encoded responses, protobuf's type
// tables), a cost per server that dividing by n would spread over the
// clients. The first client's own cost is logged.
func runFanout(b *testing.B, srv *fanServer, n int, delta bool) {
	var sample atomic.Pointer[fanSample]
	ctx, cancel := context.WithCancel(context.Background())
	clients := make([]*fanClient, 0, n)
	defer func() {
		cancel()
		for _, c := range clients {
			c.close()
		}
	}()
	connect := func(from, to int) {
		for w := from; w < to; w += fanWave {
			for i := w; i < min(to, w+fanWave); i++ {
				c, err := dialFanClient(ctx, srv.xdsAddr, srv.tcp, i, delta, fanNode(srv, i), fanSuffix, fanServices*fanPerSlice, &sample)
				require.NoError(b, err)
				clients = append(clients, c)
			}
			for _, c := range clients[w:] {
				require.NoError(b, c.waitReady(5*time.Minute))
			}
		}
	}
	srv.gc(b)
	heapIdle := srv.goMetric(b, heapInuse)
	connect(0, 1)
	srv.gc(b)
	rss0, heap0, stack0 := settledRSS(b, srv.pid), srv.goMetric(b, heapInuse), srv.goMetric(b, stackInuse)
	goroutines0 := srv.goMetric(b, goroutines)
	b.Logf("%s: the first client added %.0f KB of heap", srv.name, (heap0-heapIdle)/1024)
	t0 := time.Now()
	connect(1, n)
	b.Logf("%s: %d more clients hold all %d endpoints after %v", srv.name, n-1, fanServices*fanPerSlice, time.Since(t0).Round(time.Millisecond))
	srv.gc(b)
	rss1, heap1, stack1 := settledRSS(b, srv.pid), srv.goMetric(b, heapInuse), srv.goMetric(b, stackInuse)
	goroutines1 := srv.goMetric(b, goroutines)
	stopProfile := profileFanout(b, srv, n, delta)
	defer stopProfile()

	var first, median, last, spread []time.Duration
	cpu0, clientCPU0 := processCPU(b, srv.pid), processCPU(b, os.Getpid())
	for i := range fanSamples {
		s := fanChange(b, srv, clients, &sample, i)
		arr := slices.Clone(s.arrived)
		slices.SortFunc(arr, func(a, b time.Time) int { return a.Compare(b) })
		first = append(first, arr[0].Sub(s.start))
		median = append(median, arr[len(arr)/2].Sub(s.start))
		last = append(last, arr[len(arr)-1].Sub(s.start))
		spread = append(spread, arr[len(arr)-1].Sub(arr[0]))
	}
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	for _, m := range []struct {
		name string
		d    []time.Duration
	}{{"first", first}, {"median", median}, {"last", last}, {"spread", spread}} {
		b.ReportMetric(ms(percentile(m.d, 0.5)), m.name+"-p50-ms")
		b.ReportMetric(ms(percentile(m.d, 0.99)), m.name+"-p99-ms")
	}
	b.ReportMetric(ms(percentile(spread, 0.5))/float64(n), "spread-per-client-ms")
	more := float64(n - 1)
	b.ReportMetric((float64(rss1)-float64(rss0))/more/1024, "RSS-KB/client")
	b.ReportMetric((heap1-heap0)/more/1024, "heap-KB/client")
	b.ReportMetric((stack1-stack0)/more/1024, "stack-KB/client")
	b.ReportMetric((goroutines1-goroutines0)/more, "goroutines/client")
	b.ReportMetric(float64(rss1)/(1<<20), "RSS-MiB")
	// The server's CPU time per change and client: what the spread would
	// be on an idle core, whatever else the machine runs.
	cpu := processCPU(b, srv.pid) - cpu0
	b.ReportMetric(float64(cpu.Microseconds())/fanSamples/float64(n), "server-CPU-us/client/change")
	// The clients' share of the same two cores (this process: reading,
	// checking and ACKing each response).
	clientCPU := processCPU(b, os.Getpid()) - clientCPU0
	b.ReportMetric(float64(clientCPU.Microseconds())/fanSamples/float64(n), "client-CPU-us/client/change")
	b.ReportMetric(loadAverage(), "load1")
}

// fanChange flips the readiness of one endpoint of service i%fanServices,
// waits until every client got that service's ClusterLoadAssignment, and
// checks what each got: the same bytes everywhere, with the new status.
func fanChange(b *testing.B, srv *fanServer, clients []*fanClient, cur *atomic.Pointer[fanSample], i int) *fanSample {
	b.Helper()
	svc := fmt.Sprintf("svc-%d", (i*37)%fanServices)
	addr, ready, apply := srv.flip(b, svc, (i*7)%fanPerSlice)
	// A quiet period longer than either server's debounce, so each sample
	// is an isolated change.
	time.Sleep(300 * time.Millisecond)
	s := &fanSample{name: "outbound|80||" + svc + fanSuffix, arrived: make([]time.Time, len(clients)), got: make([][]byte, len(clients)), done: make(chan struct{})}
	s.left.Store(int64(len(clients)))
	cur.Store(s)
	s.start = time.Now()
	apply()
	select {
	case <-s.done:
	case <-time.After(time.Minute):
		missing := 0
		for _, c := range clients {
			if s.arrived[c.idx].IsZero() {
				missing++
			}
		}
		b.Fatalf("%d of %d clients did not get %s within a minute", missing, len(clients), s.name)
	}
	cur.Store(nil)
	for _, c := range clients {
		select {
		case <-c.done:
			b.Fatalf("client %d: %v: %v", c.idx, errStreamEnded, c.err)
		default:
		}
		require.Equal(b, s.got[0], s.got[c.idx], "client %d got other bytes for %s than client 0", c.idx, s.name)
	}
	checkHealth(b, s.got[0], addr, ready)
	return s
}

// flipSlice is fanServer.flip for servers that watch cluster c: it
// updates the service's EndpointSlice.
func flipSlice(c *framework.Cluster) func(b *testing.B, svc string, j int) (string, bool, func()) {
	return func(b *testing.B, svc string, j int) (string, bool, func()) {
		ctx := context.Background()
		es, err := c.Client.DiscoveryV1().EndpointSlices(fanNamespace).Get(ctx, svc+"-1", metav1.GetOptions{})
		require.NoError(b, err)
		ready := !(es.Endpoints[j].Conditions.Ready == nil || *es.Endpoints[j].Conditions.Ready)
		// Serving and not terminating, spelled out: istiod reads a missing
		// terminating condition as terminating, and drops such endpoints.
		terminating := false
		es.Endpoints[j].Conditions = discoveryv1.EndpointConditions{Ready: &ready, Serving: &ready, Terminating: &terminating}
		return es.Endpoints[j].Addresses[0], ready, func() {
			_, err := c.Client.DiscoveryV1().EndpointSlices(fanNamespace).Update(ctx, es, metav1.UpdateOptions{})
			require.NoError(b, err)
		}
	}
}

// checkHealth asserts that the ClusterLoadAssignment cla lists addr with
// the health status of ready.
func checkHealth(b *testing.B, cla []byte, addr string, ready bool) {
	b.Helper()
	m := &endpointv3.ClusterLoadAssignment{}
	require.NoError(b, proto.Unmarshal(cla, m))
	found := 0
	for _, l := range m.GetEndpoints() {
		for _, e := range l.GetLbEndpoints() {
			if e.GetEndpoint().GetAddress().GetSocketAddress().GetAddress() != addr {
				continue
			}
			found++
			hs := e.GetHealthStatus()
			healthy := hs == corev3.HealthStatus_HEALTHY || hs == corev3.HealthStatus_UNKNOWN
			require.Equal(b, ready, healthy, "%s of %s has health %v", addr, m.GetClusterName(), hs)
		}
	}
	require.Equal(b, 1, found, "%s listed %d times in %s", addr, found, m.GetClusterName())
}

// settledRSS returns the process's RSS once it stopped changing by more
// than 1% over a second (at most 20 s): the runtime returns freed pages to
// the OS gradually.
func settledRSS(b *testing.B, pid int) int64 {
	b.Helper()
	prev, err := framework.RSSBytes(pid)
	require.NoError(b, err)
	for range 20 {
		time.Sleep(time.Second)
		cur, err := framework.RSSBytes(pid)
		require.NoError(b, err)
		if d := cur - prev; d < prev/100 && -d < prev/100 {
			return cur
		}
		prev = cur
	}
	return prev
}

// processCPU returns the user and system CPU time process pid has used
// (/proc/<pid>/stat, in clock ticks of 10 ms).
func processCPU(b *testing.B, pid int) time.Duration {
	b.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	require.NoError(b, err)
	// Fields after the command (which may hold spaces), from field 3.
	f := strings.Fields(string(data[strings.LastIndexByte(string(data), ')')+1:]))
	utime, err := strconv.ParseInt(f[11], 10, 64)
	require.NoError(b, err)
	stime, err := strconv.ParseInt(f[12], 10, 64)
	require.NoError(b, err)
	return time.Duration(utime+stime) * 10 * time.Millisecond
}

func loadAverage() float64 {
	data, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	f, _ := strconv.ParseFloat(strings.Fields(string(data))[0], 64)
	return f
}
