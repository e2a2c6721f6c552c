package xds

import (
	"sync/atomic"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// onFreshStack runs f on a goroutine of its own and waits for it.
//
// A stream's receiving goroutine spends its life parked in gRPC's RecvMsg,
// about 2 KB deep. Go grows a goroutine's stack by doubling it and shrinks
// it, at a GC, only while a quarter of it holds what is in use (plus 800
// bytes): parked that deep, a stack that once grew past 4 KB stays at 8 KB
// for good. What a stream does once or rarely runs deep (decoding its node,
// authorizing it, opening its first watches, which may build the view of
// its class), so it runs here, on a stack that is freed when it returns;
// an ACK is handled in place, within 4 KB. That is 4 KB less per idle stream
// (the fan-out benchmark's stack-KB/client).
func onFreshStack(f func() error) error {
	done := make(chan error, 1)
	go func() { done <- f() }()
	return <-done
}

// deltaStream decodes a delta stream's requests by protobuf, as gRPC
// would, but those that carry more than names and a nonce (a node,
// initial versions, a NACK's error) on a stack of their own: the stream's
// receiving goroutine, like a SotW stream's, is parked in RecvMsg about
// 2 KB deep (onFreshStack). A malformed request is refused, and the
// stream ends with the refusal (deltaServer.serve).
type deltaStream struct {
	deltaStreamServer
	// refused is the error of a request refused as malformed.
	refused atomic.Pointer[error]
}

// Fields of envoy.service.discovery.v3.DeltaDiscoveryRequest that a
// request decodes in place: the type URL, names and the nonce.
const (
	deltaNode        protowire.Number = 1
	deltaType        protowire.Number = 2
	deltaSubscribe   protowire.Number = 3
	deltaUnsubscribe protowire.Number = 4
	deltaNonce       protowire.Number = 6
)

// Recv receives and decodes the stream's next request.
func (s *deltaStream) Recv() (*discovery.DeltaDiscoveryRequest, error) {
	var m rawRequest
	if err := s.RecvMsg(&m); err != nil {
		return nil, err
	}
	defer m.release()
	raw, req := m.bytes(), &discovery.DeltaDiscoveryRequest{}
	decode := func() error {
		// The node, if any, goes straight to what the stream keeps of it
		// (nodewire.go): a message field sent twice merges, as its
		// contents one after the other would decode.
		rest, nodes := splitDeltaNode(raw)
		if err := proto.Unmarshal(rest, req); err != nil {
			return err
		}
		if nodes == nil {
			return nil
		}
		var err error
		req.Node, err = decodeKeptNode(nodes...)
		return err
	}
	var err error
	if shallowDelta(raw) {
		err = decode()
	} else {
		err = onFreshStack(decode)
	}
	if err != nil {
		err = status.Errorf(codes.InvalidArgument, "malformed delta discovery request: %v", err)
		s.refused.Store(&err)
		return nil, err
	}
	return req, nil
}

// shallowDelta reports whether raw holds only a type URL, names and a nonce.
func shallowDelta(raw []byte) bool {
	for b := raw; len(b) > 0; {
		num, typ, n := protowire.ConsumeField(b)
		if n < 0 || typ != protowire.BytesType {
			return false
		}
		switch num {
		case deltaType, deltaSubscribe, deltaUnsubscribe, deltaNonce:
		default:
			return false
		}
		b = b[n:]
	}
	return true
}

// splitDeltaNode returns raw without its node fields, and their contents
// (nil: none). Malformed wire data is left in rest, for protobuf to
// refuse; a node field of another wire type too (an unknown field to
// protobuf).
func splitDeltaNode(raw []byte) (rest []byte, nodes [][]byte) {
	var spans [][3]int // field start, content start, end
	for off := 0; off < len(raw); {
		num, typ, n := protowire.ConsumeTag(raw[off:])
		if n < 0 {
			break
		}
		m := protowire.ConsumeFieldValue(num, typ, raw[off+n:])
		if m < 0 {
			break
		}
		if num == deltaNode && typ == protowire.BytesType {
			spans = append(spans, [3]int{off, off + n, off + n + m})
		}
		off += n + m
	}
	if len(spans) == 0 {
		return raw, nil
	}
	rest = make([]byte, 0, len(raw))
	prev := 0
	for _, sp := range spans {
		content, _ := protowire.ConsumeBytes(raw[sp[1]:sp[2]])
		nodes = append(nodes, content)
		rest = append(rest, raw[prev:sp[0]]...)
		prev = sp[2]
	}
	return append(rest, raw[prev:]...), nodes
}
