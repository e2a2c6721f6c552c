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
func (s *Stream) Read(b []byte) (int, error) {
	n, err := s.body.Read(b)
	return n, wrapStreamErr(err)
}

// Write sends bytes to the server side.
func (s *Stream) Write(b []byte) (int, error) {
	n, err := s.pw.Write(b)
	return n, wrapStreamErr(err)
}

// StreamError is the error a Stream returns when its HTTP/2 stream fails;
// Unwrap gives the HTTP/2 error. Errors are wrapped so that no
// http2.StreamError value escapes a Stream: an HTTP/2 connection running
// over a Stream (double HBONE) would take such a value, returned by its
// own underlying reader, for an error of one of its streams and retry the
// read forever.
type StreamError struct{ Err error }

func (e *StreamError) Error() string { return "hbone stream: " + e.Err.Error() }
func (e *StreamError) Unwrap() error { return e.Err }

func wrapStreamErr(err error) error {
	if err == nil || err == io.EOF {
		return err
	}
	return &StreamError{Err: err}
}

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
