package xds

import (
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// FuzzDecodeKeptNode: a node's encoding, from any client, is decoded
// straight into what a stream keeps of it (nodewire.go). It must be refused
// exactly when protobuf refuses it, and otherwise be keptNode of what
// protobuf decodes: the last id and cluster, and the kept metadata keys'
// values after protobuf's merging (a Struct sent twice, a key twice, a
// Value's kind set twice).
func FuzzDecodeKeptNode(f *testing.F) {
	add := func(m proto.Message) {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	add(realNode("envoy-1"))
	add(testNode("envoy-2"))
	add(&corev3.Node{})
	mixed, err := structpb.NewStruct(map[string]any{MetadataClusterID: 1.5, MetadataNetwork: map[string]any{"a": "b"}, MetadataNodeName: nil, "OTHER": "x"})
	if err != nil {
		f.Fatal(err)
	}
	add(&corev3.Node{Id: "n", Metadata: mixed})
	twice, err := proto.Marshal(testNode("envoy-3"))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(append(twice, twice...))
	// A key's Value sent twice in one entry: a string, then a number.
	entry := protowire.AppendString(protowire.AppendTag(nil, entryKey, protowire.BytesType), MetadataNetwork)
	entry = protowire.AppendBytes(protowire.AppendTag(entry, entryValue, protowire.BytesType),
		protowire.AppendString(protowire.AppendTag(nil, valueString, protowire.BytesType), "net1"))
	entry = protowire.AppendBytes(protowire.AppendTag(entry, entryValue, protowire.BytesType),
		protowire.AppendFixed64(protowire.AppendTag(nil, valueNumber, protowire.Fixed64Type), 7))
	md := protowire.AppendBytes(protowire.AppendTag(nil, structFields, protowire.BytesType), entry)
	f.Add(protowire.AppendBytes(protowire.AppendTag(nil, nodeMetadata, protowire.BytesType), md))
	f.Fuzz(func(t *testing.T, raw []byte) {
		got, err := decodeKeptNode(raw)
		want := &corev3.Node{}
		if werr := proto.Unmarshal(raw, want); werr != nil {
			if err == nil {
				t.Fatalf("protobuf refuses %x (%v); decodeKeptNode gave %v", raw, werr, got)
			}
			return
		}
		if err != nil {
			t.Fatalf("protobuf decodes %x; decodeKeptNode refused it: %v", raw, err)
		}
		if k := keptNode(want); !proto.Equal(k, got) {
			t.Fatalf("%x decodes to\n%v\nkeptNode of protobuf's:\n%v", raw, got, k)
		}
	})
}

// FuzzDecodeDeltaRequest: a delta request, from any client, is decoded by
// protobuf but for its node, which goes to decodeKeptNode (stacks.go). It
// must be refused exactly when protobuf refuses it, and otherwise be what
// protobuf decodes, with keptNode of its node.
func FuzzDecodeDeltaRequest(f *testing.F) {
	for _, req := range []*discovery.DeltaDiscoveryRequest{
		{Node: realNode("envoy-1"), TypeUrl: resource.ClusterType},
		{Node: testNode("ztunnel-1"), TypeUrl: resource.EndpointType, ResourceNamesSubscribe: []string{"a", "b"}, InitialResourceVersions: map[string]string{"a": "1"}},
		{TypeUrl: resource.EndpointType, ResponseNonce: "3", ResourceNamesUnsubscribe: []string{"c"}},
		{Node: &corev3.Node{}},
	} {
		b, err := proto.Marshal(req)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		got, err := (&deltaStream{deltaStreamServer: &rawDeltaStream{raw: [][]byte{raw}}}).Recv()
		want := &discovery.DeltaDiscoveryRequest{}
		if werr := proto.Unmarshal(raw, want); werr != nil {
			if status.Code(err) != codes.InvalidArgument {
				t.Fatalf("protobuf refuses %x (%v); the stream decoded %v, %v", raw, werr, got, err)
			}
			return
		}
		if err != nil {
			t.Fatalf("protobuf decodes %x; the stream refused it: %v", raw, err)
		}
		want.Node = keptNode(want.Node)
		if !proto.Equal(want, got) {
			t.Fatalf("%x decodes to\n%v\nprotobuf's, node kept:\n%v", raw, got, want)
		}
	})
}
