package xds

import (
	"hash/maphash"
	"slices"
	"sync"
	"unicode/utf8"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	protoenc "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"
)

// SotW requests are decoded by hand, against the stream's previous ones.
// An Envoy resends its whole subscription with every ACK: at 1,000 Envoys
// and 100 clusters, decoding each request into new strings, and go-control-
// plane's new subscription map per request, were a fifth of pilot's CPU per
// push. A request arrives as raw bytes (an Empty message keeps every field as
// unknown bytes); its names are compared, still encoded, with the names of
// the stream's previous request of the type, whose slice is reused when they
// are the same, and its node with the previous node's encoding, whose
// message is reused. Requests with fields other than these (error details
// of a NACK, resource locators) are decoded in full by protobuf, then get
// the same reuse. Strings are checked to be UTF-8, as protobuf does.

// Field numbers of envoy.service.discovery.v3.DiscoveryRequest.
const (
	reqVersion protowire.Number = 1
	reqNode    protowire.Number = 2
	reqNames   protowire.Number = 3
	reqType    protowire.Number = 4
	reqNonce   protowire.Number = 5
)

// requestDecoder decodes one stream's SotW requests. It is used by one
// goroutine.
type requestDecoder struct {
	// node is what the stream keeps of its last node (keptNode); nodeSum
	// and nodeLen identify the encoding it was decoded from (nodeLen -1:
	// none, protobuf decoded it).
	node    *corev3.Node
	nodeSum uint64
	nodeLen int
	// names are the resource names of the last request of each type URL.
	names byType[[]string]
}

// newRequestDecoder returns a stream's decoder. Until a request carries a
// node, requests get an empty one, as go-control-plane gives them: a
// stream is authorized on the node of its first request, so a first
// request without one must be checked (and refused) as a node claiming
// nothing, not skip the check.
func newRequestDecoder() *requestDecoder {
	return &requestDecoder{node: &corev3.Node{}, nodeLen: -1}
}

func badRequest(format string, args ...any) error {
	return status.Errorf(codes.InvalidArgument, "malformed discovery request: "+format, args...)
}

// decode decodes the encoded request raw. A request without a node gets
// the stream's last one, as the protocol says (only the first need carry
// it).
func (d *requestDecoder) decode(raw []byte) (*discovery.DiscoveryRequest, error) {
	req, fast, err := d.scan(raw)
	if err != nil {
		return nil, err
	}
	if !fast {
		req = &discovery.DiscoveryRequest{}
		if err := onFreshStack(func() error { return proto.Unmarshal(raw, req) }); err != nil {
			return nil, badRequest("%v", err)
		}
		if req.Node != nil {
			d.node, d.nodeLen = keptNode(req.Node), -1
			req.Node = d.node
		}
		if prev := d.names.get(req.TypeUrl); slices.Equal(prev, req.ResourceNames) && len(prev) > 0 {
			req.ResourceNames = prev
		}
	}
	if req.Node == nil {
		req.Node = d.node
	}
	d.names.set(req.TypeUrl, req.ResourceNames)
	return req, nil
}

// scan decodes raw when it holds only a version, a node (once), names, a
// type URL and a nonce; fast is false when it holds anything else. Names
// are decoded in a second pass, once the type URL is known.
func (d *requestDecoder) scan(raw []byte) (req *discovery.DiscoveryRequest, fast bool, err error) {
	req = &discovery.DiscoveryRequest{}
	var nodeRaw []byte
	names := 0
	for b := raw; len(b) > 0; {
		num, v, n, ok, err := nextBytesField(b)
		if err != nil || !ok {
			return nil, false, err
		}
		b = b[n:]
		if num == reqNode {
			if nodeRaw != nil {
				return nil, false, nil // a second node merges into the first: protobuf's job
			}
			nodeRaw = v
			continue
		}
		if num == reqNames {
			// Checked when decoded: names equal to the last request's
			// were checked then.
			names++
			continue
		}
		if !utf8.Valid(v) {
			return nil, false, badRequest("field %d is not valid UTF-8", num)
		}
		switch num {
		case reqVersion:
			req.VersionInfo = string(v)
		case reqType:
			req.TypeUrl = knownType(v)
		case reqNonce:
			req.ResponseNonce = string(v)
		}
	}
	if nodeRaw != nil {
		if err := d.decodeNode(nodeRaw); err != nil {
			return nil, false, err
		}
		req.Node = d.node
	}
	req.ResourceNames, err = d.namesOf(raw, names, req.TypeUrl)
	if err != nil {
		return nil, false, err
	}
	return req, true, nil
}

// nextBytesField consumes the field at the start of b: ok is false when it
// is not one of the fields scan decodes.
func nextBytesField(b []byte) (num protowire.Number, v []byte, n int, ok bool, err error) {
	num, typ, n := protowire.ConsumeTag(b)
	if n < 0 {
		return 0, nil, 0, false, badRequest("%v", protowire.ParseError(n))
	}
	if typ != protowire.BytesType || num < reqVersion || num > reqNonce {
		return 0, nil, 0, false, nil
	}
	v, m := protowire.ConsumeBytes(b[n:])
	if m < 0 {
		return 0, nil, 0, false, badRequest("%v", protowire.ParseError(m))
	}
	return num, v, n + m, true, nil
}

// eachName calls f with each resource name in raw, which scan checked.
func eachName(raw []byte, f func(i int, name []byte) bool) {
	i := 0
	for b := raw; len(b) > 0; {
		num, v, n, _, _ := nextBytesField(b)
		b = b[n:]
		if num == reqNames {
			if !f(i, v) {
				return
			}
			i++
		}
	}
}

// decodeNode sets the stream's node from its encoding, keeping the node
// decoded before when the encoding is the same (by length and a 64-bit
// hash with a seed of the process's: a collision could only keep a
// stream on its own earlier node). A node protobuf decoded (decode's full
// path) has no encoding kept, and equals none: an empty encoding, an
// empty node, must not keep it.
func (d *requestDecoder) decodeNode(raw []byte) error {
	sum := maphash.Bytes(nodeSeed, raw)
	if len(raw) == d.nodeLen && sum == d.nodeSum {
		return nil
	}
	var node *corev3.Node
	if err := onFreshStack(func() (err error) { node, err = decodeKeptNode(raw); return err }); err != nil {
		return badRequest("node: %v", err)
	}
	d.node, d.nodeSum, d.nodeLen = node, sum, len(raw)
	return nil
}

var nodeSeed = maphash.MakeSeed()

// namesOf returns the count names in raw: the previous request's slice of
// typeURL when they are the same names, else new strings, checked to be
// UTF-8.
func (d *requestDecoder) namesOf(raw []byte, count int, typeURL string) ([]string, error) {
	if count == 0 {
		return nil, nil
	}
	if prev := d.names.get(typeURL); len(prev) == count {
		same := true
		eachName(raw, func(i int, name []byte) bool {
			same = string(name) == prev[i]
			return same
		})
		if same {
			return prev, nil
		}
	}
	names := make([]string, 0, count)
	valid := true
	eachName(raw, func(_ int, name []byte) bool {
		valid = utf8.Valid(name)
		names = append(names, string(name))
		return valid
	})
	if !valid {
		return nil, badRequest("resource name %d is not valid UTF-8", len(names)-1)
	}
	return names, nil
}

// knownType returns the server's own string for a type URL it serves, so
// that requests do not allocate one each.
func knownType(b []byte) string {
	for _, t := range allTypes {
		if string(b) == t {
			return t
		}
	}
	switch string(b) {
	case AuthorizationType:
		return AuthorizationType
	case IstioAuthorizationType:
		return IstioAuthorizationType
	}
	return string(b)
}

// rawRequest receives a request's encoding. With the server's codec
// (ServerOptions) it is the received bytes, copied into a pooled buffer;
// with gRPC's own, protobuf keeps them as the unknown fields of the
// embedded Empty (correct, slower: every field is appended on its own).
type rawRequest struct {
	emptypb.Empty
	buf *[]byte
}

// bytes returns the encoding; it is valid until release.
func (r *rawRequest) bytes() []byte {
	if r.buf != nil {
		return *r.buf
	}
	return r.Empty.ProtoReflect().GetUnknown()
}

// release returns the buffer to the pool and empties r.
func (r *rawRequest) release() {
	if r.buf != nil {
		if cap(*r.buf) <= maxPooledRequest {
			requestBuffers.Put(r.buf)
		}
		r.buf = nil
	}
	r.Empty.Reset()
}

// maxPooledRequest bounds the buffers kept for reuse: an initial request
// of a large subscription is rare, and need not stay allocated.
const maxPooledRequest = 64 << 10

var requestBuffers = sync.Pool{New: func() any { return new([]byte) }}

// ServerOptions are the options a gRPC server serving a Server must be
// built with: its codec hands SotW requests to the server still encoded
// (see above), and is gRPC's protobuf codec for every other message.
func ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{grpc.ForceServerCodecV2(newCodec())}
}

func newCodec() codec { return codec{encoding.GetCodecV2(protoenc.Name)} }

type codec struct{ encoding.CodecV2 }

func (c codec) Unmarshal(data mem.BufferSlice, v any) error {
	r, ok := v.(*rawRequest)
	if !ok {
		return c.CodecV2.Unmarshal(data, v)
	}
	buf := requestBuffers.Get().(*[]byte)
	b := (*buf)[:0]
	for _, d := range data {
		b = append(b, d.ReadOnlyData()...)
	}
	*buf = b
	r.buf = buf
	return nil
}
