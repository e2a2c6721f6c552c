package xds_test

import (
	"context"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	statuspb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/xds"
	"github.com/isthmus-mesh/isthmus/pilot/xds/xdstest"
)

const waitFor = 5 * time.Second

// env is a running Server on 127.0.0.1 with its registry.
type env struct {
	reg     *xdstest.Registry
	srv     *xds.Server
	addr    string
	metrics *prometheus.Registry
}

func testLogger(t testing.TB) *slog.Logger {
	if os.Getenv("XDS_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}

// start runs a Server for reg on a loopback listener until the test ends.
func start(t testing.TB, reg *xdstest.Registry, opts ...grpc.ServerOption) *env {
	t.Helper()
	return startWith(t, reg, xds.Config{AllowPlaintext: true}, opts...)
}

// startWith runs a Server with cfg (its Metrics replaced by a registry of
// the env) for reg on a loopback listener until the test ends.
func startWith(t testing.TB, reg *xdstest.Registry, cfg xds.Config, opts ...grpc.ServerOption) *env {
	t.Helper()
	return startGRPC(t, reg, cfg, append(xds.ServerOptions(), opts...)...)
}

// startGRPC is startWith on a gRPC server built with opts only.
func startGRPC(t testing.TB, reg *xdstest.Registry, cfg xds.Config, opts ...grpc.ServerOption) *env {
	t.Helper()
	pm := prometheus.NewRegistry()
	cfg.Metrics = pm
	srv, err := xds.New(cfg, reg, testLogger(t))
	require.NoError(t, err)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	gs := grpc.NewServer(append([]grpc.ServerOption{grpc.WaitForHandlers(true)}, opts...)...)
	srv.Register(gs)
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan struct{})
	ran := make(chan error, 1)
	go func() {
		defer close(served)
		_ = gs.Serve(lis)
	}()
	go func() { ran <- srv.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-ran)
		gs.Stop()
		<-served
	})
	return &env{reg: reg, srv: srv, addr: lis.Addr().String(), metrics: pm}
}

func dial(t testing.TB, addr string) *grpc.ClientConn {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}

func node(id string, network model.Network, cluster model.ClusterID) *corev3.Node {
	md, _ := structpb.NewStruct(map[string]any{xds.MetadataNetwork: string(network), xds.MetadataClusterID: string(cluster)})
	return &corev3.Node{Id: id, Metadata: md}
}

// deltaClient is a raw delta ADS client that keeps the resources it received.
type deltaClient struct {
	t      testing.TB
	stream discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesClient
	cancel context.CancelFunc
	recv   chan *discovery.DeltaDiscoveryResponse
	done   chan struct{}
	err    error // why the stream ended, once done is closed
	// state is what the client holds: name -> resource version.
	state     map[string]string
	resources map[string]*workloadv1.Address
}

// openDelta opens a delta ADS stream for typeURL and sends the first request.
func openDelta(t testing.TB, cc *grpc.ClientConn, first *discovery.DeltaDiscoveryRequest) *deltaClient {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	stream, err := discovery.NewAggregatedDiscoveryServiceClient(cc).DeltaAggregatedResources(ctx)
	require.NoError(t, err)
	c := &deltaClient{
		t: t, stream: stream, cancel: cancel,
		recv: make(chan *discovery.DeltaDiscoveryResponse, 100), done: make(chan struct{}),
		state: map[string]string{}, resources: map[string]*workloadv1.Address{},
	}
	go func() {
		defer close(c.done)
		for {
			r, err := stream.Recv()
			if err != nil {
				c.err = err
				return
			}
			c.recv <- r
		}
	}()
	require.NoError(t, stream.Send(first))
	t.Cleanup(c.close)
	return c
}

func (c *deltaClient) close() {
	c.cancel()
	<-c.done
}

// next returns the next response, failing the test after waitFor.
func (c *deltaClient) next() *discovery.DeltaDiscoveryResponse {
	c.t.Helper()
	select {
	case r := <-c.recv:
		return r
	case <-time.After(waitFor):
		c.t.Fatalf("no delta response within %s", waitFor)
		return nil
	}
}

// quiet asserts no response arrives within d.
func (c *deltaClient) quiet(d time.Duration) {
	c.t.Helper()
	select {
	case r := <-c.recv:
		c.t.Fatalf("unexpected response: %v", r)
	case <-time.After(d):
	}
}

// apply records a response in the client state and ACKs it.
func (c *deltaClient) apply(r *discovery.DeltaDiscoveryResponse) {
	c.t.Helper()
	for _, res := range r.GetResources() {
		a := &workloadv1.Address{}
		if r.GetTypeUrl() == xds.WorkloadType {
			require.NoError(c.t, res.GetResource().UnmarshalTo(a))
		}
		c.state[res.GetName()] = res.GetVersion()
		c.resources[res.GetName()] = a
	}
	for _, n := range r.GetRemovedResources() {
		delete(c.state, n)
		delete(c.resources, n)
	}
	require.NoError(c.t, c.stream.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: r.GetTypeUrl(), ResponseNonce: r.GetNonce()}))
}

// nack rejects a response.
func (c *deltaClient) nack(r *discovery.DeltaDiscoveryResponse, msg string) {
	c.t.Helper()
	require.NoError(c.t, c.stream.Send(&discovery.DeltaDiscoveryRequest{
		TypeUrl: r.GetTypeUrl(), ResponseNonce: r.GetNonce(), ErrorDetail: &statuspb.Status{Code: 3, Message: msg},
	}))
}

func names(r *discovery.DeltaDiscoveryResponse) []string {
	out := make([]string, 0, len(r.GetResources()))
	for _, res := range r.GetResources() {
		out = append(out, res.GetName())
	}
	return out
}

func wildcard(n *corev3.Node) *discovery.DeltaDiscoveryRequest {
	return &discovery.DeltaDiscoveryRequest{Node: n, TypeUrl: xds.WorkloadType}
}

var (
	tcp80 = []model.Port{{Name: "http", Port: 80, TargetPort: 8080, Protocol: model.TCP}}
	ns    = "default"
)

func ip(s string) netip.Addr { return netip.MustParseAddr(s) }

// publish sets a service and its workloads in one change set.
func publish(reg *xdstest.Registry, svc *model.Service, ws []*model.Workload) {
	reg.Update(func(tx *xdstest.Tx) {
		tx.SetService(svc)
		for _, w := range ws {
			tx.SetWorkload(w)
		}
	})
}

func equalProto(t testing.TB, want, got proto.Message) {
	t.Helper()
	require.True(t, proto.Equal(want, got), "want %v\ngot  %v", want, got)
}

func mapsKeys[V any](m map[string]V) func(func(string) bool) {
	return func(yield func(string) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

type protoMessage = proto.Message

type assertT = assert.CollectT

func assertNotNil(t *assertT, v any) bool { return assert.NotNil(t, v) }

func assertEqual(t *assertT, want, got any) bool { return assert.Equal(t, want, got) }

// typeStatus returns the syncz status of typeURL on node id's stream.
func typeStatus(e *env, id, typeURL string) *xds.TypeStatus {
	for _, cs := range e.srv.Syncz() {
		if cs.NodeID == id {
			return cs.Types[typeURL]
		}
	}
	return nil
}

func clusterStatus(e *env, id string) *xds.TypeStatus {
	return typeStatus(e, id, resource.ClusterType)
}

// counter sums every series of the named metric.
func counter(t testing.TB, e *env, name string) float64 {
	t.Helper()
	mfs, err := e.metrics.Gather()
	require.NoError(t, err)
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return sum
}

func assertNoError(t *assertT, err error) bool { return assert.NoError(t, err) }
