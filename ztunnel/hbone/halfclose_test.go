package hbone

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"io"
	"net"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/stretchr/testify/require"
)

// halfClosingApp accepts one connection, writes greeting, half-closes its
// write side, then reads until EOF and sends what it read on got.
func halfClosingApp(t *testing.T, greeting string) (netip.AddrPort, <-chan []byte) {
	ln, err := net.Listen("tcp", netip.AddrPortFrom(loopback, 0).String())
	require.NoError(t, err)
	got := make(chan []byte, 1)
	var wg sync.WaitGroup
	wg.Go(func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(20 * time.Second))
		_, _ = c.Write([]byte(greeting))
		_ = c.(*net.TCPConn).CloseWrite()
		b, _ := io.ReadAll(c)
		got <- b
	})
	t.Cleanup(func() {
		ln.Close()
		wg.Wait()
	})
	ap, _ := AddrPortOf(ln.Addr())
	return ap, got
}

func TestHalfCloseServerToClientKeepsUpload(t *testing.T) {
	e := newEnv(t, ClientConfig{})
	app, got := halfClosingApp(t, "bye")
	s, err := e.client.Dial(t.Context(), DialRequest{Source: clientID, Peers: []identity.Identity{serverID}, Addr: e.addr, Authority: app.String()})
	require.NoError(t, err)
	defer s.Close()

	b := make([]byte, 3)
	_, err = io.ReadFull(s, b)
	require.NoError(t, err)
	require.Equal(t, "bye", string(b))

	// The app has ended its direction; the client keeps uploading, in
	// pieces, well after the server saw that EOF.
	upload := bytes.Repeat([]byte("0123456789abcdef"), 256<<10) // 4 MiB
	for chunk := range slices.Chunk(upload, 64<<10) {
		_, err := s.Write(chunk)
		require.NoError(t, err)
	}
	require.NoError(t, s.CloseWrite())

	// The response ends cleanly once the client half-closed.
	rest, err := io.ReadAll(s)
	require.NoError(t, err)
	require.Empty(t, rest)
	select {
	case b := <-got:
		require.Equal(t, len(upload), len(b))
		require.Equal(t, sha256.Sum256(upload), sha256.Sum256(b))
	case <-time.After(10 * time.Second):
		t.Fatal("app did not receive the upload")
	}
}

func TestHalfCloseServerToClientEndsWhenClientIsSilent(t *testing.T) {
	e := newEnvConfig(t, ServerConfig{HalfCloseTimeout: 100 * time.Millisecond}, ClientConfig{})
	app, got := halfClosingApp(t, "bye")
	s, err := e.client.Dial(t.Context(), DialRequest{Source: clientID, Peers: []identity.Identity{serverID}, Addr: e.addr, Authority: app.String()})
	require.NoError(t, err)
	defer s.Close()
	_, err = s.Write([]byte("request"))
	require.NoError(t, err)
	// The client never half-closes: the response still ends (EOF) once the
	// client has been silent for HalfCloseTimeout.
	type result struct {
		b   []byte
		err error
	}
	read := make(chan result, 1)
	go func() {
		b, err := io.ReadAll(s)
		read <- result{b, err}
	}()
	select {
	case r := <-read:
		require.NoError(t, r.err)
		require.Equal(t, "bye", string(r.b))
	case <-time.After(10 * time.Second):
		t.Fatal("the response never ended")
	}
	s.Close()
	select {
	case b := <-got:
		require.Equal(t, "request", string(b))
	case <-time.After(10 * time.Second):
		t.Fatal("app connection was not closed")
	}
}

// TestResetOuterStreamEndsInnerStreams covers double HBONE: when the outer
// stream is reset, streams of the HTTP/2 connection running inside it must
// fail promptly. (x/net/http2 took an http2.StreamError returned by its
// underlying reader for one of its own streams and retried forever, with a
// goroutine spinning on a CPU.)
func TestResetOuterStreamEndsInnerStreams(t *testing.T) {
	inner := newEnv(t, ClientConfig{})
	upstreams := make(chan net.Conn, 1)
	gw, err := NewServer(ServerConfig{}, ServerDeps{
		Certs: inner.certs,
		Select: func(ctx context.Context, _ netip.Addr) (*tls.Certificate, error) {
			return inner.certs.Certificate(ctx, serverID)
		},
		Handler: HandlerFunc(func(ctx context.Context, _ *Request) (Upstream, error) {
			var d net.Dialer
			c, err := d.DialContext(ctx, "tcp", inner.addr.String())
			if err == nil {
				upstreams <- c
			}
			return Upstream{Conn: c}, err
		}),
	})
	require.NoError(t, err)
	ln, err := net.Listen("tcp", netip.AddrPortFrom(loopback, 0).String())
	require.NoError(t, err)
	gwAddr, _ := AddrPortOf(ln.Addr())
	var wg sync.WaitGroup
	wg.Go(func() { _ = gw.Serve(ln) })
	t.Cleanup(func() {
		require.NoError(t, gw.Close())
		wg.Wait()
	})

	// Two inner streams share one inner HTTP/2 connection over one outer
	// stream.
	req := DialRequest{
		Source: clientID, Peers: []identity.Identity{serverID}, Authority: inner.echo.String(), UnderlayKey: "via gw",
		Underlay: func(ctx context.Context) (net.Conn, string, error) {
			outer, err := inner.client.Dial(ctx, DialRequest{Source: clientID, Peers: []identity.Identity{serverID}, Addr: gwAddr, Authority: inner.addr.String()})
			return outer, "", err
		},
	}
	var streams []*Stream
	for _, msg := range []string{"first", "second"} {
		s, err := inner.client.Dial(t.Context(), req)
		require.NoError(t, err)
		defer s.Close()
		roundTrip(t, s, msg)
		streams = append(streams, s)
	}

	// The gateway's upstream fails: it resets the outer stream.
	(<-upstreams).Close()
	readErr := make(chan error, len(streams))
	for _, s := range streams {
		go func() {
			_, err := s.Read(make([]byte, 16))
			readErr <- err
		}()
	}
	for range streams {
		select {
		case err := <-readErr:
			require.Error(t, err)
		case <-time.After(5 * time.Second):
			t.Fatal("inner stream still open 5s after the outer stream was reset")
		}
	}
}
