package hbone

import (
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"sync"
	"time"
)

// Stream is one client CONNECT stream used as a net.Conn. Read and Write may
// be called concurrently with each other; CloseWrite half-closes (sends
// END_STREAM); Close ends the stream and frees its pool slot. Deadlines are
// not supported.
type Stream struct {
	c      *Client
	pc     *pooledConn
	pw     *io.PipeWriter
	body   io.ReadCloser
	header http.Header
	cancel context.CancelFunc
	local  net.Addr
	remote net.Addr
	once   sync.Once
}

var _ net.Conn = (*Stream)(nil)

// Read reads bytes sent by the server side.
func (s *Stream) Read(b []byte) (int, error) { return s.body.Read(b) }

// Write sends bytes to the server side.
func (s *Stream) Write(b []byte) (int, error) { return s.pw.Write(b) }

// CloseWrite ends the client->server direction.
func (s *Stream) CloseWrite() error { return s.pw.Close() }

// Close ends the stream in both directions. It is idempotent.
func (s *Stream) Close() error {
	s.once.Do(func() {
		s.pw.CloseWithError(net.ErrClosed)
		s.body.Close()
		s.cancel()
		s.c.release(s.pc)
	})
	return nil
}

// ResponseHeader returns the headers of the server's 200 response.
func (s *Stream) ResponseHeader() http.Header { return s.header }

// Label returns the label of the pooled connection carrying the stream.
func (s *Stream) Label() string { return s.pc.label }

// LocalAddr returns the local address of the underlying connection.
func (s *Stream) LocalAddr() net.Addr { return s.local }

// RemoteAddr returns the remote address of the underlying connection.
func (s *Stream) RemoteAddr() net.Addr { return s.remote }

// SetDeadline is not supported.
func (s *Stream) SetDeadline(time.Time) error { return os.ErrNoDeadline }

// SetReadDeadline is not supported.
func (s *Stream) SetReadDeadline(time.Time) error { return os.ErrNoDeadline }

// SetWriteDeadline is not supported.
func (s *Stream) SetWriteDeadline(time.Time) error { return os.ErrNoDeadline }
