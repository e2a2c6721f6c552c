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

// serverFrames is what a gRPC server sent a client: how many PINGs (not
// ACKs of the client's), and the settings it announced.
type serverFrames struct {
	pings    int64
	settings map[http2.SettingID]uint32
}

// framesPerRequests serves gRPC health checks with opts on loopback, makes n
// requests, each a DATA frame the server reads as an ACK would be, and
// returns what the server sent.
func framesPerRequests(t *testing.T, n int, opts ...grpc.ServerOption) serverFrames {
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
	settings := map[http2.SettingID]uint32{}
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
				switch f := f.(type) {
				case *http2.PingFrame:
					if !f.IsAck() {
						pings.Add(1)
					}
				case *http2.SettingsFrame:
					_ = f.ForeachSetting(func(s http2.Setting) error {
						settings[s.ID] = s.Val
						return nil
					})
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
	return serverFrames{pings: pings.Load(), settings: settings}
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
	require.Greater(t, framesPerRequests(t, n).pings, int64(n/2), "gRPC's default server pings after most requests")
	require.Zero(t, framesPerRequests(t, n, GRPCLimits{}.withDefaults().options(nil, nil)...).pings, "pilot's does not")
}

// TestNoHeaderTable: pilot's gRPC servers tell clients to index no request
// headers (HTTP/2's header table size 0), where gRPC's default lets each
// client fill 4 KB of the server's memory; a stream's headers come once.
func TestNoHeaderTable(t *testing.T) {
	_, set := framesPerRequests(t, 1).settings[http2.SettingHeaderTableSize]
	require.False(t, set, "gRPC's default server keeps HTTP/2's default table (4 KB)")
	size, set := framesPerRequests(t, 1, GRPCLimits{}.withDefaults().options(nil, nil)...).settings[http2.SettingHeaderTableSize]
	require.True(t, set, "pilot's announces a table size")
	require.Zero(t, size, "pilot's announces a table size of 0")
}
