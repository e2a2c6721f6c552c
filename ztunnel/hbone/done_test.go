package hbone

import (
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/internal/testca"
)

// TestUpstreamDone: Upstream.Done is called once per stream, after it
// ended, with the bytes each way and no error for a clean end; a stream
// the client resets ends with an error.
func TestUpstreamDone(t *testing.T) {
	ca, err := testca.New("cluster.local")
	require.NoError(t, err)
	certs := identity.NewCache(ca)
	echo := startEchoTCP(t)
	results := make(chan StreamResult, 4)
	srv, err := NewServer(ServerConfig{HalfCloseTimeout: time.Minute}, ServerDeps{
		Certs: certs,
		Select: func(ctx context.Context, _ netip.Addr) (*tls.Certificate, error) {
			return certs.Certificate(ctx, serverID)
		},
		Handler: HandlerFunc(func(ctx context.Context, req *Request) (Upstream, error) {
			var d net.Dialer
			c, err := d.DialContext(ctx, "tcp", req.Authority)
			return Upstream{Conn: c, Done: func(r StreamResult) { results <- r }}, err
		}),
	})
	require.NoError(t, err)
	ln, err := net.Listen("tcp", netip.AddrPortFrom(loopback, 0).String())
	require.NoError(t, err)
	addr, _ := AddrPortOf(ln.Addr())
	var wg sync.WaitGroup
	wg.Go(func() { _ = srv.Serve(ln) })
	client, err := NewClient(ClientConfig{}, ClientDeps{Certs: certs})
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, client.Close())
		require.NoError(t, srv.Close())
		wg.Wait()
	})
	dial := func() *Stream {
		s, err := client.Dial(t.Context(), DialRequest{Source: clientID, Peers: []identity.Identity{serverID}, Addr: addr, Authority: echo.String()})
		require.NoError(t, err)
		return s
	}

	s := dial()
	_, err = s.Write([]byte("hello, done"))
	require.NoError(t, err)
	require.NoError(t, s.CloseWrite())
	got, err := io.ReadAll(s)
	require.NoError(t, err)
	require.Equal(t, "hello, done", string(got))
	require.NoError(t, s.Close())
	r := <-results
	require.Equal(t, StreamResult{Received: 11, Sent: 11}, r)

	s = dial()
	roundTrip(t, s, "abc")
	require.NoError(t, s.Close()) // a reset: the request direction never ends cleanly
	r = <-results
	require.Error(t, r.Err)
	require.EqualValues(t, 3, r.Received)
	require.EqualValues(t, 3, r.Sent)
	select {
	case extra := <-results:
		t.Fatalf("Done called again: %+v", extra)
	default:
	}
}
