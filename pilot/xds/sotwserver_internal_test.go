package xds

import (
	"fmt"
	"log/slog"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/stream/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

func edsNames(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("outbound|80||svc-%d.ns.svc.cluster.local", i)
	}
	return out
}

func testNode(id string) *corev3.Node {
	return &corev3.Node{Id: id, Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{
		MetadataNetwork: structpb.NewStringValue("net1"),
	}}}
}

// TestDecodeRequestLikeProtobuf: a stream's requests decode to what
// protobuf decodes (the node of the stream's last request filled in when
// one carries none), fast or not; the same names give back the last
// request's slice and the same node the last node.
func TestDecodeRequestLikeProtobuf(t *testing.T) {
	names := edsNames(100)
	node := testNode("envoy-1")
	nack := &rpcstatus.Status{Code: 3, Message: "rejected"}
	withUnknown := &discovery.DiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNames: names}
	withUnknown.ProtoReflect().SetUnknown(protowire.AppendTag(nil, 99, protowire.VarintType))
	withUnknown.ProtoReflect().SetUnknown(protowire.AppendVarint(withUnknown.ProtoReflect().GetUnknown(), 7))
	steps := []struct {
		name       string
		req        *discovery.DiscoveryRequest
		sameNames  bool // the last request's slice of the type comes back
		sameNode   bool // the last node comes back
		fromStream bool // the request carries no node
	}{
		{name: "first", req: &discovery.DiscoveryRequest{Node: node, TypeUrl: resource.EndpointType, ResourceNames: names}},
		{name: "ack", req: &discovery.DiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNames: names, VersionInfo: "v-1", ResponseNonce: "1"}, sameNames: true, fromStream: true},
		{name: "ack with node", req: &discovery.DiscoveryRequest{Node: node, TypeUrl: resource.EndpointType, ResourceNames: names, VersionInfo: "v-2", ResponseNonce: "2"}, sameNames: true, sameNode: true},
		{name: "other type", req: &discovery.DiscoveryRequest{TypeUrl: resource.ClusterType}, fromStream: true},
		{name: "fewer names", req: &discovery.DiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNames: names[:99], ResponseNonce: "3"}, fromStream: true},
		{name: "one name changed", req: &discovery.DiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNames: append(append([]string{}, names[:99]...), "x"), ResponseNonce: "4"}, fromStream: true},
		{name: "nack", req: &discovery.DiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNames: append(append([]string{}, names[:99]...), "x"), ResponseNonce: "5", ErrorDetail: nack}, sameNames: true, fromStream: true},
		{name: "unknown field", req: withUnknown, fromStream: true},
		{name: "new node", req: &discovery.DiscoveryRequest{Node: testNode("envoy-2"), TypeUrl: resource.EndpointType, ResourceNames: names}, sameNames: true},
		{name: "wildcard", req: &discovery.DiscoveryRequest{TypeUrl: resource.ListenerType, ResourceNames: []string{"*"}}, fromStream: true},
	}
	d := newRequestDecoder()
	var lastNode *corev3.Node
	var lastNames = map[string][]string{}
	for _, step := range steps {
		raw, err := proto.Marshal(step.req)
		require.NoError(t, err)
		got, err := d.decode(raw)
		require.NoError(t, err, step.name)
		want := proto.Clone(step.req).(*discovery.DiscoveryRequest)
		if step.fromStream {
			want.Node = lastNode
		}
		require.True(t, proto.Equal(want, got), "%s: got %v", step.name, got)
		if prev := lastNames[want.TypeUrl]; step.sameNames {
			require.True(t, sameSlice(prev, got.ResourceNames), "%s: the last request's names", step.name)
		} else if len(got.ResourceNames) > 0 {
			require.False(t, sameSlice(prev, got.ResourceNames), "%s: new names", step.name)
		}
		if step.sameNode || step.fromStream {
			require.Same(t, lastNode, got.Node, step.name)
		} else if lastNode != nil {
			require.NotSame(t, lastNode, got.Node, step.name)
		}
		lastNode, lastNames[want.TypeUrl] = got.Node, got.ResourceNames
	}
}

// TestDecodeRequestRefusesMalformed: truncated requests and strings that
// are not UTF-8 are refused with InvalidArgument, as protobuf refuses them.
func TestDecodeRequestRefusesMalformed(t *testing.T) {
	good, err := proto.Marshal(&discovery.DiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNames: []string{"a"}})
	require.NoError(t, err)
	badUTF8 := protowire.AppendString(protowire.AppendTag(nil, 3, protowire.BytesType), "\xff\xfe")
	badNode := protowire.AppendBytes(protowire.AppendTag(nil, 2, protowire.BytesType), []byte{0x0a, 0x05, 'a'})
	for name, raw := range map[string][]byte{
		"truncated":     good[:len(good)-1],
		"bad tag":       {0x80},
		"invalid UTF-8": badUTF8,
		"bad node":      badNode,
	} {
		_, err := newRequestDecoder().decode(raw)
		require.Equal(t, codes.InvalidArgument, status.Code(err), "%s: %v", name, err)
		require.Error(t, proto.Unmarshal(raw, &discovery.DiscoveryRequest{}), "%s: protobuf refuses it too", name)
	}
}

// TestCodecHandsRequestsEncoded: the server's codec gives a rawRequest the
// received bytes, from every buffer of the message, and decodes every
// other message as gRPC's protobuf codec does; with gRPC's codec instead,
// a rawRequest still gets the bytes.
func TestCodecHandsRequestsEncoded(t *testing.T) {
	want := &discovery.DiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNames: edsNames(3)}
	raw, err := proto.Marshal(want)
	require.NoError(t, err)
	c := newCodec()
	var r rawRequest
	require.NoError(t, c.Unmarshal(mem.BufferSlice{mem.SliceBuffer(raw[:7]), mem.SliceBuffer(raw[7:])}, &r))
	require.Equal(t, raw, r.bytes())
	r.release()
	require.Empty(t, r.bytes())

	var req discovery.DiscoveryRequest
	require.NoError(t, c.Unmarshal(mem.BufferSlice{mem.SliceBuffer(raw)}, &req))
	require.True(t, proto.Equal(want, &req))

	require.NoError(t, c.CodecV2.Unmarshal(mem.BufferSlice{mem.SliceBuffer(raw)}, &r))
	require.Equal(t, raw, r.bytes())
}

// newTestServer is a server whose watches are w's, its streams driven by
// calling handle and reading their outbox.
func newTestServer(t *testing.T, w *typeCache) *sotwServer {
	m, err := newMetrics(prometheus.NewRegistry())
	require.NoError(t, err)
	return &sotwServer{
		ctx:    t.Context(),
		stats:  newTracker(m, slog.New(slog.DiscardHandler), func(*corev3.Node) class { return class{} }, nil, nil),
		watch:  w.watchSotw,
		intern: func(*corev3.Node, string, []string) {},
		subs:   newSubscriptions(),
	}
}

func newTestStream(t *testing.T, w *typeCache) *sotwStream {
	return newTestServer(t, w).newStream(nil, resource.AnyType)
}

// TestSotwStreamsShareSubscriptions: streams that subscribe to the same
// names, in the same order, share one list and set of them, which the
// last stream to leave drops.
func TestSotwStreamsShareSubscriptions(t *testing.T) {
	w := newTypeCache(resource.EndpointType, "v-", slogAdapter{})
	update(t, w, "1", edsNames(3))
	x := newTestServer(t, w)
	s1, s2 := x.newStream(nil, resource.AnyType), x.newStream(nil, resource.AnyType)
	for _, s := range []*sotwStream{s1, s2} {
		require.NoError(t, s.handle(&discovery.DiscoveryRequest{TypeUrl: w.typeURL, ResourceNames: edsNames(3)}))
	}
	sub1, sub2 := s1.watches.get(w.typeURL).sub, s2.watches.get(w.typeURL).sub
	require.Equal(t, 1, x.subs.len())
	require.True(t, sameSlice(sub1.names(), sub2.names()))
	require.Equal(t, fmt.Sprintf("%p", sub1.SubscribedResources()), fmt.Sprintf("%p", sub2.SubscribedResources()))

	require.NoError(t, s2.handle(&discovery.DiscoveryRequest{TypeUrl: w.typeURL, ResponseNonce: "1", ResourceNames: edsNames(2)}))
	require.Equal(t, 2, x.subs.len())
	require.Len(t, sub2.SubscribedResources(), 2)
	require.Len(t, sub1.SubscribedResources(), 3, "the other stream's subscription is its own")
	s1.close()
	require.Equal(t, 1, x.subs.len())
	s2.close()
	require.Zero(t, x.subs.len())
}

// sentNames returns, per queued response, its nonce and resource names.
func sentNames(t *testing.T, s *sotwStream) (nonces []string, names [][]string, version string) {
	t.Helper()
	queued, _, _ := s.out.take()
	for _, q := range queued {
		out, err := q.resp.GetDiscoveryResponse()
		require.NoError(t, err)
		nonces = append(nonces, q.nonce)
		names = append(names, sotwNames(t, wireDecoded(t, out)))
		version = out.GetVersionInfo()
	}
	return nonces, names, version
}

// TestSotwStreamNeverDropsAResponse: a request that overtakes a response
// the cache delivered but the stream has not sent yet carries an older
// nonce and is ignored, so the response, which the cache counted as
// received, is sent (go-control-plane dropped it, and with it the change
// it carried). The client's next request, with the new nonce, is served.
// A closed stream's watches deliver nothing.
func TestSotwStreamNeverDropsAResponse(t *testing.T) {
	w := newTypeCache(resource.EndpointType, "v-", slogAdapter{})
	update(t, w, "1", []string{"a", "b"})
	s := newTestStream(t, w)
	req := func(version, nonce string, names ...string) {
		t.Helper()
		require.NoError(t, s.handle(&discovery.DiscoveryRequest{TypeUrl: w.typeURL, VersionInfo: version, ResponseNonce: nonce, ResourceNames: names}))
	}
	req("", "", "a")
	nonces, names, v := sentNames(t, s)
	require.Equal(t, []string{"1"}, nonces)
	require.Equal(t, [][]string{{"a"}}, names)
	req(v, "1", "a") // ACK: parked
	nonces, _, _ = sentNames(t, s)
	require.Empty(t, nonces)

	update(t, w, "2", []string{"a"}) // delivered as nonce 2, not sent yet
	req(v, "1", "a", "b")            // the client subscribes to b before it sees 2
	nonces, names, v = sentNames(t, s)
	require.Equal(t, []string{"2"}, nonces, "the stale request opened no watch")
	require.Equal(t, [][]string{{"a"}}, names, "the change of a is sent")
	req(v, "2", "a", "b")
	nonces, names, v = sentNames(t, s)
	require.Equal(t, []string{"3"}, nonces)
	require.Equal(t, [][]string{{"b"}}, names)

	req(v, "3", "a", "b")
	s.close()
	update(t, w, "3", []string{"a", "b"})
	nonces, _, _ = sentNames(t, s)
	require.Empty(t, nonces, "a closed stream is sent nothing")
	req(v, "3", "a", "b")
	nonces, _, _ = sentNames(t, s)
	require.Empty(t, nonces, "a closed stream opens no watch")
}

// TestSotwSubscriptionKeepsItsMap: the subscription's map is rebuilt only
// when the names change; an empty first request is wildcard (legacy), as
// is "*"; naming resources leaves the legacy wildcard for good.
func TestSotwSubscriptionKeepsItsMap(t *testing.T) {
	s := newSotwSubscription(nil, nil)
	require.True(t, s.IsWildcard())
	require.False(t, s.set(nil), "still legacy wildcard")
	require.True(t, s.IsWildcard())
	names := edsNames(3)
	require.True(t, s.set(names))
	require.False(t, s.IsWildcard())
	m := s.SubscribedResources()
	require.Len(t, m, 3)
	require.False(t, s.set(append([]string{}, names...)), "the same names")
	require.Equal(t, fmt.Sprintf("%p", m), fmt.Sprintf("%p", s.SubscribedResources()), "the map is kept")
	require.True(t, s.set(nil))
	require.False(t, s.IsWildcard(), "an empty request after names subscribes to nothing")
	require.Empty(t, s.SubscribedResources())
	require.True(t, s.set([]string{"*", "a"}))
	require.True(t, s.IsWildcard())
	require.Len(t, s.SubscribedResources(), 1)
	require.NotNil(t, s.ReturnedResources())
	require.Empty(t, s.ReturnedResources())
}

// BenchmarkSotwAck: what one Envoy ACK of an EDS subscription of 100
// clusters costs to decode and make the stream's subscription, pilot's way
// against go-control-plane's (protobuf decoding and a new map per request),
// measured in the same run.
func BenchmarkSotwAck(b *testing.B) {
	names := edsNames(100)
	first, err := proto.Marshal(&discovery.DiscoveryRequest{Node: testNode("envoy-1"), TypeUrl: resource.EndpointType, ResourceNames: names})
	require.NoError(b, err)
	ack, err := proto.Marshal(&discovery.DiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNames: names, VersionInfo: "v-1", ResponseNonce: "1"})
	require.NoError(b, err)
	b.Run("impl=pilot", func(b *testing.B) {
		d := newRequestDecoder()
		req, err := d.decode(first)
		require.NoError(b, err)
		sub := newSotwSubscription(newSubscriptions(), req.ResourceNames)
		b.ReportAllocs()
		for b.Loop() {
			req, err := d.decode(ack)
			if err != nil {
				b.Fatal(err)
			}
			sub.set(req.ResourceNames)
		}
	})
	b.Run("impl=go-control-plane", func(b *testing.B) {
		var req discovery.DiscoveryRequest
		require.NoError(b, proto.Unmarshal(first, &req))
		sub := stream.NewSotwSubscription(req.ResourceNames, true)
		b.ReportAllocs()
		for b.Loop() {
			var req discovery.DiscoveryRequest
			if err := proto.Unmarshal(ack, &req); err != nil {
				b.Fatal(err)
			}
			sub.SetResourceSubscription(req.ResourceNames)
		}
	})
}
