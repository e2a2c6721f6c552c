package xdsclient_test

import (
	"context"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"

	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
	"github.com/isthmus-mesh/isthmus/ztunnel/xdsclient"
)

// xdsServer is a real go-control-plane delta ADS server over a LinearCache,
// recording what it receives and sends.
type xdsServer struct {
	t      *testing.T
	cache  *cache.LinearCache
	addr   string
	srv    *grpc.Server
	cancel context.CancelFunc
	done   chan struct{}

	mu       sync.Mutex
	gen      int64 // server generation: stream ids restart with each listen
	requests []*discovery.DeltaDiscoveryRequest
	sent     map[int64]map[string]int // gen<<32|stream -> resource name -> times sent
}

// startXDS serves c on addr ("127.0.0.1:0" for a fresh port).
func startXDS(t *testing.T, c *cache.LinearCache, addr string) *xdsServer {
	t.Helper()
	s := &xdsServer{t: t, cache: c, sent: map[int64]map[string]int{}}
	s.listen(addr)
	t.Cleanup(s.stop)
	return s
}

func (s *xdsServer) listen(addr string) {
	lis, err := net.Listen("tcp", addr)
	require.NoError(s.t, err)
	s.addr = lis.Addr().String()
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	s.mu.Lock()
	s.gen++
	gen := s.gen
	s.mu.Unlock()
	cb := serverv3.CallbackFuncs{
		StreamDeltaRequestFunc: func(_ int64, req *discovery.DeltaDiscoveryRequest) error {
			s.mu.Lock()
			s.requests = append(s.requests, proto.Clone(req).(*discovery.DeltaDiscoveryRequest))
			s.mu.Unlock()
			return nil
		},
		StreamDeltaResponseFunc: func(id int64, _ *discovery.DeltaDiscoveryRequest, resp *discovery.DeltaDiscoveryResponse) {
			s.mu.Lock()
			defer s.mu.Unlock()
			key := gen<<32 | id
			if s.sent[key] == nil {
				s.sent[key] = map[string]int{}
			}
			for _, r := range resp.GetResources() {
				s.sent[key][r.GetName()]++
			}
		},
	}
	s.srv = grpc.NewServer()
	discovery.RegisterAggregatedDiscoveryServiceServer(s.srv, serverv3.NewServer(ctx, s.cache, cb))
	s.done = make(chan struct{})
	go func() {
		defer close(s.done)
		_ = s.srv.Serve(lis)
	}()
}

// stop ends every stream and the listener; idempotent.
func (s *xdsServer) stop() {
	if s.srv == nil {
		return
	}
	s.cancel()
	s.srv.Stop()
	<-s.done
	s.srv = nil
}

// restart serves again on the same address.
func (s *xdsServer) restart() { s.listen(s.addr) }

func (s *xdsServer) allRequests() []*discovery.DeltaDiscoveryRequest {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*discovery.DeltaDiscoveryRequest(nil), s.requests...)
}

// lastStreamSent returns resource name -> times sent on the newest stream.
func (s *xdsServer) lastStreamSent() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	var last int64
	for id := range s.sent {
		last = max(last, id)
	}
	out := map[string]int{}
	for k, v := range s.sent[last] {
		out[k] = v
	}
	return out
}

// initialRequests returns the requests that opened a stream (they carry the node).
func (s *xdsServer) initialRequests() []*discovery.DeltaDiscoveryRequest {
	var out []*discovery.DeltaDiscoveryRequest
	for _, r := range s.allRequests() {
		if r.GetNode() != nil {
			out = append(out, r)
		}
	}
	return out
}

// --- resources ---

const (
	td       = "cluster.local"
	echoHost = "echo.default.svc.cluster.local"
	echoKey  = "default/" + echoHost
)

func addrB(s string) []byte { return netip.MustParseAddr(s).AsSlice() }

func wl(uid, ip, node string) *workloadv1.Address {
	return &workloadv1.Address{Type: &workloadv1.Address_Workload{Workload: &workloadv1.Workload{
		Uid: uid, Name: uid, Namespace: "default", Addresses: [][]byte{addrB(ip)},
		Network: "n1", ClusterId: "c1", Node: node, TrustDomain: td, ServiceAccount: "echo",
		TunnelProtocol: workloadv1.TunnelProtocol_HBONE,
		Services: map[string]*workloadv1.PortList{
			echoKey: {Ports: []*workloadv1.Port{{ServicePort: 80, TargetPort: 8080}}},
		},
	}}}
}

func split(network, gw string) *workloadv1.Address {
	return &workloadv1.Address{Type: &workloadv1.Address_Workload{Workload: &workloadv1.Workload{
		Uid:  workloadv1.SplitHorizonUIDPrefix + network + "/default/" + echoHost,
		Name: echoHost, Namespace: "default", Network: network, TrustDomain: td, ServiceAccount: "echo",
		TunnelProtocol: workloadv1.TunnelProtocol_HBONE, Capacity: 3,
		Identities: []string{"spiffe://" + td + "/ns/default/sa/echo"},
		NetworkGateways: []*workloadv1.GatewayAddress{{
			Destination: &workloadv1.GatewayAddress_Address{Address: addrB(gw)}, HboneMtlsPort: 15008,
			Identities: []string{"spiffe://" + td + "/ns/isthmus-system/sa/eastwest"},
		}},
		Services: map[string]*workloadv1.PortList{
			echoKey: {Ports: []*workloadv1.Port{{ServicePort: 80, TargetPort: 8080}}},
		},
	}}}
}

func svc(vips ...*workloadv1.NetworkAddress) *workloadv1.Address {
	return &workloadv1.Address{Type: &workloadv1.Address_Service{Service: &workloadv1.Service{
		Name: "echo", Namespace: "default", Hostname: echoHost, Addresses: vips,
		Ports: []*workloadv1.ServicePort{{ServicePort: 80}},
	}}}
}

func splitName(network string) string {
	return workloadv1.SplitHorizonUIDPrefix + network + "/default/" + echoHost
}

func newCache(res map[string]types.Resource) *cache.LinearCache {
	return cache.NewLinearCache(workloadv1.TypeURL, cache.WithInitialResources(res))
}

// client runs an xdsclient against addr until the test ends.
func client(t *testing.T, addr string, tweak func(*xdsclient.Config)) (*xdsclient.Client, *state.Store) {
	t.Helper()
	c, store, cancel := clientWith(t, addr, tweak, nil)
	t.Cleanup(cancel)
	return c, store
}

// clientWith is client with its metrics on reg (nil: none); stop ends Run
// and closes the client, once (the test's cleanup does not).
func clientWith(t *testing.T, addr string, tweak func(*xdsclient.Config), reg prometheus.Registerer) (_ *xdsclient.Client, _ *state.Store, stop func()) {
	t.Helper()
	store := state.NewStore()
	cfg := xdsclient.Config{
		Address: addr, NodeID: "ztunnel~node-a", NodeName: "node-a", ClusterID: "c1", Network: "n1",
		InitialBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond,
	}
	if tweak != nil {
		tweak(&cfg)
	}
	c, err := xdsclient.New(cfg, xdsclient.Deps{
		Store: store, Credentials: insecure.NewCredentials(),
		Log:        slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug})),
		Registerer: reg,
	})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var once sync.Once
	return c, store, func() {
		once.Do(func() {
			cancel()
			require.NoError(t, <-done)
			require.NoError(t, c.Close())
		})
	}
}

// eventually waits for cond on the store's snapshot.
func eventually(t *testing.T, store *state.Store, cond func(c *assert.CollectT, s *state.Snapshot)) {
	t.Helper()
	require.EventuallyWithT(t, func(c *assert.CollectT) { cond(c, store.Load()) }, 10*time.Second, 5*time.Millisecond)
}
