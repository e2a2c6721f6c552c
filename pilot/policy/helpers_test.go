package policy_test

import (
	"google.golang.org/protobuf/encoding/prototext"
	"google.golang.org/protobuf/proto"
)

func protoUnmarshal(b []byte, m proto.Message) error { return proto.Unmarshal(b, m) }

// protoText renders m deterministically for comparisons.
func protoText(m proto.Message) string {
	return prototext.MarshalOptions{Multiline: true}.Format(m)
}
