package xds

import (
	"context"
	"runtime"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/isthmus-mesh/isthmus/test/envoynode"
)

// realNode is a real sidecar's node, with pilot's metadata.
func realNode(id string) *corev3.Node {
	return envoynode.Sidecar(id, map[string]string{MetadataClusterID: "c1", MetadataNetwork: "net1", MetadataNodeName: "node-1"})
}

// requireKept checks that n is what a stream keeps of realNode(id): the
// id, the cluster, the user agent name (which kind of client) and pilot's
// metadata, as strings; no extensions.
func requireKept(t *testing.T, id string, n *corev3.Node) {
	t.Helper()
	require.Equal(t, id, n.GetId())
	require.Equal(t, "echo.default", n.GetCluster())
	require.Zero(t, len(n.GetExtensions()), "extensions kept")
	require.Equal(t, "envoy", n.GetUserAgentName())
	got := map[string]string{}
	for k, v := range n.GetMetadata().GetFields() {
		got[k] = v.GetStringValue()
	}
	require.Equal(t, map[string]string{MetadataClusterID: "c1", MetadataNetwork: "net1", MetadataNodeName: "node-1"}, got)
	require.Less(t, proto.Size(n), 200, "a stream keeps little of a %d-byte node", proto.Size(realNode(id)))
}

// TestStreamsKeepLittleOfTheirNode: a real Envoy's node runs to tens of KB
// (its extensions, Istio's metadata); a SotW or delta stream keeps of it
// the id, the cluster and the metadata pilot reads, and a SotW stream
// whose client sends the same node again keeps the one it has.
func TestStreamsKeepLittleOfTheirNode(t *testing.T) {
	raw, err := proto.Marshal(&discovery.DiscoveryRequest{Node: realNode("envoy-1"), TypeUrl: resource.EndpointType})
	require.NoError(t, err)
	d := newRequestDecoder()
	first, err := d.decode(raw)
	require.NoError(t, err)
	requireKept(t, "envoy-1", first.Node)
	again, err := d.decode(raw)
	require.NoError(t, err)
	require.Same(t, first.Node, again.Node, "the same node, sent again")
	other, err := proto.Marshal(&discovery.DiscoveryRequest{Node: realNode("envoy-2"), TypeUrl: resource.EndpointType})
	require.NoError(t, err)
	changed, err := d.decode(other)
	require.NoError(t, err)
	requireKept(t, "envoy-2", changed.Node)

	rec := &nodeRecorder{}
	watches := &noWatches{}
	x := &deltaServer{ctx: t.Context(), watcher: watches, callbacks: rec, subs: newSubscriptions()}
	p := &deltaProcess{x: x, id: 1, responses: make(chan cache.DeltaResponse, deltaTypes), node: &corev3.Node{}}
	rawDelta, err := proto.Marshal(&discovery.DeltaDiscoveryRequest{Node: realNode("ztunnel-1"), TypeUrl: resource.ClusterType})
	require.NoError(t, err)
	firstDelta, err := (&deltaStream{deltaStreamServer: &rawDeltaStream{raw: [][]byte{rawDelta}}}).Recv()
	require.NoError(t, err)
	require.NoError(t, p.handle(firstDelta, resource.AnyType))
	requireKept(t, "ztunnel-1", rec.nodes[0])
	require.Same(t, rec.nodes[0], p.node)
	require.NoError(t, p.handle(&discovery.DeltaDiscoveryRequest{TypeUrl: resource.EndpointType}, resource.AnyType))
	require.Same(t, p.node, rec.nodes[1], "a request without a node has the stream's")
	require.Same(t, p.node, watches.nodes[1])
	p.close()
}

// nodeRecorder records the node of each delta request.
type nodeRecorder struct{ nodes []*corev3.Node }

func (r *nodeRecorder) OnDeltaStreamOpen(context.Context, int64, string) error { return nil }
func (r *nodeRecorder) OnDeltaStreamClosed(int64, *corev3.Node)                {}
func (r *nodeRecorder) OnStreamDeltaRequest(_ int64, req *discovery.DeltaDiscoveryRequest) error {
	r.nodes = append(r.nodes, req.GetNode())
	return nil
}
func (r *nodeRecorder) OnStreamDeltaResponse(int64, *discovery.DeltaDiscoveryRequest, *discovery.DeltaDiscoveryResponse) {
}

// noWatches opens watches that never answer, and records their nodes.
type noWatches struct{ nodes []*corev3.Node }

func (w *noWatches) CreateDeltaWatch(req *cache.DeltaRequest, _ cache.Subscription, _ chan cache.DeltaResponse) (func(), error) {
	w.nodes = append(w.nodes, req.GetNode())
	return func() {}, nil
}

// BenchmarkStreamNode: the heap a SotW stream's decoder holds after a
// real Envoy's first request (a 26 KB node): pilot's, keeping what it
// reads of the node, against keeping the node as protobuf decodes it and
// its encoding (as pilot did before), measured in the same run.
func BenchmarkStreamNode(b *testing.B) {
	raw, err := proto.Marshal(&discovery.DiscoveryRequest{Node: realNode("envoy-1"), TypeUrl: resource.EndpointType})
	require.NoError(b, err)
	const streams = 200
	for _, impl := range []struct {
		name   string
		decode func() any
	}{
		{"pilot", func() any {
			d := newRequestDecoder()
			if _, err := d.decode(raw); err != nil {
				b.Fatal(err)
			}
			return d
		}},
		{"whole-node", func() any {
			req := &discovery.DiscoveryRequest{}
			if err := proto.Unmarshal(raw, req); err != nil {
				b.Fatal(err)
			}
			return []any{req.Node, append([]byte(nil), raw...)}
		}},
	} {
		b.Run("impl="+impl.name, func(b *testing.B) {
			var perStream float64
			for b.Loop() {
				held := make([]any, 0, streams)
				var m0, m1 runtime.MemStats
				runtime.GC()
				runtime.ReadMemStats(&m0)
				for range streams {
					held = append(held, impl.decode())
				}
				runtime.GC()
				runtime.ReadMemStats(&m1)
				perStream = float64(m1.HeapAlloc-m0.HeapAlloc) / streams
				runtime.KeepAlive(held)
			}
			b.ReportMetric(perStream, "heap-B/stream")
		})
	}
}

// TestKeptNodeLocality: a stream keeps its node's locality (EDS priorities
// depend on it), decoded from the wire as protobuf decodes it, a node sent
// in several parts merging field by field; an absent locality stays absent.
func TestKeptNodeLocality(t *testing.T) {
	a, err := proto.Marshal(&corev3.Node{Id: "envoy-1", Locality: &corev3.Locality{Region: "r1", Zone: "z1"}})
	require.NoError(t, err)
	b, err := proto.Marshal(&corev3.Node{Locality: &corev3.Locality{Zone: "z2", SubZone: "s2"}})
	require.NoError(t, err)
	got, err := decodeKeptNode(a, b)
	require.NoError(t, err)
	merged := &corev3.Node{}
	require.NoError(t, proto.Unmarshal(append(append([]byte{}, a...), b...), merged))
	require.True(t, proto.Equal(keptNode(merged), got), "want %v, got %v", keptNode(merged), got)
	require.True(t, proto.Equal(&corev3.Locality{Region: "r1", Zone: "z2", SubZone: "s2"}, got.GetLocality()))

	none, err := proto.Marshal(&corev3.Node{Id: "envoy-2"})
	require.NoError(t, err)
	got, err = decodeKeptNode(none)
	require.NoError(t, err)
	require.Nil(t, got.GetLocality())
	require.Nil(t, keptNode(&corev3.Node{Id: "envoy-2"}).GetLocality())
}
