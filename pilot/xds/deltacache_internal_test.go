package xds

import (
	"fmt"
	"testing"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/stream/v3"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
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
		return out
	default:
		t.Fatal("no response")
		return nil
	}
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
	w := newDeltaCache(WorkloadType, "v-", slogAdapter{})
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
	w := newDeltaCache(WorkloadType, "v-", slogAdapter{})
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
