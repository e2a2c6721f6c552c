package xds

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"testing"
	"unsafe"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/stream/v3"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

func rawString(t *testing.T, v string) types.Resource {
	t.Helper()
	r, err := toRaw(wrapperspb.String(v))
	require.NoError(t, err)
	return r
}

func recv(t *testing.T, ch chan cache.DeltaResponse) *discovery.DeltaDiscoveryResponse {
	t.Helper()
	select {
	case resp := <-ch:
		out, err := resp.GetDeltaDiscoveryResponse()
		require.NoError(t, err)
		assert.Empty(t, resp.GetNextVersionMap(), "no per-resource versions are kept per client")
		return wireDecoded(t, out)
	default:
		t.Fatal("no response")
		return nil
	}
}

// wireDecoded returns m as a client decodes it off the wire (the cache
// keeps resources in encoded bodies).
func wireDecoded[M proto.Message](t *testing.T, m M) M {
	t.Helper()
	b, err := proto.Marshal(m)
	require.NoError(t, err)
	out := m.ProtoReflect().New().Interface().(M)
	require.NoError(t, proto.Unmarshal(b, out))
	require.Empty(t, out.ProtoReflect().GetUnknown(), "unknown fields on the wire")
	return out
}

func names(r *discovery.DeltaDiscoveryResponse) []string {
	var out []string
	for _, res := range r.GetResources() {
		out = append(out, res.GetName())
	}
	return out
}

// TestDeltaCacheTracksClientsByBatch: a client is told what changed since
// the batch it is in sync with, without a version map of its own; one that
// falls out of the change log has its stream ended with Aborted, and its
// reconnect with the versions it holds is sent only what changed.
func TestDeltaCacheTracksClientsByBatch(t *testing.T) {
	w := newTypeCache(WorkloadType, "v-", slogAdapter{})
	require.NoError(t, w.UpdateResources(map[string]types.Resource{"a": rawString(t, "a1"), "b": rawString(t, "b1")}, nil))

	ch := make(chan cache.DeltaResponse, 1)
	req := &discovery.DeltaDiscoveryRequest{TypeUrl: WorkloadType}
	sub := stream.NewDeltaSubscription(nil, nil, nil, true)
	_, err := w.CreateDeltaWatch(req, &sub, ch)
	require.NoError(t, err)
	first := recv(t, ch)
	assert.ElementsMatch(t, []string{"a", "b"}, names(first))
	held := map[string]string{}
	for _, r := range first.GetResources() {
		held[r.GetName()] = r.GetVersion()
	}

	// An ACK parks the watch; a change is pushed at once, alone.
	ack := &discovery.DeltaDiscoveryRequest{TypeUrl: WorkloadType, ResponseNonce: "1"}
	_, err = w.CreateDeltaWatch(ack, &sub, ch)
	require.NoError(t, err)
	require.NoError(t, w.UpdateResources(map[string]types.Resource{"a": rawString(t, "a2")}, []string{"b"}))
	push := recv(t, ch)
	assert.Equal(t, []string{"a"}, names(push))
	assert.Equal(t, []string{"b"}, push.GetRemovedResources())

	// Then it stops asking while more than the log holds goes by.
	for i := range changeLogSize + 1 {
		require.NoError(t, w.UpdateResources(map[string]types.Resource{fmt.Sprint("n", i): rawString(t, "x")}, nil))
	}
	_, err = w.CreateDeltaWatch(ack, &sub, ch)
	require.Equal(t, codes.Aborted, status.Code(err), "%v", err)

	// It reconnects with what it held before the push: a changed, b gone,
	// and the new names.
	sub2 := stream.NewDeltaSubscription(nil, nil, held, true)
	ch2 := make(chan cache.DeltaResponse, 1)
	_, err = w.CreateDeltaWatch(&discovery.DeltaDiscoveryRequest{TypeUrl: WorkloadType, InitialResourceVersions: held}, &sub2, ch2)
	require.NoError(t, err)
	again := recv(t, ch2)
	assert.Len(t, again.GetResources(), changeLogSize+2)
	assert.Contains(t, names(again), "a")
	assert.Equal(t, []string{"b"}, again.GetRemovedResources())

	// A reconnect holding everything is answered with nothing.
	all := map[string]string{}
	for _, r := range again.GetResources() {
		all[r.GetName()] = r.GetVersion()
	}
	sub3 := stream.NewDeltaSubscription(nil, nil, all, true)
	ch3 := make(chan cache.DeltaResponse, 1)
	_, err = w.CreateDeltaWatch(&discovery.DeltaDiscoveryRequest{TypeUrl: WorkloadType, InitialResourceVersions: all}, &sub3, ch3)
	require.NoError(t, err)
	empty := recv(t, ch3)
	assert.Empty(t, empty.GetResources())
	assert.Empty(t, empty.GetRemovedResources())
}

// TestDeltaCacheJoiningWildcard: a client subscribed by name that adds the
// wildcard gets everything.
func TestDeltaCacheJoiningWildcard(t *testing.T) {
	w := newTypeCache(WorkloadType, "v-", slogAdapter{})
	require.NoError(t, w.UpdateResources(map[string]types.Resource{"a": rawString(t, "a1"), "b": rawString(t, "b1"), "c": rawString(t, "c1")}, nil))
	ch := make(chan cache.DeltaResponse, 1)
	sub := stream.NewDeltaSubscription([]string{"a"}, nil, nil, true)
	_, err := w.CreateDeltaWatch(&discovery.DeltaDiscoveryRequest{TypeUrl: WorkloadType, ResourceNamesSubscribe: []string{"a"}}, &sub, ch)
	require.NoError(t, err)
	assert.Equal(t, []string{"a"}, names(recv(t, ch)))

	// A change of b is not for it.
	_, err = w.CreateDeltaWatch(&discovery.DeltaDiscoveryRequest{TypeUrl: WorkloadType, ResponseNonce: "1"}, &sub, ch)
	require.NoError(t, err)
	require.NoError(t, w.UpdateResources(map[string]types.Resource{"b": rawString(t, "b2")}, nil))
	assert.Empty(t, ch)

	join := &discovery.DeltaDiscoveryRequest{TypeUrl: WorkloadType, ResponseNonce: "1", ResourceNamesSubscribe: []string{"*"}}
	sub.UpdateResourceSubscriptions(join.GetResourceNamesSubscribe(), nil)
	_, err = w.CreateDeltaWatch(join, &sub, ch)
	require.NoError(t, err)
	assert.ElementsMatch(t, []string{"a", "b", "c"}, names(recv(t, ch)))
}

// simClient is a delta client and its stream as go-control-plane's server
// keeps it: what it holds, its subscription, its open watch.
type simClient struct {
	t      *testing.T
	w      *typeCache
	sub    stream.Subscription
	ch     chan cache.DeltaResponse
	cancel func()
	held   map[string]string
	nonce  int
}

func newSimClient(t *testing.T, w *typeCache, subscribe []string, held map[string]string) *simClient {
	c := &simClient{t: t, w: w, ch: make(chan cache.DeltaResponse, 1), held: held}
	c.sub = stream.NewDeltaSubscription(subscribe, nil, maps.Clone(held), true)
	c.request(&discovery.DeltaDiscoveryRequest{TypeUrl: WorkloadType, ResourceNamesSubscribe: subscribe, InitialResourceVersions: held})
	return c
}

// request sends req (the subscription already updated) and applies any
// answers until the watch is parked.
func (c *simClient) request(req *discovery.DeltaDiscoveryRequest) {
	if c.cancel != nil {
		c.cancel()
	}
	var err error
	c.cancel, err = c.w.CreateDeltaWatch(req, &c.sub, c.ch)
	require.NoError(c.t, err)
	c.drain()
}

// drain applies a pending response, if any, and ACKs it.
func (c *simClient) drain() {
	select {
	case resp := <-c.ch:
		r, err := resp.GetDeltaDiscoveryResponse()
		require.NoError(c.t, err)
		r = wireDecoded(c.t, r)
		for _, res := range r.GetResources() {
			c.held[res.GetName()] = res.GetVersion()
		}
		for _, name := range r.GetRemovedResources() {
			delete(c.held, name)
		}
		c.sub.SetReturnedResources(resp.GetNextVersionMap())
		c.nonce++
		c.request(&discovery.DeltaDiscoveryRequest{TypeUrl: WorkloadType, ResponseNonce: fmt.Sprint(c.nonce)})
	default:
	}
}

// change subscribes and unsubscribes names. The client drops what it
// unsubscribes from by name itself: the protocol sends no removal for it,
// and a wildcard client that had also subscribed to it by name must be
// sent it again if it still exists.
func (c *simClient) change(subscribe, unsubscribe []string) {
	before := maps.Clone(c.sub.SubscribedResources())
	c.sub.UpdateResourceSubscriptions(subscribe, unsubscribe)
	for _, name := range unsubscribe {
		if _, named := before[name]; named || !c.sub.IsWildcard() {
			delete(c.held, name)
		}
	}
	c.nonce++
	c.request(&discovery.DeltaDiscoveryRequest{TypeUrl: WorkloadType, ResponseNonce: fmt.Sprint(c.nonce),
		ResourceNamesSubscribe: subscribe, ResourceNamesUnsubscribe: unsubscribe})
}

// want is what the client should hold: every resource it receives, at
// its version.
func (c *simClient) want() map[string]string {
	out := map[string]string{}
	for name, e := range c.w.resources {
		if visible(&c.sub, name) {
			out[name] = e.version
		}
	}
	return out
}

// TestDeltaCacheRandomized drives clients (wildcard and by name) through
// random updates, deletions, subscription changes and reconnects, and
// checks after every step that each holds exactly what it receives.
func TestDeltaCacheRandomized(t *testing.T) {
	for seed := range uint64(5) {
		t.Run(fmt.Sprint("seed-", seed), func(t *testing.T) { randomDeltaRun(t, seed) })
	}
}

func randomDeltaRun(t *testing.T, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 2))
	w := newTypeCache(WorkloadType, "v-", slogAdapter{})
	name := func() string { return fmt.Sprint("r", rng.IntN(40)) }
	clients := []*simClient{
		newSimClient(t, w, nil, map[string]string{}),
		newSimClient(t, w, []string{"r1", "r2", "r3"}, map[string]string{}),
		newSimClient(t, w, []string{"*", "r5"}, map[string]string{}),
	}
	for step := range 3000 {
		switch op := rng.IntN(10); {
		case op < 6: // an update batch
			up := map[string]types.Resource{}
			var del []string
			for range 1 + rng.IntN(4) {
				if rng.IntN(3) == 0 {
					del = append(del, name())
				} else {
					up[name()] = rawString(t, fmt.Sprint(step, rng.IntN(3)))
				}
			}
			for _, d := range del {
				delete(up, d)
			}
			require.NoError(t, w.UpdateResources(up, del))
			for _, c := range clients {
				c.drain()
			}
		case op < 8: // a subscription change
			c := clients[rng.IntN(len(clients))]
			switch rng.IntN(4) {
			case 0:
				c.change([]string{name(), name()}, nil)
			case 1:
				c.change(nil, []string{name()})
			case 2:
				c.change([]string{"*"}, nil)
			default:
				c.change(nil, []string{"*"})
			}
		default: // a reconnect with what it holds
			i := rng.IntN(len(clients))
			old := clients[i]
			old.cancel()
			var subscribe []string
			if old.sub.IsWildcard() {
				subscribe = []string{"*"}
			}
			for n := range old.sub.SubscribedResources() {
				subscribe = append(subscribe, n)
			}
			clients[i] = newSimClient(t, w, subscribe, old.held)
		}
		for i, c := range clients {
			require.Equal(t, c.want(), c.held, "step %d, client %d (wildcard %v)", step, i, c.sub.IsWildcard())
		}
	}
}

// TestInternSharesNames: names a client subscribes to become the cache's
// own copies when the cache holds them (EDS), and stay the client's
// otherwise; a deleted resource's name is no longer interned, and types
// subscribed to by wildcard keep no table.
func TestInternSharesNames(t *testing.T) {
	w := newTypeCache(resource.EndpointType, "v", slogAdapter{})
	held := "outbound|80||a.ns.svc.cluster.local"
	require.NoError(t, w.UpdateResources(map[string]types.Resource{held: rawString(t, "a")}, nil))
	copyOf := func(s string) string { return string([]byte(s)) }
	names := []string{copyOf(held), copyOf("outbound|80||unknown")}
	w.intern(names)
	require.Equal(t, []string{held, "outbound|80||unknown"}, names)
	require.Same(t, unsafe.StringData(held), unsafe.StringData(names[0]))

	require.NoError(t, w.UpdateResources(nil, []string{held}))
	names = []string{copyOf(held)}
	w.intern(names)
	require.NotSame(t, unsafe.StringData(held), unsafe.StringData(names[0]), "a deleted resource's name is not interned")
	require.Empty(t, w.canon)

	require.Nil(t, newTypeCache(resource.ClusterType, "v", slogAdapter{}).canon)
}
