package xds_test

import (
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	clusterservice "github.com/envoyproxy/go-control-plane/envoy/service/cluster/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	endpointservice "github.com/envoyproxy/go-control-plane/envoy/service/endpoint/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/stretchr/testify/require"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"

	"github.com/isthmus-mesh/isthmus/pilot/xds"
	"github.com/isthmus-mesh/isthmus/pilot/xds/xdstest"
)

// deltaPerType is the client side of a per-type delta stream (CDS, EDS).
type deltaPerType interface {
	Send(*discovery.DeltaDiscoveryRequest) error
	Recv() (*discovery.DeltaDiscoveryResponse, error)
}

// TestDeltaPerTypeStreams: the per-type delta services (EDS and CDS here)
// are served as the delta ADS stream is, through the same request decoding:
// a first request with a node, a NACK (decoded on a stack of its own) that
// keeps the stream, and a later subscription on it.
func TestDeltaPerTypeStreams(t *testing.T) {
	reg := xdstest.New()
	twoNetworks(reg)
	e := start(t, reg)
	cc := dial(t, e.addr)
	cn := xds.ClusterName(echoHost, 80)
	recv := func(s deltaPerType) *discovery.DeltaDiscoveryResponse {
		t.Helper()
		got := make(chan *discovery.DeltaDiscoveryResponse, 1)
		errs := make(chan error, 1)
		go func() {
			r, err := s.Recv()
			if err != nil {
				errs <- err
				return
			}
			got <- r
		}()
		select {
		case r := <-got:
			return r
		case err := <-errs:
			t.Fatalf("stream ended: %v", err)
		case <-time.After(waitFor):
			t.Fatalf("no response within %v", waitFor)
		}
		return nil
	}

	eds, err := endpointservice.NewEndpointDiscoveryServiceClient(cc).DeltaEndpoints(t.Context())
	require.NoError(t, err)
	require.NoError(t, eds.Send(&discovery.DeltaDiscoveryRequest{Node: node("envoy-1", "net1", "c1"), ResourceNamesSubscribe: []string{cn}}))
	r := recv(eds)
	require.Equal(t, resource.EndpointType, r.GetTypeUrl())
	require.Len(t, r.GetResources(), 1)
	require.Equal(t, cn, r.GetResources()[0].GetName())
	require.NoError(t, eds.Send(&discovery.DeltaDiscoveryRequest{ResponseNonce: r.GetNonce(), ErrorDetail: &rpcstatus.Status{Code: 3, Message: "rejected"}}))
	require.NoError(t, eds.Send(&discovery.DeltaDiscoveryRequest{ResourceNamesUnsubscribe: []string{cn}}))
	require.NoError(t, eds.Send(&discovery.DeltaDiscoveryRequest{ResourceNamesSubscribe: []string{cn}}))
	r = recv(eds)
	require.Len(t, r.GetResources(), 1, "the stream outlived its NACK")

	cds, err := clusterservice.NewClusterDiscoveryServiceClient(cc).DeltaClusters(t.Context())
	require.NoError(t, err)
	require.NoError(t, cds.Send(&discovery.DeltaDiscoveryRequest{Node: node("envoy-2", "net1", "c1")}))
	r = recv(cds)
	require.Equal(t, resource.ClusterType, r.GetTypeUrl())
	require.NotEmpty(t, r.GetResources())
}

// bytesCodec sends requests as the bytes given and keeps responses as bytes.
type bytesCodec struct{}

func (bytesCodec) Name() string                  { return "proto" }
func (bytesCodec) Marshal(v any) ([]byte, error) { return v.([]byte), nil }
func (bytesCodec) Unmarshal(b []byte, v any) error {
	*v.(*[]byte) = append([]byte(nil), b...)
	return nil
}

// TestDeltaRefusesMalformedRequests: a delta stream (ADS or per type) whose
// request is not a DeltaDiscoveryRequest ends with InvalidArgument, not
// cleanly as go-control-plane would end it.
func TestDeltaRefusesMalformedRequests(t *testing.T) {
	reg := xdstest.New()
	twoNetworks(reg)
	e := start(t, reg)
	cc := dial(t, e.addr)
	for _, method := range []string{
		"/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources",
		"/envoy.service.endpoint.v3.EndpointDiscoveryService/DeltaEndpoints",
	} {
		st, err := cc.NewStream(t.Context(), &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}, method, grpc.ForceCodec(bytesCodec{}))
		require.NoError(t, err)
		require.NoError(t, st.SendMsg([]byte{0x80})) // a truncated tag
		var out []byte
		err = st.RecvMsg(&out)
		require.Equal(t, codes.InvalidArgument, status.Code(err), "%s: %v", method, err)
	}
}
