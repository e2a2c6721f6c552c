package xds

// This file pins the behaviour of the delta server that typecache.go and
// sotw.go rely on: pilot's own (deltaserver.go), and go-control-plane's,
// which pilot's follows. If either changes it, these tests fail before the
// caches silently misbehave; see the comments of those files.

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"
	"unsafe"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// recordingCache answers every delta watch at once with an empty response
// and records the subscription each request came with. (SotW streams are
// pilot's own, sotwserver.go.)
type recordingCache struct {
	mu        sync.Mutex
	delta     []map[string]string // ReturnedResources of each delta request, copied
	deltaSubs []cache.Subscription
}

func (c *recordingCache) CreateWatch(*cache.Request, cache.Subscription, chan cache.Response) (func(), error) {
	return nil, context.Canceled
}

func (c *recordingCache) CreateDeltaWatch(req *cache.DeltaRequest, sub cache.Subscription, ch chan cache.DeltaResponse) (func(), error) {
	c.mu.Lock()
	known := map[string]string{}
	for k, v := range sub.ReturnedResources() {
		known[k] = v
	}
	c.delta = append(c.delta, known)
	c.deltaSubs = append(c.deltaSubs, sub)
	c.mu.Unlock()
	ch <- &cache.DeltaPassthroughResponse{DeltaRequest: req, NextVersionMap: map[string]string{},
		DeltaDiscoveryResponse: &discovery.DeltaDiscoveryResponse{TypeUrl: req.GetTypeUrl(), SystemVersionInfo: "v1"}}
	return func() {}, nil
}

func (c *recordingCache) Fetch(context.Context, *cache.Request) (cache.Response, error) {
	return nil, context.Canceled
}

func (c *recordingCache) waitFor(t *testing.T, delta int) {
	t.Helper()
	require.Eventually(t, func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		return len(c.delta) >= delta
	}, 10*time.Second, 5*time.Millisecond)
}

// deltaServers are the delta servers the contract holds for: pilot's own,
// and go-control-plane's, which pilot's follows.
var deltaServers = []string{"pilot", "go-control-plane"}

// pilotDelta serves pilot's delta streams alone.
type pilotDelta struct {
	discovery.UnimplementedAggregatedDiscoveryServiceServer
	x *deltaServer
}

func (p pilotDelta) DeltaAggregatedResources(st deltaStreamServer) error {
	return p.x.serve(st, resource.AnyType)
}

func serveRecording(t *testing.T, server string, c *recordingCache) discovery.AggregatedDiscoveryServiceClient {
	t.Helper()
	return serveRecordingWith(t, server, c, serverv3.CallbackFuncs{})
}

func serveRecordingWith(t *testing.T, server string, c *recordingCache, cb serverv3.Callbacks) discovery.AggregatedDiscoveryServiceClient {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	srv := grpc.NewServer()
	if server == "pilot" {
		discovery.RegisterAggregatedDiscoveryServiceServer(srv, pilotDelta{x: &deltaServer{ctx: ctx, watcher: c, callbacks: cb, subs: newSubscriptions()}})
	} else {
		discovery.RegisterAggregatedDiscoveryServiceServer(srv, serverv3.NewServer(ctx, c, cb))
	}
	go func() { _ = srv.Serve(ln) }()
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = conn.Close()
		cancel()
		srv.Stop()
	})
	return discovery.NewAggregatedDiscoveryServiceClient(conn)
}

// TestContractDeltaMarksFreshAnswers pins what typecache.go reads from a
// delta subscription's returned resources: the first request's
// initial_resource_versions; after a response with an empty NextVersionMap,
// nothing, except a name that a wildcard stream explicitly subscribed and
// now unsubscribes, marked with an empty version for a fresh answer.
func TestContractDeltaMarksFreshAnswers(t *testing.T) {
	for _, server := range deltaServers {
		t.Run(server, func(t *testing.T) {
			c := &recordingCache{}
			ads := serveRecording(t, server, c)
			st, err := ads.DeltaAggregatedResources(t.Context())
			require.NoError(t, err)
			send := func(req *discovery.DeltaDiscoveryRequest) {
				req.TypeUrl = resource.EndpointType
				require.NoError(t, st.Send(req))
				_, err := st.Recv()
				require.NoError(t, err)
			}
			send(&discovery.DeltaDiscoveryRequest{ResourceNamesSubscribe: []string{"*", "a", "b"},
				InitialResourceVersions: map[string]string{"a": "1", "b": "2"}})
			c.waitFor(t, 1)
			send(&discovery.DeltaDiscoveryRequest{ResourceNamesUnsubscribe: []string{"a"}})
			c.waitFor(t, 2)
			send(&discovery.DeltaDiscoveryRequest{ResourceNamesUnsubscribe: []string{"*"}})
			c.waitFor(t, 3)
			send(&discovery.DeltaDiscoveryRequest{ResourceNamesUnsubscribe: []string{"b"}})
			c.waitFor(t, 4)
			c.mu.Lock()
			defer c.mu.Unlock()
			require.Equal(t, map[string]string{"a": "1", "b": "2"}, c.delta[0], "the first request: the client's versions")
			require.Equal(t, map[string]string{"a": ""}, c.delta[1], "wildcard and explicitly subscribed: marked for a fresh answer")
			require.Empty(t, c.delta[2], "leaving wildcard marks nothing")
			require.Empty(t, c.delta[3], "not wildcard: an unsubscribed name is not marked")
		})
	}
}

// TestContractCallbacksSeeRequestsFirst pins what Server.internNames
// relies on for delta streams: the request callback sees each request
// before the stream adds its names to the subscription, so names the
// callback replaces are the strings the subscription keeps.
func TestContractCallbacksSeeRequestsFirst(t *testing.T) {
	for _, server := range deltaServers {
		t.Run(server, func(t *testing.T) {
			canonical := string([]byte("outbound|80||a.ns.svc.cluster.local"))
			c := &recordingCache{}
			ads := serveRecordingWith(t, server, c, serverv3.CallbackFuncs{
				StreamDeltaRequestFunc: func(_ int64, req *discovery.DeltaDiscoveryRequest) error {
					names := req.GetResourceNamesSubscribe()
					for i := range names {
						if names[i] == canonical {
							names[i] = canonical
						}
					}
					return nil
				},
			})
			dst, err := ads.DeltaAggregatedResources(t.Context())
			require.NoError(t, err)
			require.NoError(t, dst.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNamesSubscribe: []string{canonical}}))
			_, err = dst.Recv()
			require.NoError(t, err)
			c.waitFor(t, 1)
			c.mu.Lock()
			defer c.mu.Unlock()
			subs := c.deltaSubs[0].SubscribedResources()
			require.Len(t, subs, 1)
			for k := range subs {
				require.Equal(t, canonical, k)
				require.Same(t, unsafe.StringData(canonical), unsafe.StringData(k), "the subscription keeps the string the callback put in the request")
			}
		})
	}
}
