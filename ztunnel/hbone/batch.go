package hbone

import (
	"crypto/tls"
	"net"
	"sync"
)

// batchSize bounds the bytes a batchConn gathers before writing them:
// sixteen full TLS 1.3 records (16 KiB of plaintext plus 22 bytes of
// framing each), so that a LargeBufferSize relay chunk written as one DATA
// frame leaves in one syscall.
const batchSize = 16 * (16<<10 + 22)

var batchPool = sync.Pool{New: func() any { b := make([]byte, 0, batchSize); return &b }}

// batchConn sits under a tls.Conn. crypto/tls writes every record of one
// Conn.Write with its own write to the socket (one syscall per 16 KiB);
// between begin and end, batchConn gathers those writes in a pooled buffer
// and writes them with one syscall per batchSize bytes. Outside a batch
// (handshake, alerts, key updates sent by the read side) it writes through.
// It is safe for concurrent use.
type batchConn struct {
	net.Conn

	mu    sync.Mutex
	depth int
	buf   *[]byte
	err   error
}

// Write writes p now, or adds it to the current batch.
func (b *batchConn) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.err != nil {
		return 0, b.err
	}
	if b.depth == 0 {
		return b.Conn.Write(p)
	}
	if b.buf == nil {
		b.buf = batchPool.Get().(*[]byte)
	}
	if len(*b.buf)+len(p) > cap(*b.buf) {
		if err := b.flushLocked(); err != nil {
			return 0, err
		}
		if len(p) > cap(*b.buf) {
			n, err := b.Conn.Write(p)
			b.err = err
			return n, err
		}
	}
	*b.buf = append(*b.buf, p...)
	return len(p), nil
}

func (b *batchConn) begin() {
	b.mu.Lock()
	b.depth++
	b.mu.Unlock()
}

// end closes a batch; the last open batch writes what was gathered.
func (b *batchConn) end() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.depth--
	if b.depth > 0 || b.buf == nil {
		return b.err
	}
	err := b.flushLocked()
	*b.buf = (*b.buf)[:0]
	batchPool.Put(b.buf)
	b.buf = nil
	return err
}

func (b *batchConn) flushLocked() error {
	if b.err != nil {
		return b.err
	}
	if len(*b.buf) > 0 {
		_, b.err = b.Conn.Write(*b.buf)
		*b.buf = (*b.buf)[:0]
	}
	return b.err
}

// tlsConn is a *tls.Conn over a batchConn whose Write sends all records of
// one call in as few syscalls as possible.
type tlsConn struct {
	*tls.Conn
	bc *batchConn
}

// newTLSConn wraps raw for TLS; client selects the side.
func newTLSConn(raw net.Conn, cfg *tls.Config, client bool) *tlsConn {
	bc := &batchConn{Conn: raw}
	var tc *tls.Conn
	if client {
		tc = tls.Client(bc, cfg)
	} else {
		tc = tls.Server(bc, cfg)
	}
	return &tlsConn{Conn: tc, bc: bc}
}

// Write encrypts p and writes its records in batches.
func (c *tlsConn) Write(p []byte) (int, error) {
	c.bc.begin()
	n, err := c.Conn.Write(p)
	if ferr := c.bc.end(); err == nil && ferr != nil {
		err = ferr
		n = 0
	}
	return n, err
}
