package xds

import (
	"log/slog"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/structpb"
	"istio.io/api/security/v1beta1"
	securityclient "istio.io/client-go/pkg/apis/security/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/pilot/policy"
	"github.com/isthmus-mesh/isthmus/pilot/xds/xdstest"
)

// meshPolicies is a Policies of mesh-wide DENY policies, set by name.
type meshPolicies struct{ snap *policy.Snapshot }

func (m *meshPolicies) HasSynced() bool            { return true }
func (m *meshPolicies) Snapshot() *policy.Snapshot { return m.snap }
func (m *meshPolicies) Subscribe(func()) func()    { return func() {} }

func (m *meshPolicies) set(t *testing.T, names ...string) {
	var ps []*policy.Policy
	for _, n := range names {
		ap := &securityclient.AuthorizationPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: "istio-system", Name: n}}
		ap.Spec.Action = v1beta1.AuthorizationPolicy_DENY
		ap.Spec.Rules = []*v1beta1.Rule{{}}
		ps = append(ps, policy.ConvertAuthorizationPolicy("istio-system", ap))
	}
	s, err := policy.NewSnapshot("istio-system", ps, nil)
	require.NoError(t, err)
	m.snap = s
}

// TestAuthzNodeCacheOutlivesAnACK: a ztunnel's ACK cancels its watch
// before it opens the next. A policy batch in between, on a node with no
// enforced workload, used to drop the node's cache as if its ztunnel were
// gone; the ACK's watch then started from a new cache, which sent the
// current policies and never told the ztunnel that one was deleted. The
// cache now stays while a client was watching within orphanAfter.
func TestAuthzNodeCacheOutlivesAnACK(t *testing.T) {
	src := &meshPolicies{}
	src.set(t, "mesh", "other")
	a := newAuthzServer(src, xdstest.New(), "v", slogAdapter{slog.New(slog.DiscardHandler)})
	require.NoError(t, a.apply(nil, true))
	md, err := structpb.NewStruct(map[string]any{MetadataVerifiedNode: "n1", MetadataClusterID: "c1"})
	require.NoError(t, err)
	node := &corev3.Node{Id: "ztunnel", Metadata: md}

	sub := newDeltaSubscription(nil, nil, nil, nil)
	ch := make(chan cache.DeltaResponse, deltaTypes)
	cancel, err := a.createDeltaWatch(&discovery.DeltaDiscoveryRequest{Node: node, TypeUrl: AuthorizationType}, sub, ch)
	require.NoError(t, err)
	first := <-ch
	sub.returned = first.GetNextVersionMap()
	out, err := first.GetDeltaDiscoveryResponse()
	require.NoError(t, err)
	require.Len(t, names(wireDecoded(t, out)), 2)

	cancel() // the ACK: the last watch ends before the next opens
	src.set(t, "mesh")
	require.NoError(t, a.apply(nil, true)) // "other" deleted, meanwhile
	sub.update(nil, nil)
	_, err = a.createDeltaWatch(&discovery.DeltaDiscoveryRequest{Node: node, TypeUrl: AuthorizationType, ResponseNonce: "1"}, sub, ch)
	require.NoError(t, err)
	select {
	case r := <-ch:
		out, err := r.GetDeltaDiscoveryResponse()
		require.NoError(t, err)
		require.Equal(t, []string{"policy/istio-system/other"}, out.GetRemovedResources())
	default:
		t.Fatal("the ztunnel is not told of the deleted policy")
	}
}

// TestClosedStreamsLeaveQuietCaches: a closed stream's client (and the
// responses its channel holds) is dropped orphanAfter after it closed, on
// the next cancelled watch, not only on the type's next update, which a
// quiet cache may never get: clients reconnecting against a quiet mesh
// used to pile up in it.
func TestClosedStreamsLeaveQuietCaches(t *testing.T) {
	w := newTypeCache(resource.ClusterType, "v", slogAdapter{slog.New(slog.DiscardHandler)})
	now := time.Unix(1e9, 0)
	w.now = func() time.Time { return now }
	require.NoError(t, w.UpdateResources(map[string]types.Resource{"a": rawString(t, "A")}, nil))
	stream := func() {
		ch := make(chan cache.DeltaResponse, deltaTypes)
		cancel, err := w.CreateDeltaWatch(&discovery.DeltaDiscoveryRequest{TypeUrl: resource.ClusterType}, newDeltaSubscription(nil, nil, nil, nil), ch)
		require.NoError(t, err)
		require.Len(t, ch, 1) // its response, never read
		cancel()              // the stream closes
	}
	clients := func() int {
		w.mu.Lock()
		defer w.mu.Unlock()
		return len(w.clients)
	}
	for range 100 {
		stream()
	}
	require.Equal(t, 100, clients(), "kept for orphanAfter: they may resume")
	now = now.Add(orphanAfter + time.Second)
	stream()
	require.Equal(t, 1, clients(), "dropped by the next closed stream, with no update")
}
