package server

import (
	"context"
	"io"
	"net"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// pingsPerRequests serves gRPC health checks with opts on loopback, makes n
// requests, each a DATA frame the server reads as an ACK would be, and
// returns how many PINGs (not ACKs of the client's) the server sent.
func pingsPerRequests(t *testing.T, n int, opts ...grpc.ServerOption) int64 {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	gs := grpc.NewServer(opts...)
	healthpb.RegisterHealthServer(gs, health.NewServer())
	served := make(chan error, 1)
	go func() { served <- gs.Serve(ln) }()
	defer func() {
		gs.Stop()
		require.NoError(t, <-served)
	}()

	var pings atomic.Int64
	parsed := make(chan struct{})
	dial := func(ctx context.Context, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, err
		}
		pr, pw := io.Pipe()
		go func() {
			defer close(parsed)
			fr := http2.NewFramer(io.Discard, pr)
			for {
				f, err := fr.ReadFrame()
				if err != nil {
					_ = pr.CloseWithError(err)
					return
				}
				if p, ok := f.(*http2.PingFrame); ok && !p.IsAck() {
					pings.Add(1)
				}
			}
		}()
		return &teeConn{Conn: c, w: pw}, nil
	}
	cc, err := grpc.NewClient("passthrough:///"+ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(dial),
		// The client's own windows are fixed, so that every PING counted is
		// the server's.
		grpc.WithStaticStreamWindowSize(1<<20), grpc.WithStaticConnWindowSize(1<<20))
	require.NoError(t, err)
	hc := healthpb.NewHealthClient(cc)
	for range n {
		_, err := hc.Check(t.Context(), &healthpb.HealthCheckRequest{})
		require.NoError(t, err)
	}
	require.NoError(t, cc.Close())
	<-parsed
	return pings.Load()
}

// teeConn copies what it reads to w.
type teeConn struct {
	net.Conn
	w *io.PipeWriter
}

func (c *teeConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if n > 0 {
		if _, werr := c.w.Write(b[:n]); werr != nil {
			return n, err
		}
	}
	if err != nil {
		_ = c.w.CloseWithError(err)
	}
	return n, err
}

func (c *teeConn) Close() error {
	_ = c.w.Close()
	return c.Conn.Close()
}

// TestNoPingPerRequest: pilot's gRPC servers (GRPCLimits.options) answer
// requests with no PING of their own, where gRPC's default flow control
// sends one after most requests to estimate the bandwidth (the control
// shows the counting works).
func TestNoPingPerRequest(t *testing.T) {
	const n = 20
	require.Greater(t, pingsPerRequests(t, n), int64(n/2), "gRPC's default server pings after most requests")
	require.Zero(t, pingsPerRequests(t, n, GRPCLimits{}.withDefaults().options(nil, nil)...), "pilot's does not")
}
