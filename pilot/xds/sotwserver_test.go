package xds_test

import (
	"context"
	"io"
	"net"
	"testing"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	endpointservice "github.com/envoyproxy/go-control-plane/envoy/service/endpoint/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/isthmus-mesh/isthmus/pilot/xds"
	"github.com/isthmus-mesh/isthmus/pilot/xds/xdstest"
)

// TestSotwStreamRules: over the wire, an ADS request without a type URL
// ends the stream with InvalidArgument; a per-type stream's requests
// without one are of its type; a NACK (a request the server decodes in
// full) and a stale request keep the stream.
func TestSotwStreamRules(t *testing.T) {
	reg := xdstest.New()
	twoNetworks(reg)
	e := start(t, reg)
	cc := dial(t, e.addr)
	cn := xds.ClusterName(echoHost, 80)

	ads := openSotw(t, cc, node("envoy-1", "net1", "c1"))
	ads.send(&discovery.DiscoveryRequest{ResourceNames: []string{cn}})
	<-ads.done
	_, err := ads.stream.Recv()
	require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	eds, err := endpointservice.NewEndpointDiscoveryServiceClient(cc).StreamEndpoints(ctx)
	require.NoError(t, err)
	require.NoError(t, eds.Send(&discovery.DiscoveryRequest{Node: node("envoy-2", "net1", "c1"), ResourceNames: []string{cn}}))
	r, err := eds.Recv()
	require.NoError(t, err)
	require.Equal(t, resource.EndpointType, r.GetTypeUrl())
	require.Len(t, r.GetResources(), 1)
	// A stale request (an unknown nonce) is ignored; a NACK of the last
	// response is recorded, and, having no version, is answered.
	require.NoError(t, eds.Send(&discovery.DiscoveryRequest{ResourceNames: []string{cn}, ResponseNonce: "stale"}))
	require.NoError(t, eds.Send(&discovery.DiscoveryRequest{ResourceNames: []string{cn}, ResponseNonce: r.GetNonce(),
		ErrorDetail: status.New(codes.InvalidArgument, "rejected").Proto()}))
	again, err := eds.Recv()
	require.NoError(t, err)
	require.NotEqual(t, r.GetNonce(), again.GetNonce())
	require.Equal(t, resource.EndpointType, again.GetTypeUrl())
	require.Equal(t, "rejected", typeStatus(e, "envoy-2", resource.EndpointType).LastNack.Message)
}

// TestSotwWithGRPCsCodec: a gRPC server built without xds.ServerOptions
// still serves SotW streams (requests then arrive decoded by protobuf, as
// unknown fields).
func TestSotwWithGRPCsCodec(t *testing.T) {
	reg := xdstest.New()
	twoNetworks(reg)
	e := startGRPC(t, reg, xds.Config{AllowPlaintext: true})
	c := openSotw(t, dial(t, e.addr), node("envoy-1", "net1", "c1"))
	c.send(&discovery.DiscoveryRequest{TypeUrl: resource.ClusterType})
	r := c.next(resource.ClusterType)
	clusters := unpack[clusterv3.Cluster](t, r)
	require.Len(t, clusters, 1)
	c.ack(r)
	c.send(&discovery.DiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNames: []string{clusters[0].GetName()}})
	require.Len(t, c.next(resource.EndpointType).GetResources(), 1)
}

// TestStreamsEndWhenTheServerStops: when Server.Run ends, an open SotW or
// delta stream ends cleanly (the client reads io.EOF) while the gRPC server
// and the client's connection stay up.
func TestStreamsEndWhenTheServerStops(t *testing.T) {
	cn := xds.ClusterName(echoHost, 80)
	for _, c := range []struct {
		name string
		// open opens a stream, gets a first response, and returns a receive.
		open func(t *testing.T, cc *grpc.ClientConn) func() error
	}{
		{"sotw", func(t *testing.T, cc *grpc.ClientConn) func() error {
			stream, err := discovery.NewAggregatedDiscoveryServiceClient(cc).StreamAggregatedResources(t.Context())
			require.NoError(t, err)
			require.NoError(t, stream.Send(&discovery.DiscoveryRequest{Node: node("envoy-1", "net1", "c1"), TypeUrl: resource.EndpointType, ResourceNames: []string{cn}}))
			r, err := stream.Recv()
			require.NoError(t, err)
			require.Equal(t, resource.EndpointType, r.GetTypeUrl())
			return func() error { _, err := stream.Recv(); return err }
		}},
		{"delta", func(t *testing.T, cc *grpc.ClientConn) func() error {
			stream, err := discovery.NewAggregatedDiscoveryServiceClient(cc).DeltaAggregatedResources(t.Context())
			require.NoError(t, err)
			require.NoError(t, stream.Send(&discovery.DeltaDiscoveryRequest{Node: node("envoy-1", "net1", "c1"), TypeUrl: resource.EndpointType, ResourceNamesSubscribe: []string{cn}}))
			r, err := stream.Recv()
			require.NoError(t, err)
			require.Equal(t, resource.EndpointType, r.GetTypeUrl())
			return func() error { _, err := stream.Recv(); return err }
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			reg := xdstest.New()
			twoNetworks(reg)
			srv, err := xds.New(xds.Config{AllowPlaintext: true, Metrics: prometheus.NewRegistry()}, reg, testLogger(t))
			require.NoError(t, err)
			lis, err := net.Listen("tcp", "127.0.0.1:0")
			require.NoError(t, err)
			gs := grpc.NewServer(xds.ServerOptions()...)
			srv.Register(gs)
			served := make(chan struct{})
			go func() {
				defer close(served)
				_ = gs.Serve(lis)
			}()
			t.Cleanup(func() {
				gs.Stop()
				<-served
			})
			ctx, cancel := context.WithCancel(t.Context())
			ran := make(chan error, 1)
			go func() { ran <- srv.Run(ctx) }()

			recv := c.open(t, dial(t, lis.Addr().String()))
			cancel()
			require.NoError(t, <-ran)
			ended := make(chan error, 1)
			go func() { ended <- recv() }()
			select {
			case err := <-ended:
				require.ErrorIs(t, err, io.EOF, "the stream ends cleanly when the server stops")
			case <-time.After(waitFor):
				t.Fatalf("the stream is still open %v after the server stopped", waitFor)
			}
		})
	}
}
