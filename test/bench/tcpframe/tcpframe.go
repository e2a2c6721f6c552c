// Package tcpframe carries messages over a plain TCP connection, each
// prefixed by its length: the fan-out benchmark's raw-TCP floor, the same
// xDS exchange as over gRPC with no HTTP/2 and no gRPC in between.
package tcpframe

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"net"
)

// MaxMessage is the largest message Read accepts.
const MaxMessage = 64 << 20

// Conn reads and writes length-prefixed messages. One goroutine may read
// while another writes.
type Conn struct {
	conn net.Conn
	r    *bufio.Reader
	hdr  [4]byte
}

// New wraps c.
func New(c net.Conn) *Conn { return &Conn{conn: c, r: bufio.NewReaderSize(c, 4096)} }

// Write sends b as one message, header and body in one system call.
func (c *Conn) Write(b []byte) error {
	var hdr [4]byte
	binary.BigEndian.PutUint32(hdr[:], uint32(len(b)))
	bufs := net.Buffers{hdr[:], b}
	_, err := bufs.WriteTo(c.conn)
	return err
}

// Read returns the next message, in a slice of its own.
func (c *Conn) Read() ([]byte, error) {
	if _, err := io.ReadFull(c.r, c.hdr[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(c.hdr[:])
	if n > MaxMessage {
		return nil, fmt.Errorf("tcpframe: a message of %d bytes, more than %d", n, MaxMessage)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(c.r, b); err != nil {
		return nil, err
	}
	return b, nil
}

// Close closes the connection.
func (c *Conn) Close() error { return c.conn.Close() }
