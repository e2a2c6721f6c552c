package proxy

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"
)

// scriptConn is a net.Conn that reads a fixed byte string, at most chunk
// bytes per Read (short reads, as TCP delivers them), then io.EOF, and
// records what is written to it. It never blocks.
type scriptConn struct {
	in      []byte
	read    int // bytes consumed by the code under test
	chunk   int
	written bytes.Buffer
}

func (c *scriptConn) Read(b []byte) (int, error) {
	if c.read == len(c.in) {
		return 0, io.EOF
	}
	n := copy(b[:min(len(b), c.chunk)], c.in[c.read:])
	c.read += n
	return n, nil
}

func (c *scriptConn) Write(b []byte) (int, error) { return c.written.Write(b) }
func (c *scriptConn) Close() error                { return nil }
func (c *scriptConn) LocalAddr() net.Addr {
	return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 15080}
}
func (c *scriptConn) RemoteAddr() net.Addr {
	return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2), Port: 40000}
}
func (c *scriptConn) SetDeadline(time.Time) error      { return nil }
func (c *scriptConn) SetReadDeadline(time.Time) error  { return nil }
func (c *scriptConn) SetWriteDeadline(time.Time) error { return nil }

// socksOracle is an independent reading of an RFC 1928 no-auth CONNECT
// request: the Target it names and its length in bytes, or ok=false when
// the bytes are not one.
func socksOracle(in []byte) (t Target, n int, ok bool) {
	take := func(k int) ([]byte, bool) {
		if len(in)-n < k {
			return nil, false
		}
		n += k
		return in[n-k : n], true
	}
	hdr, ok := take(2)
	if !ok || hdr[0] != 5 {
		return t, 0, false
	}
	methods, ok := take(int(hdr[1]))
	if !ok || bytes.IndexByte(methods, 0) < 0 {
		return t, 0, false
	}
	req, ok := take(4)
	if !ok || req[0] != 5 || req[1] != 1 {
		return t, 0, false
	}
	var addrLen int
	switch req[3] {
	case 1:
		addrLen = 4
	case 4:
		addrLen = 16
	case 3:
		l, ok := take(1)
		if !ok {
			return t, 0, false
		}
		addrLen = int(l[0])
		if addrLen == 0 { // no name at all
			return t, 0, false
		}
	default:
		return t, 0, false
	}
	a, ok := take(addrLen)
	if !ok {
		return t, 0, false
	}
	p, ok := take(2)
	if !ok {
		return t, 0, false
	}
	t.Port = binary.BigEndian.Uint16(p)
	if req[3] == 3 {
		if ip, err := netip.ParseAddr(string(a)); err == nil {
			t.Addr = ip.Unmap()
		} else {
			t.Host = string(a)
		}
		return t, n, true
	}
	ip, _ := netip.AddrFromSlice(a)
	t.Addr = ip.Unmap()
	return t, n, true
}

// TestSOCKSEmptyDomainNameIsRefused: a CONNECT to a domain name of length
// zero names no target; it is refused with a reply, not turned into a
// Target with neither host nor address (found by FuzzReadSOCKSRequest).
func TestSOCKSEmptyDomainNameIsRefused(t *testing.T) {
	c := &scriptConn{in: []byte("\x05\x01\x00\x05\x01\x00\x03\x00\x1f\x90"), chunk: 64}
	got, err := readSOCKSRequest(c)
	var se *socksError
	if !errors.As(err, &se) || se.reply != socksGeneralFailure {
		t.Fatalf("got %+v, %v; want a general-failure refusal", got, err)
	}
	want := []byte{socksVersion, socksNoAuth, socksVersion, socksGeneralFailure, 0, socksAtypIPv4, 0, 0, 0, 0, 0, 0}
	if !bytes.Equal(c.written.Bytes(), want) {
		t.Fatalf("wrote %x, want %x", c.written.Bytes(), want)
	}
}

// FuzzReadSOCKSRequest feeds arbitrary client bytes, delivered in short
// reads, to the SOCKS5 negotiation. It must never panic nor read past the
// request (what follows is the application's stream); a request it accepts
// must name exactly the target an independent reading of RFC 1928 finds, as
// a host name or an (unmapped) address; what it writes back must be the
// protocol's method selection and at most one reply.
func FuzzReadSOCKSRequest(f *testing.F) {
	f.Fuzz(func(t *testing.T, chunk uint8, in []byte) {
		c := &scriptConn{in: in, chunk: int(chunk%16) + 1}
		got, err := readSOCKSRequest(c)
		if c.read > len(in) {
			t.Fatalf("read %d bytes of %d", c.read, len(in))
		}
		want, n, ok := socksOracle(in)
		if err == nil {
			if !ok {
				t.Fatalf("accepted %+v from bytes that are no CONNECT request: %x", got, in)
			}
			if got != want || c.read != n {
				t.Fatalf("got %+v after %d bytes, want %+v after %d bytes (input %x)", got, c.read, want, n, in)
			}
			if (got.Host == "") == !got.Addr.IsValid() || got.Addr.Is4In6() {
				t.Fatalf("malformed target %+v", got)
			}
		} else if ok {
			t.Fatalf("refused a valid request %x: %v", in, err)
		}
		checkSOCKSWrites(t, c.written.Bytes(), err)
	})
}

// checkSOCKSWrites checks the server's side of the negotiation: a method
// selection (no-auth, or "no acceptable method" on refusal), then for a
// protocol error the server names (*socksError) one reply with its code.
func checkSOCKSWrites(t *testing.T, w []byte, err error) {
	if len(w) == 0 {
		return // the client gave up before choosing a method
	}
	if len(w) < 2 || w[0] != socksVersion || (w[1] != socksNoAuth && w[1] != socksNoAcceptable) {
		t.Fatalf("method selection %x", w)
	}
	if w[1] == socksNoAcceptable {
		if err == nil || len(w) != 2 {
			t.Fatalf("no acceptable method, yet err=%v and writes %x", err, w)
		}
		return
	}
	rest := w[2:]
	var se *socksError
	if !errors.As(err, &se) {
		if len(rest) != 0 {
			t.Fatalf("reply %x written for err=%v", rest, err)
		}
		return
	}
	want := [socksReplyIPv4ZeroBytes]byte{socksVersion, se.reply, 0, socksAtypIPv4}
	if !bytes.Equal(rest, want[:]) {
		t.Fatalf("reply %x for %v, want %x", rest, err, want)
	}
}
