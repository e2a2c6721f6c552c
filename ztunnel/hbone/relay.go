package hbone

import (
	"errors"
	"io"
	"net"
	"net/netip"
	"sync"
)

// BufferSize is the size of the pooled relay buffers.
const BufferSize = 64 << 10

var bufPool = sync.Pool{New: func() any { b := make([]byte, BufferSize); return &b }}

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
func Relay(a, b net.Conn, onAB, onBA func(int)) (ab, ba int64, err error) {
	errc := make(chan error, 2)
	var nab, nba int64
	go func() {
		var e error
		nab, e = copyHalf(b, a, onAB)
		errc <- dirErr("source->destination", e)
	}()
	go func() {
		var e error
		nba, e = copyHalf(a, b, onBA)
		errc <- dirErr("destination->source", e)
	}()
	var errs []error
	for range 2 {
		if e := <-errc; e != nil {
			errs = append(errs, e)
			// One side failed: tear both down so the other copy ends.
			a.Close()
			b.Close()
		}
	}
	return nab, nba, errors.Join(errs...)
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

// copyHalf copies src to dst with a pooled buffer, then half-closes dst.
func copyHalf(dst, src net.Conn, on func(int)) (int64, error) {
	bp := getBuf()
	defer putBuf(bp)
	buf := *bp
	var total int64
	for {
		n, rerr := src.Read(buf)
		if n > 0 {
			w, werr := dst.Write(buf[:n])
			total += int64(w)
			if on != nil {
				on(w)
			}
			if werr != nil {
				return total, werr
			}
		}
		if rerr == io.EOF {
			return total, CloseWrite(dst)
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
