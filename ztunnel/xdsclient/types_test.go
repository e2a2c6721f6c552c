package xdsclient_test

import (
	"context"
	"log/slog"
	"net"
	"sync"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"

	securityv1 "github.com/isthmus-mesh/isthmus/pilot/api/security/v1"
	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
	"github.com/isthmus-mesh/isthmus/ztunnel/authz"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
	"github.com/isthmus-mesh/isthmus/ztunnel/xdsclient"
)

// TestSecondType proves a TypeHandler gets its type on the workload
// stream: subscribed wildcard, applied as a whole, rejected resources
// NACKed under that type, and resumed with the handler's versions after a
// reconnect.
func TestSecondType(t *testing.T) {
	wls := cache.NewLinearCache(workloadv1.TypeURL, cache.WithInitialResources(map[string]types.Resource{
		"c1/default/a": wl("c1/default/a", "127.0.0.10", "node-a"),
	}))
	good := &securityv1.Authorization{Kind: &securityv1.Authorization_Workload{Workload: &securityv1.WorkloadPolicies{Uid: "c1/default/a", Namespace: "default"}}}
	bad := &securityv1.Authorization{Kind: &securityv1.Authorization_Policy{Policy: &securityv1.Policy{Name: "p", Namespace: "default",
		Rules: []*securityv1.Rule{{Clauses: []*securityv1.Clause{{Matches: []*securityv1.Match{{DestinationPorts: []uint32{0}}}}}}}}}}
	pols := cache.NewLinearCache(securityv1.TypeURL, cache.WithInitialResources(map[string]types.Resource{
		"workload/c1/default/a": good, "policy/default/p": bad,
	}))
	mux := &cache.MuxCache{
		Classify:      func(r *cache.Request) string { return r.GetTypeUrl() },
		ClassifyDelta: func(r *cache.DeltaRequest) string { return r.GetTypeUrl() },
		Caches:        map[string]cache.Cache{workloadv1.TypeURL: wls, securityv1.TypeURL: pols},
	}
	var mu sync.Mutex
	var reqs []*discovery.DeltaDiscoveryRequest
	serve := func(addr string) (string, func()) {
		lis, err := net.Listen("tcp", addr)
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(context.Background())
		srv := grpc.NewServer()
		discovery.RegisterAggregatedDiscoveryServiceServer(srv, serverv3.NewServer(ctx, mux, serverv3.CallbackFuncs{
			StreamDeltaRequestFunc: func(_ int64, r *discovery.DeltaDiscoveryRequest) error {
				mu.Lock()
				reqs = append(reqs, proto.Clone(r).(*discovery.DeltaDiscoveryRequest))
				mu.Unlock()
				return nil
			},
		}))
		done := make(chan struct{})
		go func() { defer close(done); _ = srv.Serve(lis) }()
		return lis.Addr().String(), func() { cancel(); srv.Stop(); <-done }
	}
	addr, stop := serve("127.0.0.1:0")
	defer func() { stop() }()

	as := authz.NewStore()
	c, err := xdsclient.New(xdsclient.Config{Address: addr, NodeID: "zt", NodeName: "node-a", ClusterID: "c1", Network: "n1",
		InitialBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond},
		xdsclient.Deps{Store: state.NewStore(), Credentials: insecure.NewCredentials(), Types: []xdsclient.TypeHandler{as},
			Log: slog.New(slog.NewTextHandler(t.Output(), nil))})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() { cancel(); require.NoError(t, <-done) }()

	require.Eventually(t, func() bool { return as.Synced() && c.HasSynced() }, 10*time.Second, 5*time.Millisecond)
	require.True(t, as.Load().Known("c1/default/a"))
	nack := func() *discovery.DeltaDiscoveryRequest {
		mu.Lock()
		defer mu.Unlock()
		for _, r := range reqs {
			if r.GetTypeUrl() == securityv1.TypeURL && r.GetErrorDetail() != nil {
				return r
			}
		}
		return nil
	}
	require.Eventually(t, func() bool { return nack() != nil }, 10*time.Second, 5*time.Millisecond)
	require.Contains(t, nack().GetErrorDetail().GetMessage(), `resource "policy/default/p"`)
	held := as.Versions()
	require.Len(t, held, 1)

	// Reconnect: the handler's versions open its subscription again.
	stop()
	require.Eventually(t, func() bool { return !c.Connected() }, 5*time.Second, 5*time.Millisecond)
	mu.Lock()
	reqs = nil
	mu.Unlock()
	_, stop = serve(addr)
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, r := range reqs {
			if r.GetTypeUrl() == securityv1.TypeURL && r.GetNode() != nil {
				require.Equal(t, []string{xdsclient.Wildcard}, r.GetResourceNamesSubscribe())
				require.Equal(t, held, r.GetInitialResourceVersions())
				return true
			}
		}
		return false
	}, 10*time.Second, 5*time.Millisecond)
}
