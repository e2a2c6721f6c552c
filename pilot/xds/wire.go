package xds

import (
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// Responses are encoded once and shared by every stream they go to. A
// response's resources (the repeated field `resources`, number 2, of both
// DiscoveryResponse and DeltaDiscoveryResponse) are encoded into one byte
// slice, its body; each stream gets its own small envelope (version, type
// URL, removals, and the nonce the server sets) whose unknown fields are
// that body. Marshalling an envelope writes its few fields and copies the
// body as it is, so a push to N streams encodes the changed resources once,
// not N times, and allocates per stream only the envelope. A body holds
// the same fields a go-control-plane response would, so clients receive the
// same message.
//
// A body is built per response content (the names it carries, in order) and
// version, and kept for the other streams of the same batch in a bodyMemo.

// responseResources is the field number of the resources of both
// DiscoveryResponse and DeltaDiscoveryResponse.
const responseResources protowire.Number = 2

// Field numbers of envoy.service.discovery.v3.Resource and google.protobuf.Any.
const (
	resourceVersion_ protowire.Number = 1
	resourceAny      protowire.Number = 2
	resourceName     protowire.Number = 3
	anyTypeURL       protowire.Number = 1
	anyValue         protowire.Number = 2
)

// anySize is the encoded size of an Any holding raw as typeURL.
func anySize(typeURL string, raw []byte) int {
	return protowire.SizeTag(anyTypeURL) + protowire.SizeBytes(len(typeURL)) +
		protowire.SizeTag(anyValue) + protowire.SizeBytes(len(raw))
}

func appendAnyValue(b []byte, typeURL string, raw []byte) []byte {
	b = protowire.AppendTag(b, anyTypeURL, protowire.BytesType)
	b = protowire.AppendString(b, typeURL)
	b = protowire.AppendTag(b, anyValue, protowire.BytesType)
	return protowire.AppendBytes(b, raw)
}

// appendSotwResource appends one entry of DiscoveryResponse.resources: an
// Any holding raw.
func appendSotwResource(b []byte, typeURL string, raw []byte) []byte {
	b = protowire.AppendTag(b, responseResources, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(anySize(typeURL, raw)))
	return appendAnyValue(b, typeURL, raw)
}

func sotwResourceSize(typeURL string, raw []byte) int {
	return protowire.SizeTag(responseResources) + protowire.SizeBytes(anySize(typeURL, raw))
}

// appendDeltaResource appends one entry of DeltaDiscoveryResponse.resources:
// a Resource with its name, version and an Any holding raw.
func appendDeltaResource(b []byte, typeURL, name, version string, raw []byte) []byte {
	b = protowire.AppendTag(b, responseResources, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(deltaInnerSize(typeURL, name, version, raw)))
	b = protowire.AppendTag(b, resourceVersion_, protowire.BytesType)
	b = protowire.AppendString(b, version)
	b = protowire.AppendTag(b, resourceAny, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(anySize(typeURL, raw)))
	b = appendAnyValue(b, typeURL, raw)
	b = protowire.AppendTag(b, resourceName, protowire.BytesType)
	return protowire.AppendString(b, name)
}

func deltaInnerSize(typeURL, name, version string, raw []byte) int {
	return protowire.SizeTag(resourceVersion_) + protowire.SizeBytes(len(version)) +
		protowire.SizeTag(resourceAny) + protowire.SizeBytes(anySize(typeURL, raw)) +
		protowire.SizeTag(resourceName) + protowire.SizeBytes(len(name))
}

func deltaResourceSize(typeURL, name, version string, raw []byte) int {
	return protowire.SizeTag(responseResources) + protowire.SizeBytes(deltaInnerSize(typeURL, name, version, raw))
}

// sotwEnvelope returns a stream's own DiscoveryResponse carrying body.
func sotwEnvelope(typeURL, version string, body []byte) *discovery.DiscoveryResponse {
	out := &discovery.DiscoveryResponse{VersionInfo: version, TypeUrl: typeURL}
	if len(body) > 0 {
		out.ProtoReflect().SetUnknown(body)
	}
	return out
}

// deltaEnvelope returns a stream's own DeltaDiscoveryResponse carrying body.
// removed is shared and must not be modified.
func deltaEnvelope(typeURL, version string, body []byte, removed []string) *discovery.DeltaDiscoveryResponse {
	out := &discovery.DeltaDiscoveryResponse{SystemVersionInfo: version, TypeUrl: typeURL, RemovedResources: removed}
	if len(body) > 0 {
		out.ProtoReflect().SetUnknown(body)
	}
	return out
}

// bodyResources counts the resources of a response: those it holds as
// messages and those its body carries.
func bodyResources(m proto.Message, held int) int {
	b := m.ProtoReflect().GetUnknown()
	n := held
	for len(b) > 0 {
		num, typ, l := protowire.ConsumeField(b)
		if l < 0 {
			return n
		}
		if num == responseResources && typ == protowire.BytesType {
			n++
		}
		b = b[l:]
	}
	return n
}

// memoMaxNames bounds the responses a bodyMemo keeps: larger ones (a
// ztunnel's initial state) are rarely equal across streams and would hold
// megabytes.
const memoMaxNames = 256

// bodyMemo keeps the bodies built for one version of a cache, by content,
// for the other streams that get the same response. Its user holds the
// cache's lock.
type bodyMemo struct {
	seq    uint64
	bodies map[string][]byte
}

// get returns the body kept under key at version seq, building it with
// build when none is.
func (m *bodyMemo) get(seq uint64, key string, build func() []byte) []byte {
	if m.seq != seq || m.bodies == nil {
		m.seq, m.bodies = seq, map[string][]byte{}
	}
	if b, ok := m.bodies[key]; ok {
		return b
	}
	b := build()
	m.bodies[key] = b
	return b
}
