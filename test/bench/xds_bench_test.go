package bench_test

import (
	"context"
	"fmt"
	"net/netip"
	"os"
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
// services spread over 10 real clusters, served by an in-process pilot; an
// isolated EndpointSlice write in a remote cluster -> the EDS update at a
// subscribed SotW ADS client (default debounce settings). Also reports the
// whole test process's RSS, an upper bound of pilot's (the process also
// holds the benchmark's own clients).
func BenchmarkXDSEndpointSliceToEDS(b *testing.B) {
	perSlice := 100 // per cluster and service: 10 x 100 x 100 = 100,000
	if v, err := strconv.Atoi(os.Getenv("ISTHMUS_BENCH_PER_SLICE")); err == nil {
		perSlice = v // smaller runs while developing
	}
	e := startEnv(b)
	defer e.stop(b)
	e.startPilotWith(b, "127.0.0.1:0", true) // one network: every endpoint is served directly
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
	require.Eventually(b, func() bool { return endpoints(e.pilot) >= numClusters*numServices*perSlice }, 10*time.Minute, 100*time.Millisecond)

	require.Eventually(b, func() bool { return e.pilot.XDSPlaintextAddr() != "" }, time.Minute, 10*time.Millisecond)
	conn, err := grpc.NewClient(e.pilot.XDSPlaintextAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()),
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

	// A reader goroutine ACKs every response and reports when each cluster
	// name last arrived with a changed endpoint count of healthy endpoints.
	type arrival struct {
		name string
		at   time.Time
	}
	arrivals := make(chan arrival, 1024)
	initial := make(chan int, 1)
	recvErr := make(chan error, 1)
	go func() {
		first := true
		for {
			resp, err := stream.Recv()
			if err != nil {
				recvErr <- err
				return
			}
			now := time.Now()
			for _, r := range resp.GetResources() {
				cla := &endpointv3.ClusterLoadAssignment{}
				if r.UnmarshalTo(cla) == nil {
					arrivals <- arrival{cla.GetClusterName(), now}
				}
			}
			if first {
				initial <- len(resp.GetResources())
				first = false
			}
			_ = stream.Send(&discovery.DiscoveryRequest{Node: node, TypeUrl: resource.EndpointType, ResourceNames: names,
				VersionInfo: resp.GetVersionInfo(), ResponseNonce: resp.GetNonce()})
		}
	}()
	select {
	case n := <-initial:
		require.Equal(b, numServices, n, "initial EDS response holds every subscribed cluster")
	case <-time.After(time.Minute):
		b.Fatal("no initial EDS response")
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
	b.Run(fmt.Sprintf("endpoints=%d", endpoints(e.pilot)), func(b *testing.B) {
		var lat, api []time.Duration
		for i := range samples {
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
		b.ReportMetric(float64(heapAfterGC())/(1<<20), "heap-MiB")
		b.ReportMetric(float64(rssBytes())/(1<<20), "process-RSS-MiB")
	})
}

func rssBytes() int64 {
	data, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb << 10
		}
	}
	return 0
}
