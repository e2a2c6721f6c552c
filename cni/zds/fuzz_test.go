//go:build linux

package zds_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"net"
	"os"
	"reflect"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/isthmus-mesh/isthmus/cni/zds"
)

// FuzzWire sends one datagram (data, with a file descriptor when withFD)
// over a real unix SOCK_SEQPACKET pair and reads it as kind (0 Hello, 1
// Request, 2 Ack), as both ends of the agent<->ztunnel protocol do. On every
// input: no panic; a refusal returns no descriptor and leaks none; an
// accepted message comes with a descriptor exactly when one was sent; a
// Request that validates, and any Hello or Ack, is written again and read
// back equal.
func FuzzWire(f *testing.F) {
	for _, s := range []struct {
		data   string
		withFD bool
		kind   uint8
	}{
		{`{"version":1}`, false, 0},
		{`{"version":1,"cgroupID":1234}`, false, 0},
		{`{"version":1,"cgroupID":18446744073709551615}`, false, 0},
		{`{"version":1,"cgroupID":-1}`, false, 0},
		{`{"add":{"uid":"u","name":"p","namespace":"n","serviceAccount":"sa","ips":["10.0.0.1","fd00::1"]}}`, true, 1},
		{`{"add":{"uid":"u","ips":["not-an-ip"]}}`, true, 1},
		{`{"del":{"uid":"u"}}`, false, 1},
		{`{"del":{"uid":"u"}}`, true, 1},
		{`{"snapshotSent":{}}`, false, 1},
		{`{"handedOff":{}}`, false, 1},
		{`{"handedOff":{},"snapshotSent":{}}`, false, 1},
		{`{"version":2,"cgroupID":1234}`, false, 0},
		{`{"add":{"uid":"u"},"del":{"uid":"u"}}`, true, 1},
		{`{}`, false, 2},
		{`{"error":"no workload"}`, false, 2},
		{``, false, 2},
		{`nul`, true, 0},
	} {
		f.Add([]byte(s.data), s.withFD, s.kind)
	}
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		f.Fatal(err)
	}
	a, b := conn(f, pair[0]), conn(f, pair[1])
	devNull, err := os.Open(os.DevNull)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { a.Close(); b.Close(); devNull.Close() })

	f.Fuzz(func(t *testing.T, data []byte, withFD bool, kind uint8) {
		if len(data) > zds.MaxMessage+16 {
			return // larger than a datagram the socket buffer takes at once
		}
		before := openFDs(t)
		var oob []byte
		if withFD {
			oob = unix.UnixRights(int(devNull.Fd()))
		}
		if _, _, err := a.WriteMsgUnix(data, oob, nil); err != nil {
			t.Fatalf("send: %v", err)
		}
		var v any
		switch kind % 3 {
		case 0:
			v = &zds.Hello{}
		case 1:
			v = &zds.Request{}
		default:
			v = &zds.Ack{}
		}
		fd, err := zds.Read(b, v)
		if err != nil {
			if fd != nil {
				t.Fatalf("refused (%v) but returned a descriptor", err)
			}
			if len(data) > zds.MaxMessage && !strings.Contains(err.Error(), "truncated") {
				t.Fatalf("a message of %d bytes refused with %v", len(data), err)
			}
			if after := openFDs(t); after != before {
				t.Fatalf("refused (%v) and leaked descriptors: %d -> %d", err, before, after)
			}
			return
		}
		if len(data) > zds.MaxMessage {
			t.Fatalf("a message of %d bytes was accepted", len(data))
		}
		if (fd != nil) != withFD {
			t.Fatalf("descriptor returned %v, sent %v", fd != nil, withFD)
		}
		if fd != nil {
			fd.Close()
		}
		if r, ok := v.(*zds.Request); ok && r.Validate(withFD) != nil {
			return
		}
		// Accepted: it survives a round trip unchanged.
		if err := zds.Write(a, v, nil); err != nil {
			t.Fatalf("write back %+v: %v", v, err)
		}
		again := reflect.New(reflect.TypeOf(v).Elem()).Interface()
		if fd2, err := zds.Read(b, again); err != nil || fd2 != nil {
			t.Fatalf("read back: %v", err)
		}
		// Equal as sent: the same encoding (an empty list and none are
		// one value: corpus empty-ips-is-no-ips).
		w1, _ := json.Marshal(v)
		w2, _ := json.Marshal(again)
		if !bytes.Equal(w1, w2) {
			t.Fatalf("round trip changed the message: %s -> %s", w1, w2)
		}
		if after := openFDs(t); after != before {
			t.Fatalf("leaked descriptors: %d -> %d", before, after)
		}
	})
}

// TestReadRefusesTruncated: a datagram larger than MaxMessage is refused,
// with its descriptor closed (FuzzWire checks this too, but its mutator
// rarely grows an input that far, and minimising one is slow).
func TestReadRefusesTruncated(t *testing.T) {
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	a, b := connOf(t, pair[0]), connOf(t, pair[1])
	defer a.Close()
	defer b.Close()
	devNull, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer devNull.Close()
	before := openFDs(t)
	big := []byte(`{"error":"` + strings.Repeat("x", zds.MaxMessage) + `"}`)
	if _, _, err := a.WriteMsgUnix(big, unix.UnixRights(int(devNull.Fd())), nil); err != nil {
		t.Fatal(err)
	}
	var ack zds.Ack
	fd, err := zds.Read(b, &ack)
	if err == nil || !strings.Contains(err.Error(), "truncated") || fd != nil {
		t.Fatalf("Read of %d bytes: fd %v, err %v", len(big), fd, err)
	}
	if after := openFDs(t); after != before {
		t.Fatalf("leaked descriptors: %d -> %d", before, after)
	}
}

func conn(f *testing.F, fd int) *net.UnixConn { return connOf(f, fd) }

func connOf(f testing.TB, fd int) *net.UnixConn {
	file := os.NewFile(uintptr(fd), "pair")
	defer file.Close()
	c, err := net.FileConn(file)
	if err != nil {
		f.Fatal(err)
	}
	return c.(*net.UnixConn)
}

func openFDs(t testing.TB) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	return len(ents)
}
