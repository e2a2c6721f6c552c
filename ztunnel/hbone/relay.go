package hbone

import (
	"errors"
	"io"
	"net"
	"net/netip"
	"sync"
	"syscall"
)

// BufferSize is the size of the pooled relay buffers used while data flows.
const BufferSize = 64 << 10

// LargeBufferSize is the buffer a relay direction moves to while it carries
// bulk data (a read filled a BufferSize buffer), until a read returns less
// than BufferSize. Each chunk written to an HTTP/2 response crosses three
// goroutines in x/net/http2 (handler, serve loop, frame writer) and each
// chunk written to a socket costs a wake-up of its reader, so larger chunks
// cut the hand-offs per byte (see ztunnel/BENCHMARKS.md); directions that
// carry small messages keep the smaller buffer.
const LargeBufferSize = 256 << 10

var (
	bufPool   = sync.Pool{New: func() any { b := make([]byte, BufferSize); return &b }}
	largePool = sync.Pool{New: func() any { b := make([]byte, LargeBufferSize); return &b }}
)

// getBuf returns a pooled BufferSize buffer, or a LargeBufferSize one if
// large is set.
func getBuf(large bool) *[]byte {
	if large {
		return largePool.Get().(*[]byte)
	}
	return bufPool.Get().(*[]byte)
}

// putBuf gives b back to the pool of its size.
func putBuf(b *[]byte) {
	if len(*b) == LargeBufferSize {
		largePool.Put(b)
	} else {
		bufPool.Put(b)
	}
}

// bulkAfter reports whether a direction carries bulk data after a read of n
// bytes into buf, given whether it did before.
func bulkAfter(bulk bool, n int, buf []byte) bool {
	if bulk {
		return n >= BufferSize
	}
	return n == len(buf)
}

// closeWriter is implemented by connections supporting half-close.
type closeWriter interface{ CloseWrite() error }

// CloseWrite half-closes c if it supports it, and closes it otherwise.
func CloseWrite(c net.Conn) error {
	if cw, ok := c.(closeWriter); ok {
		return cw.CloseWrite()
	}
	return c.Close()
}

// Relay copies bytes both ways between a (the source side) and b (the
// destination side) until both directions finish, half-closing each side
// when its input ends. It returns the bytes copied a->b and b->a and the
// first error other than a clean EOF, naming its direction. onAB and onBA,
// if not nil, are called with each chunk size for live byte accounting.
//
// The b->a direction runs on the calling goroutine and a->b on one extra
// goroutine. Neither holds a large buffer while its source is idle.
func Relay(a, b net.Conn, onAB, onBA func(int)) (ab, ba int64, err error) {
	errc := make(chan error, 1)
	var nab int64
	go func() {
		var e error
		nab, e = copyHalf(b, a, onAB)
		e = dirErr("source->destination", e)
		if e != nil {
			// Tear both down so the other copy ends.
			a.Close()
			b.Close()
		}
		errc <- e
	}()
	nba, e := copyHalf(a, b, onBA)
	eba := dirErr("destination->source", e)
	if eba != nil {
		a.Close()
		b.Close()
	}
	eab := <-errc
	return nab, nba, errors.Join(eab, eba)
}

type dirError struct {
	dir string
	err error
}

func (e *dirError) Error() string { return e.dir + ": " + e.err.Error() }
func (e *dirError) Unwrap() error { return e.err }

func dirErr(dir string, err error) error {
	if err == nil {
		return nil
	}
	return &dirError{dir: dir, err: err}
}

// copyHalf copies src to dst, then half-closes dst.
func copyHalf(dst, src net.Conn, on func(int)) (int64, error) {
	n, err := pump(src, func(b []byte) error {
		w, err := dst.Write(b)
		if on != nil && w > 0 {
			on(w)
		}
		return err
	})
	if err != nil {
		return n, err
	}
	return n, CloseWrite(dst)
}

// pump reads src until EOF and hands every chunk read to write, which must
// consume it before returning. It returns the bytes read and the first
// error other than EOF. A pooled buffer (BufferSize, or LargeBufferSize for
// bulk data) is held only while data flows: for a socket, pump waits for
// readability through the poller; for other sources it waits with a
// zero-length read.
func pump(src io.Reader, write func([]byte) error) (int64, error) {
	if sc, ok := src.(syscall.Conn); ok {
		if rc, err := sc.SyscallConn(); err == nil && rawReadSupported {
			return pumpRaw(rc, write)
		}
	}
	return pumpAdaptive(src, write)
}

// pumpAdaptive is pump for sources without readiness notification. HTTP/2
// bodies of x/net/http2 (server request bodies, client response bodies)
// block a zero-length read until data or the end of the body is there, so
// pump waits holding no buffer, then takes everything buffered (several
// frames) with one read and hands it on as one chunk. A source whose
// zero-length read returns at once is read with the buffer instead
// (correct, but it holds the buffer while idle).
func pumpAdaptive(src io.Reader, write func([]byte) error) (int64, error) {
	var (
		total int64
		bulk  bool
	)
	for {
		if _, err := src.Read(nil); err != nil {
			if err == io.EOF {
				return total, nil
			}
			return total, err
		}
		buf := getBuf(bulk)
		n, rerr := src.Read(*buf)
		if n > 0 {
			total += int64(n)
			if werr := write((*buf)[:n]); werr != nil {
				putBuf(buf)
				return total, werr
			}
		}
		bulk = bulkAfter(bulk, n, *buf)
		putBuf(buf)
		if rerr == io.EOF {
			return total, nil
		}
		if rerr != nil {
			return total, rerr
		}
	}
}

// addrOf converts a net.Addr to a netip.AddrPort.
func addrOf(a net.Addr) (netip.AddrPort, bool) {
	switch v := a.(type) {
	case *net.TCPAddr:
		ap := v.AddrPort()
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), true
	case nil:
		return netip.AddrPort{}, false
	default:
		ap, err := netip.ParseAddrPort(v.String())
		if err != nil {
			return netip.AddrPort{}, false
		}
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), true
	}
}

// AddrPortOf returns the IP address and port of a TCP-like net.Addr.
func AddrPortOf(a net.Addr) (netip.AddrPort, bool) { return addrOf(a) }
