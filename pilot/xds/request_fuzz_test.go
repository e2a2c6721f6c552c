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
)

// FuzzDecodeRequest: pilot decodes SotW requests by hand (request.go), from
// the bytes any client sends, against the stream's previous request. After
// a first request prime (so that the reuse of its node and names runs),
// the decoder must refuse raw, with InvalidArgument, exactly when protobuf
// refuses it, and otherwise give what protobuf gives, with what a stream
// keeps of its node (keptNode), the previous node when raw carries none.
func FuzzDecodeRequest(f *testing.F) {
	names := edsNames(3)
	node := testNode("envoy-1")
	nack := &discovery.DiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNames: names, ResponseNonce: "2",
		ErrorDetail: status.New(codes.InvalidArgument, "bad").Proto()}
	nackWithNode := proto.Clone(nack).(*discovery.DiscoveryRequest)
	nackWithNode.Node = node
	for _, pair := range [][2]*discovery.DiscoveryRequest{
		{{Node: node, TypeUrl: resource.EndpointType, ResourceNames: names}, {TypeUrl: resource.EndpointType, ResourceNames: names, VersionInfo: "v-1", ResponseNonce: "1"}},
		{{Node: node, TypeUrl: resource.ClusterType}, {Node: node, TypeUrl: resource.ClusterType, VersionInfo: "v-1", ResponseNonce: "1"}},
		{nack, {Node: &corev3.Node{}, TypeUrl: resource.EndpointType, ResourceNames: names}},
		// A node decoded by protobuf (a NACK's), then an empty one.
		{nackWithNode, {Node: &corev3.Node{}, TypeUrl: resource.EndpointType, ResourceNames: names}},
		{{Node: node, TypeUrl: resource.ListenerType, ResourceNames: []string{"*"}}, nack},
		{{}, {Node: node}},
	} {
		prime, err := proto.Marshal(pair[0])
		if err != nil {
			f.Fatal(err)
		}
		raw, err := proto.Marshal(pair[1])
		if err != nil {
			f.Fatal(err)
		}
		f.Add(prime, raw)
		f.Add(raw, prime)
		// Two encodings of the node, which protobuf merges.
		f.Add(prime, append(raw, protowire.AppendBytes(protowire.AppendTag(nil, reqNode, protowire.BytesType), []byte{0x0a, 0x01, 'x'})...))
		// A second version (the last counts), and one that is not UTF-8.
		f.Add(prime, protowire.AppendString(protowire.AppendTag(raw, reqVersion, protowire.BytesType), "v-9"))
		f.Add(prime, protowire.AppendString(protowire.AppendTag(raw, reqVersion, protowire.BytesType), "\xff"))
	}
	// As many names as the last request, one of them other.
	other := append(names[:len(names)-1:len(names)-1], "other")
	for _, pair := range [][2][]string{{names, other}, {other, names}} {
		prime, err := proto.Marshal(&discovery.DiscoveryRequest{Node: node, TypeUrl: resource.EndpointType, ResourceNames: pair[0]})
		if err != nil {
			f.Fatal(err)
		}
		raw, err := proto.Marshal(&discovery.DiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNames: pair[1], ResponseNonce: "1"})
		if err != nil {
			f.Fatal(err)
		}
		f.Add(prime, raw)
	}
	f.Fuzz(func(t *testing.T, prime, raw []byte) {
		d := newRequestDecoder()
		prev := d.node
		if p, err := d.decode(prime); err == nil {
			prev = p.Node
		} else {
			// A refused request ends its stream: nothing decodes after it.
			d = newRequestDecoder()
		}
		got, err := d.decode(raw)
		want := &discovery.DiscoveryRequest{}
		if werr := proto.Unmarshal(raw, want); werr != nil {
			if status.Code(err) != codes.InvalidArgument {
				t.Fatalf("protobuf refuses %x (%v); the decoder gave %v, %v", raw, werr, got, err)
			}
			return
		}
		if err != nil {
			t.Fatalf("protobuf decodes %x to %v; the decoder refused it: %v", raw, want, err)
		}
		if want.Node == nil {
			want.Node = prev
		} else {
			want.Node = keptNode(want.Node) // what a stream keeps of a node (node.go)
		}
		if !proto.Equal(want, got) {
			t.Fatalf("after %x, %x decodes to\n%v\nprotobuf's:\n%v", prime, raw, got, want)
		}
	})
}
