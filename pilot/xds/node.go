package xds

import (
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// A stream keeps of its node only what pilot reads: the id, the cluster,
// the locality (which orders EDS endpoints into priorities), the user
// agent name (which kind of client it is, clientKind), and the
// string values of the metadata keys in keptMetadata. A real
// Envoy's node also lists every extension compiled into it
// (node.extensions: 10–20 KB encoded, several times that decoded), its
// build and client features, and Istio's metadata adds labels,
// annotations and platform data. Kept whole for the life of a stream, it
// would cost pilot more per idle client than everything else the stream
// holds. A value pilot reads as a string and that is not one reads as ""
// either way.

// keptMetadata are the node metadata keys pilot reads.
var keptMetadata = [...]string{MetadataClusterID, MetadataNetwork, MetadataNodeName, MetadataVerifiedNode, MetadataGenerator, MetadataProxylessTLS}

// keptNode returns what a stream keeps of node n (nil: nil).
func keptNode(n *corev3.Node) *corev3.Node {
	if n == nil {
		return nil
	}
	out := &corev3.Node{Id: n.GetId(), Cluster: n.GetCluster(), UserAgentName: n.GetUserAgentName()}
	if l := n.GetLocality(); l != nil {
		out.Locality = &corev3.Locality{Region: l.GetRegion(), Zone: l.GetZone(), SubZone: l.GetSubZone()}
	}
	fields := n.GetMetadata().GetFields()
	for _, k := range keptMetadata {
		v, ok := fields[k]
		if !ok {
			continue
		}
		if out.Metadata == nil {
			out.Metadata = &structpb.Struct{Fields: make(map[string]*structpb.Value, len(keptMetadata))}
		}
		out.Metadata.Fields[k] = structpb.NewStringValue(v.GetStringValue())
	}
	return out
}
