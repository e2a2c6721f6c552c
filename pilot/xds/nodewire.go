package xds

import (
	"errors"
	"unicode/utf8"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/structpb"
)

// A node is decoded straight into what a stream keeps of it (keptNode),
// after checking its encoding as protobuf checks it. Decoding a real
// Envoy's 26 KB node with protobuf makes about 70 KB of objects that die
// at once; the few a stream kept from among them held the partly used
// heap spans they shared with that garbage, about 10 KB per stream (the
// fan-out benchmark's eighth pass). validate walks the encoding by the
// message's descriptor, allocating nothing, and refuses exactly what
// protobuf's decoder refuses: malformed wire data, field numbers out of
// range, strings that are not UTF-8 where the field requires it, nesting
// deeper than protobuf's recursion limit. A known field with another wire
// type than its own is an unknown field to protobuf, and to validate.

var (
	errWire      = errors.New("cannot parse invalid wire-format data")
	errUTF8      = errors.New("string field contains invalid UTF-8")
	errRecursion = errors.New("exceeded maximum recursion depth")
)

var nodeDescriptor = (&corev3.Node{}).ProtoReflect().Descriptor()

// Field numbers of envoy.config.core.v3.Node, google.protobuf.Struct (and
// its map entry) and google.protobuf.Value read by decodeKeptNode.
const (
	nodeID, nodeCluster, nodeMetadata   protowire.Number = 1, 2, 3
	nodeLocality                        protowire.Number = 4
	localityRegion, localityZone        protowire.Number = 1, 2
	localitySubZone                     protowire.Number = 3
	nodeUserAgentName                   protowire.Number = 6
	structFields, entryKey, entryValue  protowire.Number = 1, 1, 2
	valueNull, valueNumber, valueString protowire.Number = 1, 2, 3
	valueBool, valueStruct, valueList   protowire.Number = 4, 5, 6
)

// decodeKeptNode returns keptNode of the node encoded in parts: one
// encoding, or those of a node field sent several times, which protobuf
// checks one by one and merges.
func decodeKeptNode(parts ...[]byte) (*corev3.Node, error) {
	for _, raw := range parts {
		if err := validate(nodeDescriptor, raw, protowire.DefaultRecursionLimit); err != nil {
			return nil, err
		}
	}
	var id, cluster, agent []byte
	var kept [len(keptMetadata)]keptValue
	var loc keptLocality
	for _, raw := range parts {
		keepFields(raw, &id, &cluster, &agent, &kept, &loc)
	}
	out := &corev3.Node{Id: string(id), Cluster: string(cluster), UserAgentName: string(agent)}
	if loc.present {
		out.Locality = &corev3.Locality{Region: string(loc.region), Zone: string(loc.zone), SubZone: string(loc.subzone)}
	}
	for i, k := range kept {
		if !k.present {
			continue
		}
		if out.Metadata == nil {
			out.Metadata = &structpb.Struct{Fields: make(map[string]*structpb.Value, len(keptMetadata))}
		}
		out.Metadata.Fields[keptMetadata[i]] = structpb.NewStringValue(string(k.s))
	}
	return out, nil
}

// keepFields reads what a stream keeps from one encoding of a node, over
// what earlier ones gave: the last id, cluster and user agent name, the
// last entry of each kept metadata key, the locality merged.
func keepFields(raw []byte, id, cluster, agent *[]byte, kept *[len(keptMetadata)]keptValue, loc *keptLocality) {
	eachBytesField(raw, func(num protowire.Number, v []byte) {
		switch num {
		case nodeID:
			*id = v
		case nodeCluster:
			*cluster = v
		case nodeLocality:
			// Sent twice, it merges: the last of each field wins.
			loc.present = true
			eachBytesField(v, func(num protowire.Number, s []byte) {
				switch num {
				case localityRegion:
					loc.region = s
				case localityZone:
					loc.zone = s
				case localitySubZone:
					loc.subzone = s
				}
			})
		case nodeUserAgentName:
			*agent = v
		case nodeMetadata:
			// A message field sent twice merges: its map entries add up,
			// the last of a key replacing the others.
			eachBytesField(v, func(num protowire.Number, entry []byte) {
				if num == structFields {
					keepEntry(entry, kept)
				}
			})
		}
	})
}

// keptLocality is the node's locality: present, and its fields.
type keptLocality struct {
	present               bool
	region, zone, subzone []byte
}

// keptValue is a kept metadata key's value: present, and its string (empty
// unless the value is a string).
type keptValue struct {
	present bool
	s       []byte
}

// keepEntry records a Struct map entry whose key is kept.
func keepEntry(entry []byte, kept *[len(keptMetadata)]keptValue) {
	var key []byte
	var values [][]byte // the value's occurrences, merged in order
	eachBytesField(entry, func(num protowire.Number, v []byte) {
		switch num {
		case entryKey:
			key = v
		case entryValue:
			values = append(values, v)
		}
	})
	for i, k := range keptMetadata {
		if string(key) != k {
			continue
		}
		// The value's kind is its last kind field; only a string is kept.
		kv := keptValue{present: true}
		for _, v := range values {
			eachField(v, func(num protowire.Number, typ protowire.Type, content []byte) {
				switch {
				case num == valueString && typ == protowire.BytesType:
					kv.s = content
				case num == valueNull && typ == protowire.VarintType, num == valueNumber && typ == protowire.Fixed64Type,
					num == valueBool && typ == protowire.VarintType,
					(num == valueStruct || num == valueList) && typ == protowire.BytesType:
					kv.s = nil
				}
			})
		}
		kept[i] = kv
	}
}

// eachField calls f with each field of b, which validate checked, and the
// content of a length-delimited one.
func eachField(b []byte, f func(num protowire.Number, typ protowire.Type, content []byte)) {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		b = b[n:]
		m := protowire.ConsumeFieldValue(num, typ, b)
		content := b[:m]
		if typ == protowire.BytesType {
			content, _ = protowire.ConsumeBytes(content)
		}
		f(num, typ, content)
		b = b[m:]
	}
}

// eachBytesField calls f with each length-delimited field of b.
func eachBytesField(b []byte, f func(num protowire.Number, v []byte)) {
	eachField(b, func(num protowire.Number, typ protowire.Type, content []byte) {
		if typ == protowire.BytesType {
			f(num, content)
		}
	})
}

// validate checks b as protobuf would decode it as a message md, depth
// levels from its recursion limit.
func validate(md protoreflect.MessageDescriptor, b []byte, depth int) error {
	if depth--; depth < 0 {
		return errRecursion
	}
	fields := md.Fields()
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 || num > protowire.MaxValidNumber || typ == protowire.EndGroupType {
			return errWire
		}
		b = b[n:]
		m := protowire.ConsumeFieldValue(num, typ, b)
		if m < 0 {
			return errWire
		}
		if fd := fields.ByNumber(num); fd != nil {
			if err := validateField(fd, typ, b[:m], depth); err != nil {
				return err
			}
		}
		b = b[m:]
	}
	return nil
}

// validateField checks the value v of known field fd sent as typ.
func validateField(fd protoreflect.FieldDescriptor, typ protowire.Type, v []byte, depth int) error {
	if typ != protowire.BytesType {
		return nil // scalars: ConsumeFieldValue checked them; another type: unknown
	}
	content, _ := protowire.ConsumeBytes(v)
	switch fd.Kind() {
	case protoreflect.StringKind:
		if enforceUTF8(fd) && !utf8.Valid(content) {
			return errUTF8
		}
	case protoreflect.MessageKind:
		return validate(fd.Message(), content, depth)
	case protoreflect.BytesKind, protoreflect.GroupKind:
	default:
		if fd.IsList() {
			return validatePacked(fd.Kind(), content)
		}
	}
	return nil
}

// validatePacked checks packed repeated scalars of kind k.
func validatePacked(k protoreflect.Kind, b []byte) error {
	typ := protowire.VarintType
	switch k {
	case protoreflect.Fixed32Kind, protoreflect.Sfixed32Kind, protoreflect.FloatKind:
		typ = protowire.Fixed32Type
	case protoreflect.Fixed64Kind, protoreflect.Sfixed64Kind, protoreflect.DoubleKind:
		typ = protowire.Fixed64Type
	}
	for len(b) > 0 {
		n := protowire.ConsumeFieldValue(1, typ, b)
		if n < 0 {
			return errWire
		}
		b = b[n:]
	}
	return nil
}

// enforceUTF8 reports whether protobuf checks fd's strings for UTF-8, as
// its decoder decides it.
func enforceUTF8(fd protoreflect.FieldDescriptor) bool {
	if fd.Syntax() == protoreflect.Editions {
		if e, ok := fd.(interface{ EnforceUTF8() bool }); ok {
			return e.EnforceUTF8()
		}
	}
	return fd.Syntax() == protoreflect.Proto3
}
