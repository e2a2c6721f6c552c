package xds_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/xds"
	"github.com/isthmus-mesh/isthmus/pilot/xds/xdstest"
)

// Fleet benchmark shape.
const (
	benchSubscribers = 1000
	benchConns       = 20 // gRPC connections the subscribers' streams share
	benchWave        = 50 // subscribers connecting at once
	benchPodsPerSvc  = 100
	benchChanges     = 10 // endpoint changes measured per iteration
)

// frame is a DeltaDiscoveryResponse as the benchmark client sees it: only
// what it needs, parsed off the wire without decoding the resources, so the
// 1,000 in-process clients cost the server's CPU little.
type frame struct {
	size    int
	nonce   string
	typeURL string
	count   int
	names   []string // first resource names (at most 4)
}

// rawCodec marshals requests as protobufs and parses responses into frames.
type rawCodec struct{}

func (rawCodec) Name() string { return "proto" }

func (rawCodec) Marshal(v any) ([]byte, error) { return proto.Marshal(v.(proto.Message)) }

func (rawCodec) Unmarshal(b []byte, v any) error {
	f := v.(*frame)
	*f = frame{size: len(b)}
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		if typ != protowire.BytesType {
			n = protowire.ConsumeFieldValue(num, typ, b)
			if n < 0 {
				return protowire.ParseError(n)
			}
			b = b[n:]
			continue
		}
		val, n := protowire.ConsumeBytes(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		switch num {
		case 2, 6: // resources, removed_resources
			f.count++
			if len(f.names) < 4 {
				f.names = append(f.names, resourceName(num, val))
			}
		case 4:
			f.typeURL = string(val)
		case 5:
			f.nonce = string(val)
		}
	}
	return nil
}

// resourceName returns the name of a Resource (field 3), or a removed name.
func resourceName(num protowire.Number, val []byte) string {
	if num == 6 {
		return string(val)
	}
	for len(val) > 0 {
		fn, typ, n := protowire.ConsumeTag(val)
		if n < 0 {
			return ""
		}
		val = val[n:]
		m := protowire.ConsumeFieldValue(fn, typ, val)
		if m < 0 {
			return ""
		}
		if fn == 3 {
			s, _ := protowire.ConsumeBytes(val)
			return string(s)
		}
		val = val[m:]
	}
	return ""
}

// fleetPhase is what the subscribers currently wait for.
type fleetPhase struct {
	// initial: count every resource until want are in.
	want int
	// change: the name whose arrival is timed.
	name  string
	start time.Time
	lat   []time.Duration
	bytes []int
	got   []atomic.Int64
	wg    sync.WaitGroup
}

// fleet is benchSubscribers delta subscribers on real loopback gRPC streams.
type fleet struct {
	phase  atomic.Pointer[fleetPhase]
	cancel context.CancelFunc
	done   sync.WaitGroup
	// clusters, when set, gives subscriber i the cluster clusters[i%len]
	// (default c1): one class per cluster, all on net1.
	clusters []model.ClusterID
	// typeURL is the type subscribed to (default the workload type).
	typeURL string
}

func (f *fleet) subscribe(b *testing.B, ctx context.Context, cc *grpc.ClientConn, i int) {
	desc := &grpc.StreamDesc{StreamName: "DeltaAggregatedResources", ServerStreams: true, ClientStreams: true}
	s, err := cc.NewStream(ctx, desc, "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources",
		grpc.ForceCodec(rawCodec{}), grpc.MaxCallRecvMsgSize(1<<30))
	if err != nil {
		b.Fatal(err)
	}
	cluster := model.ClusterID("c1")
	if len(f.clusters) > 0 {
		cluster = f.clusters[i%len(f.clusters)]
	}
	first := wildcard(node(fmt.Sprintf("zt-%d", i), "net1", cluster))
	if f.typeURL != "" {
		first.TypeUrl = f.typeURL
	}
	if err := s.SendMsg(first); err != nil {
		b.Fatal(err)
	}
	f.done.Add(1)
	go func() {
		defer f.done.Done()
		for {
			var fr frame
			if err := s.RecvMsg(&fr); err != nil {
				return
			}
			p := f.phase.Load()
			if p.name == "" {
				if p.got[i].Add(int64(fr.count)) >= int64(p.want) && p.got[i].Load()-int64(fr.count) < int64(p.want) {
					p.wg.Done()
				}
			} else if slices.Contains(fr.names, p.name) {
				p.lat[i] = time.Since(p.start)
				p.bytes[i] = fr.size
				p.wg.Done()
			}
			if err := s.SendMsg(&discovery.DeltaDiscoveryRequest{TypeUrl: fr.typeURL, ResponseNonce: fr.nonce}); err != nil {
				return
			}
		}
	}()
}

// fleetRegistry holds endpoints pods in services of benchPodsPerSvc pods.
func fleetRegistry(endpoints int) (*xdstest.Registry, []*model.Service, []*model.Workload) {
	reg := xdstest.New()
	var svcs []*model.Service
	var all []*model.Workload
	for s := 0; s*benchPodsPerSvc < endpoints; s++ {
		pods := make([]*model.Workload, 0, benchPodsPerSvc)
		for p := range benchPodsPerSvc {
			i := s*benchPodsPerSvc + p
			pods = append(pods, xdstest.Pod("c1", "net1", ns, fmt.Sprintf("s%d-p%d", s, p), netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})))
		}
		vip := map[model.ClusterID][]netip.Addr{"c1": {netip.AddrFrom4([4]byte{10, 96, byte(s >> 8), byte(s)})}}
		svc, ws := xdstest.Backing(fmt.Sprintf("s%d", s), ns, tcp80, vip, pods...)
		publish(reg, svc, ws)
		svcs = append(svcs, svc)
		all = append(all, ws...)
	}
	return reg, svcs, all
}

// heapMB is the live heap after two GCs: the second drops what sync.Pools
// (gRPC's message buffers among them) only cached.
func heapMB() float64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return float64(ms.HeapAlloc) / (1 << 20)
}

func pct(d []time.Duration, p float64) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[min(len(s)-1, int(float64(len(s))*p))]
}

// BenchmarkDeltaFleet measures, for 1,000 wildcard delta subscribers on
// loopback gRPC and two state sizes: the initial push (time, server heap
// held afterwards), then benchChanges single-endpoint changes: per
// subscriber delivery latency (p50/p99), time until all have it (p50/p99),
// and the bytes each subscriber receives for one change.
// Run: go test -run '^$' -bench BenchmarkDeltaFleet -benchtime 1x ./pilot/xds/
func BenchmarkDeltaFleet(b *testing.B) {
	for _, endpoints := range []int{5000, 50000} {
		b.Run(fmt.Sprintf("endpoints=%d", endpoints), func(b *testing.B) {
			for range b.N {
				runFleet(b, endpoints)
			}
		})
	}
}

func runFleet(b *testing.B, endpoints int) {
	runFleetOf(b, endpoints, benchSubscribers, xds.WorkloadType)
}

// runFleetOf is runFleet with subscribers subscribers of typeURL (the
// workload type, or Istio's).
func runFleetOf(b *testing.B, endpoints, subscribers int, typeURL string) {
	reg, svcs, pods := fleetRegistry(endpoints)
	base := heapMB()
	e := start(b, reg)
	conns := make([]*grpc.ClientConn, benchConns)
	for i := range conns {
		cc, err := grpc.NewClient(e.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			b.Fatal(err)
		}
		conns[i] = cc
	}
	ctx, cancel := context.WithCancel(context.Background())
	f := &fleet{cancel: cancel, typeURL: typeURL}
	defer func() {
		cancel()
		f.done.Wait()
		for _, cc := range conns {
			_ = cc.Close()
		}
	}()

	want := len(pods) + len(svcs)
	first := &fleetPhase{want: want, got: make([]atomic.Int64, subscribers)}
	f.phase.Store(first)
	t0, c0 := time.Now(), cpuTime()
	for w := 0; w < subscribers; w += benchWave {
		first.wg.Add(benchWave)
		for i := w; i < w+benchWave; i++ {
			f.subscribe(b, ctx, conns[i%benchConns], i)
		}
		if err := waitTimeout(&first.wg, 5*time.Minute); err != nil {
			b.Fatal("initial push:", err)
		}
	}
	initial, initialCPU := time.Since(t0), cpuTime()-c0
	held := heapMB() - base
	c1 := cpuTime()

	var lat, all []time.Duration
	var bytes []int
	for k := range benchChanges {
		p := &fleetPhase{lat: make([]time.Duration, subscribers), bytes: make([]int, subscribers)}
		s := *svcs[k%len(svcs)]
		shard := slices.Clone(s.Shards["c1"])
		w := *reg.Workload(shard[0].WorkloadUID())
		w.Ready = !w.Ready
		shard[0].Workload = &w
		s.Shards = map[model.ClusterID][]model.Endpoint{"c1": shard}
		p.name = w.UID
		if typeURL == xds.IstioAddressType {
			p.name = xds.IstioWorkloadUID(w.UID)
		}
		p.wg.Add(subscribers)
		f.phase.Store(p)
		p.start = time.Now()
		reg.Update(func(tx *xdstest.Tx) {
			tx.SetWorkload(&w)
			tx.SetService(&s)
		})
		if err := waitTimeout(&p.wg, time.Minute); err != nil {
			b.Fatal("change:", err)
		}
		all = append(all, time.Since(p.start))
		lat = append(lat, p.lat...)
		bytes = append(bytes, p.bytes...)
	}
	changeCPU := (cpuTime() - c1) / benchChanges
	b.ReportMetric(initial.Seconds(), "initial_push_s")
	b.ReportMetric(initialCPU.Seconds(), "initial_cpu_s")
	b.ReportMetric(float64(changeCPU.Microseconds())/1000, "change_cpu_ms")
	b.ReportMetric(held, "heap_MB")
	b.ReportMetric(float64(pct(lat, 0.5).Microseconds())/1000, "sub_p50_ms")
	b.ReportMetric(float64(pct(lat, 0.99).Microseconds())/1000, "sub_p99_ms")
	b.ReportMetric(float64(pct(all, 0.5).Microseconds())/1000, "all_p50_ms")
	b.ReportMetric(float64(pct(all, 0.99).Microseconds())/1000, "all_p99_ms")
	b.ReportMetric(float64(slices.Max(bytes)), "change_bytes/sub")
	b.ReportMetric(float64(want), "resources/sub")
}

// cpuTime is the CPU time (user+system) the process has used.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func waitTimeout(wg *sync.WaitGroup, d time.Duration) error {
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-time.After(d):
		return errors.New("timed out")
	}
}

// BenchmarkClassBuild measures building the resources of one class (network
// and cluster) for 50,000 endpoints when its first client connects: time to
// the first response, and heap held by the server with that one client.
// classes=2 adds a client of a second cluster on the same network: the
// second class sees the same resources.
// Run: go test -run '^$' -bench BenchmarkClassBuild -benchtime 1x ./pilot/xds/
func BenchmarkClassBuild(b *testing.B) {
	for _, classes := range []int{1, 2} {
		b.Run(fmt.Sprint("classes=", classes), func(b *testing.B) {
			for range b.N {
				classBuild(b, classes)
			}
		})
	}
}

func classBuild(b *testing.B, classes int) {
	reg, svcs, pods := fleetRegistry(50000)
	base := heapMB()
	e := start(b, reg)
	cc, err := grpc.NewClient(e.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	f := &fleet{cancel: cancel}
	for c := range classes {
		f.clusters = append(f.clusters, model.ClusterID(fmt.Sprint("c", c+1)))
	}
	p := &fleetPhase{want: len(pods) + len(svcs), got: make([]atomic.Int64, classes)}
	p.wg.Add(classes)
	f.phase.Store(p)
	t0 := time.Now()
	for i := range classes {
		f.subscribe(b, ctx, cc, i)
	}
	if err := waitTimeout(&p.wg, 5*time.Minute); err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(time.Since(t0).Seconds(), "first_push_s")
	held := heapMB() - base
	b.ReportMetric(held, "heap_MB")
	b.ReportMetric(held*(1<<20)/float64(len(pods)), "heap_B/endpoint")
	cancel()
	f.done.Wait()
	_ = cc.Close()
}

// BenchmarkIstioTypeUpdate compares, in one run, the update latency of
// Istio's workload type (istio.workload.Address, encoded from the same
// view) with Isthmus's own, for 200 wildcard delta subscribers and 5,000
// endpoints: the same fleet and changes as BenchmarkDeltaFleet.
// Run: go test -run '^$' -bench BenchmarkIstioTypeUpdate -benchtime 1x ./pilot/xds/
func BenchmarkIstioTypeUpdate(b *testing.B) {
	for _, t := range []struct{ name, url string }{{"isthmus", xds.WorkloadType}, {"istio", xds.IstioAddressType}} {
		b.Run("type="+t.name, func(b *testing.B) {
			for range b.N {
				runFleetOf(b, 5000, 200, t.url)
			}
		})
	}
}
