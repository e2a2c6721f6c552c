package xds

import (
	"fmt"
	"slices"
	"testing"
	"unsafe"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/stream/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// sotwSim is a SotW stream of one type as pilot's server drives a cache: a
// subscription kept across requests, the watch cancelled before the next
// request.
type sotwSim struct {
	t      *testing.T
	w      *typeCache
	sub    *sotwSubscription
	ch     chan cache.Response
	cancel func()
	nonce  int
}

func newSotwSim(t *testing.T, w *typeCache, names []string) *sotwSim {
	s := &sotwSim{t: t, w: w, sub: newSotwSubscription(nil, names)}
	s.request("", names)
	return s
}

// request sends a request of version with names (the subscription updated
// first, as the server does).
func (s *sotwSim) request(version string, names []string) {
	s.t.Helper()
	if s.cancel != nil {
		s.cancel()
		s.sub.set(names)
	}
	s.ch = make(chan cache.Response, 1)
	var err error
	s.cancel, err = s.w.CreateWatch(&discovery.DiscoveryRequest{TypeUrl: s.w.typeURL, VersionInfo: version, ResourceNames: names}, s.sub, s.ch)
	require.NoError(s.t, err)
}

// next returns the pending response as the client decodes it, after the
// server's bookkeeping, or nil.
func (s *sotwSim) next() (*discovery.DiscoveryResponse, *discovery.DiscoveryResponse) {
	s.t.Helper()
	select {
	case resp := <-s.ch:
		out, err := resp.GetDiscoveryResponse()
		require.NoError(s.t, err)
		s.nonce++
		out.Nonce = fmt.Sprint(s.nonce)
		return wireDecoded(s.t, out), out
	default:
		return nil, nil
	}
}

// ack ACKs r, keeping the subscription.
func (s *sotwSim) ack(r *discovery.DiscoveryResponse) {
	s.request(r.GetVersionInfo(), slices.Sorted(mapKeys(s.sub.SubscribedResources())))
}

func mapKeys(m map[string]struct{}) func(func(string) bool) {
	return func(yield func(string) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

// sotwNames returns the names of the resources of r (raw wrappers of their
// own names' values, see update).
func sotwNames(t *testing.T, r *discovery.DiscoveryResponse) []string {
	t.Helper()
	if r == nil {
		return nil
	}
	var out []string
	for _, a := range r.GetResources() {
		v := a.GetValue()
		out = append(out, string(v[2:2+v[1]]))
	}
	slices.Sort(out)
	return out
}

// update sets every name of up to a resource whose encoding names it and
// version v, and deletes del.
func update(t *testing.T, w *typeCache, v string, up []string, del ...string) {
	t.Helper()
	m := map[string]types.Resource{}
	for _, n := range up {
		// A StringValue of n (field 1): its value bytes end with n; v
		// (field 2, unknown) makes the encoding change with the version.
		r, err := toRaw(wrapperspb.String(n))
		require.NoError(t, err)
		m[n] = rawOf(append(rawBytes(r), 0x12, byte(len(v)), v[0]))
	}
	require.NoError(t, w.UpdateResources(m, del))
}

// TestSotwEds: EDS over SotW (not full state): the subscribed resources
// first, then only the changed ones a client subscribes to; deletions are
// not sent; a new name is sent alone; a request with another server's
// version is answered in full.
func TestSotwEds(t *testing.T) {
	w := newTypeCache(resource.EndpointType, "v-", slogAdapter{})
	update(t, w, "1", []string{"a", "b", "c"})
	c := newSotwSim(t, w, []string{"a", "b"})
	r, _ := c.next()
	require.Equal(t, []string{"a", "b"}, sotwNames(t, r))
	c.ack(r)
	r, _ = c.next()
	require.Nil(t, r, "an ACK is not answered")

	update(t, w, "2", []string{"c"})
	r, _ = c.next()
	require.Nil(t, r, "c is not subscribed")
	update(t, w, "3", []string{"a"})
	r, _ = c.next()
	require.Equal(t, []string{"a"}, sotwNames(t, r))
	c.ack(r)
	update(t, w, "4", nil, "b")
	r, _ = c.next()
	require.Nil(t, r, "SotW EDS cannot tell a deletion")

	c.request(r2version(w), []string{"a", "c"})
	r, _ = c.next()
	require.Equal(t, []string{"c"}, sotwNames(t, r), "only the newly subscribed name")
	c.ack(r)
	c.request("other-7", []string{"a", "c"})
	r, _ = c.next()
	require.Equal(t, []string{"a", "c"}, sotwNames(t, r), "another server's version: everything")
}

func r2version(w *typeCache) string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.version()
}

// TestSotwCdsFullState: CDS over SotW (full state): every change, deletion
// included, sends every resource the client receives.
func TestSotwCdsFullState(t *testing.T) {
	w := newTypeCache(resource.ClusterType, "v-", slogAdapter{})
	update(t, w, "1", []string{"a", "b"})
	c := newSotwSim(t, w, nil) // wildcard
	r, _ := c.next()
	require.Equal(t, []string{"a", "b"}, sotwNames(t, r))
	c.ack(r)
	update(t, w, "2", []string{"c"})
	r, _ = c.next()
	require.Equal(t, []string{"a", "b", "c"}, sotwNames(t, r))
	c.ack(r)
	update(t, w, "3", nil, "a")
	r, _ = c.next()
	require.Equal(t, []string{"b", "c"}, sotwNames(t, r))
	c.ack(r)

	byName := newSotwSim(t, w, []string{"b", "c"})
	r, _ = byName.next()
	require.Equal(t, []string{"b", "c"}, sotwNames(t, r))
	byName.ack(r)
	// Unsubscribing c is a change of its full state.
	byName.request(r.GetVersionInfo(), []string{"b"})
	r, _ = byName.next()
	require.Equal(t, []string{"b"}, sotwNames(t, r))
}

// TestPushEncodesOnce: one push to many SotW and delta streams encodes the
// changed resource once: every stream's envelope is its own (the server
// sets its nonce), and carries the same bytes, which decode as the
// resources go-control-plane would have sent.
func TestPushEncodesOnce(t *testing.T) {
	w := newTypeCache(resource.EndpointType, "v-", slogAdapter{})
	update(t, w, "1", []string{"a", "b"})
	var sotw []*sotwSim
	var delta []chan cache.DeltaResponse
	for range 5 {
		c := newSotwSim(t, w, []string{"a", "b"})
		r, _ := c.next()
		c.ack(r)
		sotw = append(sotw, c)
		ch := make(chan cache.DeltaResponse, 1)
		sub := stream.NewDeltaSubscription([]string{"a", "b"}, nil, nil, false)
		_, err := w.CreateDeltaWatch(&discovery.DeltaDiscoveryRequest{TypeUrl: w.typeURL, ResourceNamesSubscribe: []string{"a", "b"}}, &sub, ch)
		require.NoError(t, err)
		<-ch
		_, err = w.CreateDeltaWatch(&discovery.DeltaDiscoveryRequest{TypeUrl: w.typeURL, ResponseNonce: "1"}, &sub, ch)
		require.NoError(t, err)
		delta = append(delta, ch)
	}
	update(t, w, "2", []string{"b"})
	raw := w.resources["b"].raw
	wantSotw := &discovery.DiscoveryResponse{VersionInfo: "v-2", TypeUrl: w.typeURL,
		Resources: []*anypb.Any{{TypeUrl: w.typeURL, Value: raw}}}
	wantDelta := &discovery.DeltaDiscoveryResponse{SystemVersionInfo: "v-2", TypeUrl: w.typeURL,
		Resources: []*discovery.Resource{{Name: "b", Version: w.resources["b"].version, Resource: &anypb.Any{TypeUrl: w.typeURL, Value: raw}}}}

	var bodies []*byte
	envelopes := map[proto.Message]bool{}
	for _, c := range sotw {
		got, env := c.next()
		require.NotNil(t, got)
		got.Nonce = ""
		require.True(t, proto.Equal(wantSotw, got), "got %v", got)
		bodies = append(bodies, unsafe.SliceData(env.ProtoReflect().GetUnknown()))
		envelopes[env] = true
	}
	for _, ch := range delta {
		resp := <-ch
		env, err := resp.GetDeltaDiscoveryResponse()
		require.NoError(t, err)
		require.True(t, proto.Equal(wantDelta, wireDecoded(t, env)), "got %v", env)
		bodies = append(bodies, unsafe.SliceData(env.ProtoReflect().GetUnknown()))
		envelopes[env] = true
	}
	require.Len(t, envelopes, 10, "one envelope per stream")
	require.Len(t, slices.Compact(bodies[:5]), 1, "one SotW body for all streams")
	require.Len(t, slices.Compact(bodies[5:]), 1, "one delta body for all streams")
}
