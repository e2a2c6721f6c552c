package xds

import (
	"fmt"

	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/known/emptypb"
)

// Resources are kept in the caches in their wire form only: a raw resource
// is a message with no fields of its own whose unknown fields are the
// deterministic encoding of the built resource. Marshaling it (as
// go-control-plane does for every response and to hash its version) yields
// exactly that encoding, so clients receive the same bytes as if the built
// message had been cached, while the server holds ~200 bytes per workload
// instead of a tree of messages, maps and wrappers several times that size.
// Equality is byte equality of deterministic encodings.

// toRaw encodes m as a raw resource.
func toRaw(m proto.Message) (types.Resource, error) {
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	if err != nil {
		return nil, err
	}
	return rawOf(b), nil
}

// rawOf wraps an encoding as a raw resource, sharing its bytes.
func rawOf(b []byte) types.Resource {
	r := &emptypb.Empty{}
	r.ProtoReflect().SetUnknown(b)
	return r
}

// rawBytes returns the encoding a raw resource carries; it must not be
// modified.
func rawBytes(r types.Resource) []byte { return r.ProtoReflect().GetUnknown() }

// rawJSON renders a raw resource of type URL typeURL as JSON.
func rawJSON(typeURL string, r types.Resource) ([]byte, error) {
	mt, err := protoregistry.GlobalTypes.FindMessageByURL(typeURL)
	if err != nil {
		return nil, fmt.Errorf("type %s: %w", typeURL, err)
	}
	m := mt.New().Interface()
	if err := proto.Unmarshal(rawBytes(r), m); err != nil {
		return nil, fmt.Errorf("decode %s: %w", typeURL, err)
	}
	return protojson.Marshal(m)
}
