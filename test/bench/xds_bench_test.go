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
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/isthmus-mesh/isthmus/pilot/xds"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// BenchmarkXDSEndpointSliceToEDS: 100,000 endpoints over 100 selector-less
// services spread over 10 real clusters, served by pilot running as its own
// process (the cmd/pilot binary, default settings); an isolated
// EndpointSlice write in a remote cluster -> the EDS update at a subscribed
// SotW ADS client. Also reports pilot's process RSS (now and peak) and Go
// heap at 100,000 endpoints.
func BenchmarkXDSEndpointSliceToEDS(b *testing.B) {
	perSlice := 100 // per cluster and service: 10 x 100 x 100 = 100,000
	if v, err := strconv.Atoi(os.Getenv("ISTHMUS_BENCH_PER_SLICE")); err == nil {
		perSlice = v // smaller runs while developing
	}
	e := startEnv(b)
	defer e.stop(b)
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make([]error, len(e.set.Clusters))
	for ci, c := range e.set.Clusters {
		wg.Go(func() {
			if errs[ci] = c.EnsureNamespace(ctx, "xds", nil); errs[ci] != nil {
				return
			}
			for s := range numServices {
				svc := fmt.Sprintf("svc-%d", s)
				if _, errs[ci] = c.CreateService(ctx, "xds", svc, nil, framework.ServicePort{Name: "http", Port: 80, TargetPort: 8080}); errs[ci] != nil {
					return
				}
				addrs := make([]netip.Addr, perSlice)
				for j := range addrs {
					// Addresses are data only: nothing dials them.
					addrs[j] = netip.AddrFrom4([4]byte{10, byte(100 + ci), byte(s), byte(j)})
				}
				if _, errs[ci] = c.CreateEndpointSlice(ctx, "xds", svc+"-1", svc, "http", 8080, addrs...); errs[ci] != nil {
					return
				}
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(b, err)
	}
	e.registerRemotes(b, true) // one network: every endpoint is served directly
	pilot := startPilotProcess(b, e.set.Cluster(clusterName(0)), e.ns)

	conn, err := grpc.NewClient(pilot.xdsAddr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(256<<20)))
	require.NoError(b, err)
	defer conn.Close()
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := discovery.NewAggregatedDiscoveryServiceClient(conn).StreamAggregatedResources(sctx)
	require.NoError(b, err)
	names := make([]string, numServices)
	for s := range names {
		names[s] = fmt.Sprintf("outbound|80||svc-%d.xds.svc.cluster.local", s)
	}
	node := &corev3.Node{Id: "bench~client", Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{
		xds.MetadataNetwork: structpb.NewStringValue("network-0"), xds.MetadataClusterID: structpb.NewStringValue(clusterName(0)),
	}}}
	require.NoError(b, stream.Send(&discovery.DiscoveryRequest{Node: node, TypeUrl: resource.EndpointType, ResourceNames: names}))

	// A reader goroutine ACKs every response, keeps the endpoint count of
	// every cluster name, and reports when each name arrived.
	type arrival struct {
		name string
		at   time.Time
	}
	arrivals := make(chan arrival, 1024)
	var countsMu sync.Mutex
	counts := map[string]int{}
	recvErr := make(chan error, 1)
	go func() {
		for {
			resp, err := stream.Recv()
			if err != nil {
				recvErr <- err
				return
			}
			now := time.Now()
			for _, r := range resp.GetResources() {
				cla := &endpointv3.ClusterLoadAssignment{}
				if r.UnmarshalTo(cla) != nil {
					continue
				}
				n := 0
				for _, l := range cla.GetEndpoints() {
					n += len(l.GetLbEndpoints())
				}
				countsMu.Lock()
				counts[cla.GetClusterName()] = n
				countsMu.Unlock()
				select {
				case arrivals <- arrival{cla.GetClusterName(), now}:
				default: // nobody is measuring yet
				}
			}
			_ = stream.Send(&discovery.DiscoveryRequest{Node: node, TypeUrl: resource.EndpointType, ResourceNames: names,
				VersionInfo: resp.GetVersionInfo(), ResponseNonce: resp.GetNonce()})
		}
	}()
	want := numClusters * numServices * perSlice
	total := func() int {
		countsMu.Lock()
		defer countsMu.Unlock()
		n := 0
		for _, c := range counts {
			n += c
		}
		return n
	}
	deadline := time.Now().Add(10 * time.Minute)
	for total() < want {
		select {
		case err := <-recvErr:
			b.Fatalf("ADS stream ended: %v (pilot log: %s)", err, pilot.log())
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			b.Fatalf("the client has %d of %d endpoints after 10 minutes", total(), want)
		}
	}
	drain := func() {
		for {
			select {
			case <-arrivals:
			default:
				return
			}
		}
	}
	b.Run(fmt.Sprintf("endpoints=%d", total()), func(b *testing.B) {
		var lat, api []time.Duration
		// Three times the registry benchmarks' samples: a p99 of 100
		// samples is nearly the single worst one.
		for i := range 3 * samples {
			c := e.set.Clusters[1+i%(numClusters-1)]
			s := (i * 13) % numServices
			svc := fmt.Sprintf("svc-%d", s)
			es, err := c.Client.DiscoveryV1().EndpointSlices("xds").Get(ctx, svc+"-1", metav1.GetOptions{})
			require.NoError(b, err)
			j := i % len(es.Endpoints)
			ready := es.Endpoints[j].Conditions.Ready == nil || *es.Endpoints[j].Conditions.Ready
			flipped := !ready
			es.Endpoints[j].Conditions = discoveryv1.EndpointConditions{Ready: &flipped}
			time.Sleep(150 * time.Millisecond)
			drain()
			w := openWatch(b, func() (watch.Interface, error) {
				return c.Client.DiscoveryV1().EndpointSlices("xds").Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + svc + "-1", ResourceVersion: es.ResourceVersion})
			})
			start := time.Now()
			_, err = c.Client.DiscoveryV1().EndpointSlices("xds").Update(ctx, es, metav1.UpdateOptions{})
			require.NoError(b, err)
			want := names[s]
			deadline := time.After(30 * time.Second)
			var total, apiserver time.Duration
			for total == 0 || apiserver == 0 {
				select {
				case a := <-arrivals:
					if a.name == want && total == 0 {
						total = a.at.Sub(start)
					}
				case ev := <-w.ResultChan():
					if apiserver == 0 && ev.Object != nil {
						apiserver = time.Since(start)
					}
				case err := <-recvErr:
					b.Fatalf("ADS stream ended: %v", err)
				case <-deadline:
					b.Fatalf("no EDS update for %s", want)
				}
			}
			w.Stop()
			lat, api = append(lat, total), append(api, apiserver)
		}
		reportLatency(b, lat, api)
		rss, peak, file := pilot.rss(b)
		b.ReportMetric(float64(rss)/(1<<20), "pilot-RSS-MiB")
		b.ReportMetric(float64(peak)/(1<<20), "pilot-peak-RSS-MiB")
		// The split of RSS: the binary's pages, the heap, the GC's goal.
		b.ReportMetric(float64(file)/(1<<20), "pilot-RSS-file-MiB")
		b.ReportMetric(pilot.metric(b, "go_memstats_heap_inuse_bytes")/(1<<20), "pilot-heap-inuse-MiB")
		b.ReportMetric(pilot.metric(b, "go_memstats_next_gc_bytes")/(1<<20), "pilot-next-gc-MiB")
		if path := os.Getenv("ISTHMUS_BENCH_PILOT_HEAP"); path != "" {
			// A heap profile of pilot (after a GC), for go tool pprof.
			resp, err := http.Get("http://" + pilot.debugAddr + "/debug/pprof/heap?gc=1")
			require.NoError(b, err)
			prof, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			require.NoError(b, err)
			require.NoError(b, os.WriteFile(path, prof, 0o644))
		}
	})
}

// pilotProcess is cmd/pilot running as its own process on 127.0.61.1.
type pilotProcess struct {
	cmd            *exec.Cmd
	logPath        string
	xdsAddr        string
	monitoringAddr string
	debugAddr      string
}

// startPilotProcess builds cmd/pilot and runs it with default settings on
// config cluster c (plaintext xDS for the benchmark client) on 127.0.61.1;
// it stops when the benchmark ends.
func startPilotProcess(b *testing.B, c *framework.Cluster, ns string) *pilotProcess {
	return startPilotProcessAt(b, c, ns, "127.0.61.1", "")
}

// startPilotProcessAt is startPilotProcess on ip, with cmd/pilot built from
// the module in src (this one when empty).
func startPilotProcessAt(b *testing.B, c *framework.Cluster, ns, ip, src string) *pilotProcess {
	b.Helper()
	dir := b.TempDir()
	bin := filepath.Join(dir, "pilot")
	build := exec.Command("go", "build", "-o", bin, "github.com/isthmus-mesh/isthmus/cmd/pilot")
	build.Dir = src
	if out, err := build.CombinedOutput(); err != nil {
		b.Fatalf("build pilot: %v\n%s", err, out)
	}
	kc := filepath.Join(dir, "kubeconfig")
	require.NoError(b, c.WriteAdminKubeconfig(kc))
	p := &pilotProcess{xdsAddr: ip + ":15010", monitoringAddr: ip + ":15014", debugAddr: ip + ":8080"}
	p.cmd = exec.Command(bin, "--kubeconfig", kc, "--namespace", ns, "--cluster-id", clusterName(0), "--network", "network-0",
		// A real TLS address rather than a disabled one: a baseline pilot built
		// from an older revision spells "disabled" differently.
		"--xds-addr", ip+":15012", "--xds-plaintext-addr", p.xdsAddr, "--monitoring-addr", p.monitoringAddr, "--debug-addr", p.debugAddr,
		"--no-leader-election", "--log-level", "warn")
	// ISTHMUS_BENCH_PILOT_ENV adds "NAME=value" settings (space-separated)
	// to pilot's environment, e.g. GOMEMLIMIT=140MiB.
	p.cmd.Env = append(os.Environ(), strings.Fields(os.Getenv("ISTHMUS_BENCH_PILOT_ENV"))...)
	p.logPath = startServer(b, "pilot", p.cmd, "http://"+p.monitoringAddr+"/readyz")
	return p
}

func (p *pilotProcess) log() string {
	b, _ := os.ReadFile(p.logPath)
	return string(b)
}

// rss returns the process's resident set size now and at its peak.
func (p *pilotProcess) rss(b *testing.B) (now, peak, file int64) {
	b.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.cmd.Process.Pid))
	require.NoError(b, err)
	kb := func(v string) int64 {
		n, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
		require.NoError(b, err)
		return n << 10
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			now = kb(v)
		}
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			peak = kb(v)
		}
		if v, ok := strings.CutPrefix(line, "RssFile:"); ok {
			file = kb(v)
		}
	}
	return now, peak, file
}

// metric reads one unlabelled metric from pilot's /metrics.
func (p *pilotProcess) metric(b *testing.B, name string) float64 {
	return promMetric(b, p.monitoringAddr, name)
}
