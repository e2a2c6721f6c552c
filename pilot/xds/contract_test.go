package xds

// This file pins the behaviour of go-control-plane that typecache.go and
// sotw.go rely on. If a library upgrade changes it, these tests fail before
// the caches silently misbehave; see the comments of those files.

import (
	"context"
	"net"
	"reflect"
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

// recordingCache answers every watch at once with an empty response and
// records the subscription each request came with.
type recordingCache struct {
	mu        sync.Mutex
	sotw      []cache.Subscription
	delta     []map[string]string // ReturnedResources of each delta request, copied
	deltaSubs []cache.Subscription
	returnMap func(n int) map[string]string
}

func (c *recordingCache) CreateWatch(req *cache.Request, sub cache.Subscription, ch chan cache.Response) (func(), error) {
	c.mu.Lock()
	c.sotw = append(c.sotw, sub)
	n := len(c.sotw)
	c.mu.Unlock()
	ch <- &cache.PassthroughResponse{Request: req, ReturnedResources: c.returnMap(n),
		DiscoveryResponse: &discovery.DiscoveryResponse{TypeUrl: req.GetTypeUrl(), VersionInfo: "v1"}}
	return func() {}, nil
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

func (c *recordingCache) waitFor(t *testing.T, sotw, delta int) {
	t.Helper()
	require.Eventually(t, func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		return len(c.sotw) >= sotw && len(c.delta) >= delta
	}, 10*time.Second, 5*time.Millisecond)
}

func serveRecording(t *testing.T, c *recordingCache) discovery.AggregatedDiscoveryServiceClient {
	t.Helper()
	return serveRecordingWith(t, c, nil)
}

func serveRecordingWith(t *testing.T, c *recordingCache, cb serverv3.Callbacks) discovery.AggregatedDiscoveryServiceClient {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	srv := grpc.NewServer()
	discovery.RegisterAggregatedDiscoveryServiceServer(srv, serverv3.NewServer(ctx, c, cb))
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

// TestContractSotwStreamKeepsItsReturnedMap pins what sotw.go names a SotW
// stream by: each stream's first subscription carries an empty map of its
// own, and the map a response hands back is the very map the stream's next
// subscription carries.
func TestContractSotwStreamKeepsItsReturnedMap(t *testing.T) {
	c := &recordingCache{}
	var handed []map[string]string
	c.returnMap = func(n int) map[string]string {
		// Hand back the map the request came with, as sotw.go does.
		c.mu.Lock()
		defer c.mu.Unlock()
		m := c.sotw[n-1].ReturnedResources()
		handed = append(handed, m)
		return m
	}
	ads := serveRecording(t, c)
	streams := make([]discovery.AggregatedDiscoveryService_StreamAggregatedResourcesClient, 2)
	for i := range streams {
		st, err := ads.StreamAggregatedResources(t.Context())
		require.NoError(t, err)
		streams[i] = st
		require.NoError(t, st.Send(&discovery.DiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNames: []string{"a"}}))
		resp, err := st.Recv()
		require.NoError(t, err)
		c.waitFor(t, i+1, 0)
		// The ACK: the stream's second request of the type.
		require.NoError(t, st.Send(&discovery.DiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNames: []string{"a"},
			VersionInfo: resp.GetVersionInfo(), ResponseNonce: resp.GetNonce()}))
		_, err = st.Recv()
		require.NoError(t, err)
		c.waitFor(t, 2*(i+1), 0)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	ptr := func(m map[string]string) uintptr { return reflect.ValueOf(m).Pointer() }
	first, ack := c.sotw[0].ReturnedResources(), c.sotw[1].ReturnedResources()
	require.NotNil(t, first)
	require.Empty(t, first)
	require.Equal(t, ptr(handed[0]), ptr(ack), "the map handed back is the one the next request carries")
	require.Empty(t, ack)
	other := c.sotw[2].ReturnedResources()
	require.NotNil(t, other)
	require.NotEqual(t, ptr(first), ptr(other), "each stream has its own map")
	require.Equal(t, ptr(other), ptr(c.sotw[3].ReturnedResources()))
}

// TestContractDeltaMarksFreshAnswers pins what typecache.go reads from a
// delta subscription's returned resources: the first request's
// initial_resource_versions; after a response with an empty NextVersionMap,
// nothing, except a name that a wildcard stream explicitly subscribed and
// now unsubscribes, marked with an empty version for a fresh answer.
func TestContractDeltaMarksFreshAnswers(t *testing.T) {
	c := &recordingCache{}
	ads := serveRecording(t, c)
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
	c.waitFor(t, 0, 1)
	send(&discovery.DeltaDiscoveryRequest{ResourceNamesUnsubscribe: []string{"a"}})
	c.waitFor(t, 0, 2)
	send(&discovery.DeltaDiscoveryRequest{ResourceNamesUnsubscribe: []string{"*"}})
	c.waitFor(t, 0, 3)
	send(&discovery.DeltaDiscoveryRequest{ResourceNamesUnsubscribe: []string{"b"}})
	c.waitFor(t, 0, 4)
	c.mu.Lock()
	defer c.mu.Unlock()
	require.Equal(t, map[string]string{"a": "1", "b": "2"}, c.delta[0], "the first request: the client's versions")
	require.Equal(t, map[string]string{"a": ""}, c.delta[1], "wildcard and explicitly subscribed: marked for a fresh answer")
	require.Empty(t, c.delta[2], "leaving wildcard marks nothing")
	require.Empty(t, c.delta[3], "not wildcard: an unsubscribed name is not marked")
}

// TestContractCallbacksSeeRequestsFirst pins what Server.internNames
// relies on: the request callbacks see each request before the stream makes
// its names the subscription, so names a callback replaces are the strings
// the subscription keeps, in SotW and delta.
func TestContractCallbacksSeeRequestsFirst(t *testing.T) {
	canonical := string([]byte("outbound|80||a.ns.svc.cluster.local"))
	replace := func(names []string) {
		for i := range names {
			if names[i] == canonical {
				names[i] = canonical
			}
		}
	}
	c := &recordingCache{returnMap: func(int) map[string]string { return map[string]string{} }}
	ads := serveRecordingWith(t, c, serverv3.CallbackFuncs{
		StreamRequestFunc: func(_ int64, req *discovery.DiscoveryRequest) error {
			replace(req.GetResourceNames())
			return nil
		},
		StreamDeltaRequestFunc: func(_ int64, req *discovery.DeltaDiscoveryRequest) error {
			replace(req.GetResourceNamesSubscribe())
			return nil
		},
	})
	st, err := ads.StreamAggregatedResources(t.Context())
	require.NoError(t, err)
	require.NoError(t, st.Send(&discovery.DiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNames: []string{canonical}}))
	_, err = st.Recv()
	require.NoError(t, err)
	dst, err := ads.DeltaAggregatedResources(t.Context())
	require.NoError(t, err)
	require.NoError(t, dst.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNamesSubscribe: []string{canonical}}))
	_, err = dst.Recv()
	require.NoError(t, err)
	c.waitFor(t, 1, 1)
	c.mu.Lock()
	defer c.mu.Unlock()
	for name, subs := range map[string]map[string]struct{}{"sotw": c.sotw[0].SubscribedResources(), "delta": c.deltaSubs[0].SubscribedResources()} {
		require.Len(t, subs, 1, name)
		for k := range subs {
			require.Equal(t, canonical, k, name)
			require.Same(t, unsafe.StringData(canonical), unsafe.StringData(k), "%s: the subscription keeps the string the callback put in the request", name)
		}
	}
}
