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

// smallBufferSize is the buffer a relay direction holds while it waits for
// data on a source that cannot report readiness (an HTTP/2 stream).
const smallBufferSize = 2 << 10

var (
	bufPool   = sync.Pool{New: func() any { b := make([]byte, BufferSize); return &b }}
	smallPool = sync.Pool{New: func() any { b := make([]byte, smallBufferSize); return &b }}
)

func getBuf() *[]byte  { return bufPool.Get().(*[]byte) }
func putBuf(b *[]byte) { bufPool.Put(b) }

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
// error other than EOF. A pooled BufferSize buffer is held only while data
// flows: for a socket, pump waits for readability holding no buffer at all;
// for other sources it waits with a small buffer, and moves to the large
// one while reads fill the small one.
func pump(src io.Reader, write func([]byte) error) (int64, error) {
	if sc, ok := src.(syscall.Conn); ok {
		if rc, err := sc.SyscallConn(); err == nil && rawReadSupported {
			return pumpRaw(rc, write)
		}
	}
	return pumpAdaptive(src, write)
}

// pumpAdaptive is pump for sources without readiness notification.
func pumpAdaptive(src io.Reader, write func([]byte) error) (int64, error) {
	sp := smallPool.Get().(*[]byte)
	defer smallPool.Put(sp)
	var big *[]byte
	defer func() {
		if big != nil {
			putBuf(big)
		}
	}()
	var total int64
	for {
		buf := *sp
		if big != nil {
			buf = *big
		}
		n, rerr := src.Read(buf)
		if n > 0 {
			total += int64(n)
			if werr := write(buf[:n]); werr != nil {
				return total, werr
			}
		}
		switch {
		case big == nil && n == len(buf):
			// The small buffer filled: more is probably waiting.
			big = getBuf()
		case big != nil && n < len(buf):
			// The source is drained: wait for more with the small buffer.
			putBuf(big)
			big = nil
		}
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
