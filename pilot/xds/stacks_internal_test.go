package xds

import (
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/stretchr/testify/require"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// rawDeltaStream hands its requests to deltaStream as the server's codec
// does: still encoded.
type rawDeltaStream struct {
	discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesServer
	raw [][]byte
}

func (s *rawDeltaStream) RecvMsg(m any) error {
	b := s.raw[0]
	s.raw = s.raw[1:]
	return newCodec().Unmarshal(mem.BufferSlice{mem.SliceBuffer(b)}, m)
}

var _ grpc.ServerStream = (*rawDeltaStream)(nil)

// TestDeltaStreamDecodes: deltaStream decodes every request as protobuf
// does, ACKs in place and the others (a node, initial versions, a NACK's
// error) on a fresh stack, and refuses a malformed one with
// InvalidArgument.
func TestDeltaStreamDecodes(t *testing.T) {
	for _, c := range []struct {
		name    string
		req     *discovery.DeltaDiscoveryRequest
		shallow bool
	}{
		{"ACK", &discovery.DeltaDiscoveryRequest{TypeUrl: resource.EndpointType, ResponseNonce: "7"}, true},
		{"names", &discovery.DeltaDiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNamesSubscribe: []string{"a", "b"}, ResourceNamesUnsubscribe: []string{"c"}}, true},
		{"empty", &discovery.DeltaDiscoveryRequest{}, true},
		{"node", &discovery.DeltaDiscoveryRequest{Node: &corev3.Node{Id: "n", Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{
			MetadataNetwork: structpb.NewStringValue("net1"),
		}}}, TypeUrl: resource.ClusterType}, false},
		{"resume", &discovery.DeltaDiscoveryRequest{TypeUrl: resource.ClusterType, InitialResourceVersions: map[string]string{"a": "1"}}, false},
		{"NACK", &discovery.DeltaDiscoveryRequest{TypeUrl: resource.ClusterType, ResponseNonce: "3", ErrorDetail: &rpcstatus.Status{Code: 3, Message: "no"}}, false},
	} {
		raw, err := proto.Marshal(c.req)
		require.NoError(t, err)
		require.Equal(t, c.shallow, shallowDelta(raw), c.name)
		got, err := (&deltaStream{deltaStreamServer: &rawDeltaStream{raw: [][]byte{raw}}}).Recv()
		require.NoError(t, err, c.name)
		require.True(t, proto.Equal(c.req, got), "%s: got %v", c.name, got)
	}
	// A node is decoded into what the stream keeps of it; one sent twice
	// merges; an empty one is a node.
	envoy := realNode("envoy-1")
	for name, c := range map[string]struct {
		nodes []*corev3.Node
		want  *corev3.Node
	}{
		"real node":  {[]*corev3.Node{envoy}, keptNode(envoy)},
		"node twice": {[]*corev3.Node{{Id: "a"}, {Cluster: "c"}}, &corev3.Node{Id: "a", Cluster: "c"}},
		"empty node": {[]*corev3.Node{{}}, &corev3.Node{}},
	} {
		raw, err := proto.Marshal(&discovery.DeltaDiscoveryRequest{TypeUrl: resource.ClusterType, ResponseNonce: "1"})
		require.NoError(t, err)
		for _, n := range c.nodes {
			b, err := proto.Marshal(&discovery.DeltaDiscoveryRequest{Node: n})
			require.NoError(t, err)
			raw = append(raw, b...)
		}
		got, err := (&deltaStream{deltaStreamServer: &rawDeltaStream{raw: [][]byte{raw}}}).Recv()
		require.NoError(t, err, name)
		require.True(t, proto.Equal(&discovery.DeltaDiscoveryRequest{Node: c.want, TypeUrl: resource.ClusterType, ResponseNonce: "1"}, got), "%s: got %v", name, got)
	}
	good, err := proto.Marshal(&discovery.DeltaDiscoveryRequest{TypeUrl: resource.ClusterType})
	require.NoError(t, err)
	for _, c := range []struct {
		name    string
		raw     []byte
		shallow bool
	}{
		{"truncated", good[:len(good)-1], false},
		{"bad tag", []byte{0x80}, false},
		{"invalid UTF-8", []byte{0x12, 0x02, 0xff, 0xfe}, true},
		{"node id not UTF-8", []byte{0x0a, 0x04, 0x0a, 0x02, 0xff, 0xfe}, false},
	} {
		require.Equal(t, c.shallow, shallowDelta(c.raw), c.name)
		_, err := (&deltaStream{deltaStreamServer: &rawDeltaStream{raw: [][]byte{c.raw}}}).Recv()
		require.Equal(t, codes.InvalidArgument, status.Code(err), "%s: %v", c.name, err)
	}
}

// TestNodeClaims: a stream's claims are the first node's id, cluster,
// network and node name, kept apart from the node; any other metadata may
// change.
func TestNodeClaims(t *testing.T) {
	mk := func(id string, kv ...string) *corev3.Node {
		n := &corev3.Node{Id: id, Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{}}}
		for i := 0; i < len(kv); i += 2 {
			n.Metadata.Fields[kv[i]] = structpb.NewStringValue(kv[i+1])
		}
		return n
	}
	first := mk("a", MetadataClusterID, "c1", MetadataNetwork, "net1", "LABELS", "x")
	c := claimsOf(first)
	setMetadata(first, MetadataNetwork, "pinned") // authorization pins the node, not the claims
	require.True(t, c.match(mk("a", MetadataClusterID, "c1", MetadataNetwork, "net1", "LABELS", "y")))
	require.False(t, c.match(mk("b", MetadataClusterID, "c1", MetadataNetwork, "net1")), "id")
	require.False(t, c.match(mk("a", MetadataClusterID, "c2", MetadataNetwork, "net1")), "cluster")
	require.False(t, c.match(mk("a", MetadataClusterID, "c1")), "network dropped")
	require.False(t, c.match(mk("a", MetadataClusterID, "c1", MetadataNetwork, "net1", MetadataNodeName, "n1")), "node name added")
	require.True(t, claimsOf(&corev3.Node{}).match(&corev3.Node{}), "a node claiming nothing")
}

// TestByType: values by type URL, overwritten in place.
func TestByType(t *testing.T) {
	var m byType[string]
	require.Equal(t, "", m.get(resource.ClusterType))
	m.set(resource.ClusterType, "1")
	m.set(resource.EndpointType, "2")
	m.set(resource.ClusterType, "3")
	require.Len(t, m, 2)
	require.Equal(t, "3", m.get(resource.ClusterType))
	require.Equal(t, "2", m.get(resource.EndpointType))
}
