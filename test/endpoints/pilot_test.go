package endpoints_test

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/registry"
	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/pilot/xds"
)

// network is the one network of every cluster here: addresses of all three
// compete, and EDS lists every endpoint directly.
const network = "network-1"

var clusterIDs = []string{"cluster-1", "cluster-2", "cluster-3"}

// registerRemotes creates control-plane namespace cp in cluster-1 and the
// remote secrets of cluster-2 and cluster-3 in it.
func registerRemotes(t testing.TB, cp string) {
	t.Helper()
	ctx := context.Background()
	c1 := clusters.Cluster("cluster-1")
	require.NoError(t, c1.EnsureNamespace(ctx, cp, nil))
	for _, id := range clusterIDs[1:] {
		kc, err := clusters.Cluster(id).ReaderKubeconfig(ctx, id, remotesecret.ReaderOptions{Namespace: cp})
		require.NoError(t, err)
		sec := remotesecret.Secret(id, cp, kc)
		sec.Annotations[remotesecret.NetworkAnnotation] = network
		_, err = c1.Client.CoreV1().Secrets(cp).Create(ctx, sec, metav1.CreateOptions{})
		require.NoError(t, err)
	}
}

// pilot is a running pilot on cluster-1 (control-plane namespace cp) with
// cluster-2 and cluster-3 registered, and xDS clients of network-1 in
// cluster-1 watching every endpoint (EDS) and every workload.
type pilot struct {
	*server.Server
	cancel    context.CancelFunc
	done      chan error
	eds, wds  *watcher
	stopOnce  sync.Once
	stopError error
}

func testLogger() *slog.Logger {
	level := slog.LevelError
	if os.Getenv("ENDPOINTS_TEST_LOG") != "" {
		level = slog.LevelDebug
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
}

// startPilot runs pilot until the test ends (or stop), once every cluster
// (but those in down, whose API servers are stopped) has synced and its
// xDS clients hold their first responses.
func startPilot(t testing.TB, cp string, down ...string) *pilot {
	t.Helper()
	cfg := server.Config{
		Namespace: cp, ClusterID: "cluster-1", Network: network, NoLeaderElection: true,
		DebugAddr: defaults.Disabled, MonitoringAddr: defaults.Disabled, GRPCAddr: defaults.Disabled, XDSPlaintextAddr: "127.0.0.1:0",
		Registry: registry.Config{QuietPeriod: 20 * time.Millisecond, MaxDelay: 200 * time.Millisecond},
		Multicluster: multicluster.Config{
			LivenessInterval: 200 * time.Millisecond, LivenessTimeout: time.Second, UnreachableAfter: 2, RetryBackoff: 200 * time.Millisecond,
		},
		Logger: testLogger(),
	}
	srv, err := server.New(cfg, clusters.Cluster("cluster-1").Config, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	p := &pilot{Server: srv, cancel: cancel, done: make(chan error, 1)}
	go func() { p.done <- srv.Run(ctx) }()
	t.Cleanup(func() { require.NoError(t, p.stop()) })
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		for _, id := range clusterIDs {
			require.True(c, slices.Contains(down, id) || srv.Registry.HasCluster(id), "cluster %s synced", id)
		}
		require.NotEmpty(c, srv.XDSPlaintextAddr())
	}, 2*time.Minute, 20*time.Millisecond)
	p.eds = watch(t, srv.XDSPlaintextAddr(), resource.EndpointType)
	p.wds = watch(t, srv.XDSPlaintextAddr(), xds.WorkloadType)
	return p
}

// stop ends pilot and its clients; it is idempotent.
func (p *pilot) stop() error {
	p.stopOnce.Do(func() {
		p.eds.close()
		p.wds.close()
		p.cancel()
		select {
		case p.stopError = <-p.done:
		case <-time.After(30 * time.Second):
			p.stopError = errors.New("pilot did not stop")
		}
	})
	return p.stopError
}

// watcher is a delta ADS client that subscribes to every resource of one
// type (wildcard) and keeps what it holds, ACKing each response.
type watcher struct {
	typeURL string
	cc      *grpc.ClientConn
	cancel  context.CancelFunc
	done    chan struct{}

	mu        sync.Mutex
	resources map[string][]byte // name -> encoded resource
	responses int
	err       error
}

func watch(t testing.TB, addr, typeURL string) *watcher {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	stream, err := discovery.NewAggregatedDiscoveryServiceClient(cc).DeltaAggregatedResources(ctx)
	require.NoError(t, err)
	md, err := structpb.NewStruct(map[string]any{xds.MetadataNetwork: network, xds.MetadataClusterID: "cluster-1"})
	require.NoError(t, err)
	require.NoError(t, stream.Send(&discovery.DeltaDiscoveryRequest{
		Node: &corev3.Node{Id: "endpoints-test~" + typeURL, Metadata: md}, TypeUrl: typeURL,
	}))
	w := &watcher{typeURL: typeURL, cc: cc, cancel: cancel, done: make(chan struct{}), resources: map[string][]byte{}}
	go w.run(stream)
	t.Cleanup(w.close)
	require.Eventually(t, func() bool { return w.received() > 0 }, time.Minute, 10*time.Millisecond, "first %s response", typeURL)
	return w
}

func (w *watcher) run(stream discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesClient) {
	defer close(w.done)
	for {
		r, err := stream.Recv()
		if err != nil {
			w.mu.Lock()
			w.err = err
			w.mu.Unlock()
			return
		}
		w.mu.Lock()
		for _, res := range r.GetResources() {
			w.resources[res.GetName()] = res.GetResource().GetValue()
		}
		for _, name := range r.GetRemovedResources() {
			delete(w.resources, name)
		}
		w.responses++
		w.mu.Unlock()
		if err := stream.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: w.typeURL, ResponseNonce: r.GetNonce()}); err != nil {
			w.mu.Lock()
			w.err = err
			w.mu.Unlock()
			return
		}
	}
}

func (w *watcher) received() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.responses
}

func (w *watcher) close() {
	w.cancel()
	<-w.done
	_ = w.cc.Close()
}

// held returns a copy of what the client holds, and the error that ended
// its stream (nil while it runs).
func (w *watcher) held() (map[string][]byte, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make(map[string][]byte, len(w.resources))
	for k, v := range w.resources {
		out[k] = v
	}
	select {
	case <-w.done:
		return out, w.err
	default:
		return out, nil
	}
}

// loadAssignments returns the ClusterLoadAssignments the EDS client holds.
func (p *pilot) loadAssignments(c *assert.CollectT) map[string]*endpointv3.ClusterLoadAssignment {
	held, err := p.eds.held()
	require.NoError(c, err)
	out := make(map[string]*endpointv3.ClusterLoadAssignment, len(held))
	for name, b := range held {
		cla := &endpointv3.ClusterLoadAssignment{}
		require.NoError(c, proto.Unmarshal(b, cla))
		out[name] = cla
	}
	return out
}

// workloads returns the workloads the workload discovery client holds (not
// the services), by name.
func (p *pilot) workloads(c *assert.CollectT) map[string]*workloadv1.Workload {
	held, err := p.wds.held()
	require.NoError(c, err)
	out := map[string]*workloadv1.Workload{}
	for name, b := range held {
		a := &workloadv1.Address{}
		require.NoError(c, proto.Unmarshal(b, a))
		if w := a.GetWorkload(); w != nil {
			out[name] = w
		}
	}
	return out
}

// edsHealth returns, for cluster name's load assignment, each endpoint
// "address:port" with its health, or nil when the client holds none.
func (p *pilot) edsHealth(c *assert.CollectT, name string) map[string]corev3.HealthStatus {
	cla := p.loadAssignments(c)[name]
	if cla == nil {
		return nil
	}
	out := map[string]corev3.HealthStatus{}
	for _, l := range cla.GetEndpoints() {
		for _, e := range l.GetLbEndpoints() {
			sa := e.GetEndpoint().GetAddress().GetSocketAddress()
			out[sa.GetAddress()+":"+itoa(sa.GetPortValue())] = e.GetHealthStatus()
		}
	}
	return out
}

// workloadsAt returns the UIDs of the workloads the client holds that carry
// address addr.
func (p *pilot) workloadsAt(c *assert.CollectT, addr string) []string {
	var out []string
	for name, w := range p.workloads(c) {
		for _, a := range w.GetAddresses() {
			if ipString(a) == addr {
				out = append(out, name)
			}
		}
	}
	return out
}

// endpointView is what the registry's /debug/endpointz says of the
// endpoint of service host at addr in cluster (nil: none).
func (p *pilot) endpointView(host string, cluster model.ClusterID, addr string) *registry.EndpointView {
	eps, _ := p.Registry.EndpointsOf(host)
	for i := range eps {
		if eps[i].Cluster == cluster && eps[i].Address == addr {
			return &eps[i]
		}
	}
	return nil
}
