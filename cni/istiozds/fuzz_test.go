//go:build linux

package istiozds_test

import (
	"errors"
	"net"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
	"istio.io/istio/pkg/zdsapi"

	"github.com/isthmus-mesh/isthmus/cni/istiozds"
	"github.com/isthmus-mesh/isthmus/cni/zds"
)

// FuzzAgentWire sends one datagram (data, with a file descriptor when
// withFD) over a real unix SOCK_SEQPACKET pair and reads it with Istio's
// framing as kind says: 0 a ZdsHello and 1 a WorkloadResponse, as the
// agent's server reads them from a ZDS ztunnel (Codec), 2 a WorkloadRequest
// as the Isthmus ztunnel reads it from istio-cni (ReadRequest). On every
// input: no panic; a refusal returns no descriptor and leaks none; the
// decoders accept exactly what an independent reading with Istio's types
// accepts (protobuf parses it, the payload is there, a uid where one is
// needed, a descriptor exactly with an add, a hello of V1 or later) and
// give its values; an accepted request encodes back (EncodeRequest) to a
// message Istio's types read as the same.
func FuzzAgentWire(f *testing.F) {
	for _, s := range []struct {
		msg    proto.Message
		withFD bool
		kind   uint8
	}{
		{&zdsapi.ZdsHello{Version: zdsapi.Version_V1}, false, 0},
		{&zdsapi.ZdsHello{Version: 7}, false, 0},
		{&zdsapi.WorkloadResponse{Payload: &zdsapi.WorkloadResponse_Ack{Ack: &zdsapi.Ack{}}}, false, 1},
		{&zdsapi.WorkloadResponse{Payload: &zdsapi.WorkloadResponse_Ack{Ack: &zdsapi.Ack{Error: "no netns"}}}, false, 1},
		{&zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_Add{Add: &zdsapi.AddWorkload{Uid: "u",
			WorkloadInfo: &zdsapi.WorkloadInfo{Name: "p", Namespace: "n", ServiceAccount: "sa"}}}}, true, 2},
		{&zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_Keep{Keep: &zdsapi.KeepWorkload{Uid: "u"}}}, false, 2},
		{&zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_Del{Del: &zdsapi.DelWorkload{Uid: "u"}}}, false, 2},
		{&zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_SnapshotSent{SnapshotSent: &zdsapi.SnapshotSent{}}}, false, 2},
	} {
		b, err := proto.Marshal(s.msg)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b, s.withFD, s.kind)
	}
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		f.Fatal(err)
	}
	a, b := connOf(f, pair[0]), connOf(f, pair[1])
	devNull, err := os.Open(os.DevNull)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { a.Close(); b.Close(); devNull.Close() })

	f.Fuzz(func(t *testing.T, data []byte, withFD bool, kind uint8) {
		if len(data) == 0 || len(data) > zds.MaxMessage {
			return // empty reads as a closed peer; longer is cni/zds' FuzzWire's (truncation)
		}
		before := openFDs(t)
		var oob []byte
		if withFD {
			oob = unix.UnixRights(int(devNull.Fd()))
		}
		// Deadlines: a read or write that blocks is a failure, not a hang.
		_ = a.SetWriteDeadline(time.Now().Add(5 * time.Second))
		_ = b.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, _, err := a.WriteMsgUnix(data, oob, nil); err != nil {
			t.Fatalf("send: %v", err)
		}
		var fd *os.File
		var got any
		var err error
		var want any
		var wantOK bool
		switch kind % 3 {
		case 0:
			got, err = istiozds.Codec{}.ReadHello(b)
			var m zdsapi.ZdsHello
			wantOK = proto.Unmarshal(data, &m) == nil && m.GetVersion() >= zdsapi.Version_V1 && !withFD
			want = zds.Hello{Version: 1}
		case 1:
			got, err = istiozds.Codec{}.ReadAck(b)
			var m zdsapi.WorkloadResponse
			wantOK = proto.Unmarshal(data, &m) == nil && m.GetAck() != nil && !withFD
			want = zds.Ack{Error: m.GetAck().GetError()}
		default:
			var r istiozds.Request
			r, fd, err = istiozds.ReadRequest(b)
			got = r
			want, wantOK = readRequest(data, withFD)
		}
		if err != nil {
			if fd != nil {
				t.Fatalf("refused (%v) but returned a descriptor", err)
			}
			if wantOK {
				t.Fatalf("refused %x (fd %v) that Istio's types read as %+v: %v", data, withFD, want, err)
			}
			if after := openFDs(t); after != before {
				t.Fatalf("refused (%v) and leaked descriptors: %d -> %d", err, before, after)
			}
			return
		}
		if !wantOK {
			t.Fatalf("accepted %x (fd %v) as %+v, which Istio's types do not give", data, withFD, got)
		}
		if (fd != nil) != withFD {
			t.Fatalf("descriptor returned %v, sent %v", fd != nil, withFD)
		}
		if fd != nil {
			fd.Close()
		}
		if !equalMsg(got, want) {
			t.Fatalf("decoded %+v, Istio's types give %+v", got, want)
		}
		if r, ok := got.(istiozds.Request); ok && r.Keep == "" {
			enc, err := istiozds.EncodeRequest(r.Request)
			if err != nil {
				t.Fatalf("encode %+v: %v", r, err)
			}
			if again, ok := readRequest(enc, r.Add != nil); !ok || !equalMsg(again, r) {
				t.Fatalf("round trip: %+v -> %+v (%v)", r, again, ok)
			}
		}
		if after := openFDs(t); after != before {
			t.Fatalf("leaked descriptors: %d -> %d", before, after)
		}
	})
}

// readRequest is the oracle: what a WorkloadRequest should decode to, read
// with Istio's types alone.
func readRequest(data []byte, withFD bool) (istiozds.Request, bool) {
	var m zdsapi.WorkloadRequest
	if proto.Unmarshal(data, &m) != nil {
		return istiozds.Request{}, false
	}
	var r istiozds.Request
	switch {
	case m.GetAdd() != nil:
		wi := m.GetAdd().GetWorkloadInfo()
		if m.GetAdd().GetUid() == "" || wi == nil || !withFD {
			return r, false
		}
		r.Add = &zds.Pod{UID: m.GetAdd().GetUid(), Name: wi.GetName(), Namespace: wi.GetNamespace(), ServiceAccount: wi.GetServiceAccount()}
		return r, true
	case m.GetKeep() != nil:
		r.Keep = m.GetKeep().GetUid()
		return r, r.Keep != "" && !withFD
	case m.GetDel() != nil:
		r.Del = &zds.DelPod{UID: m.GetDel().GetUid()}
		return r, r.Del.UID != "" && !withFD
	case m.GetSnapshotSent() != nil:
		r.SnapshotSent = &zds.SnapshotSent{}
		return r, !withFD
	}
	return r, false
}

func equalMsg(a, b any) bool {
	ra, okA := a.(istiozds.Request)
	rb, okB := b.(istiozds.Request)
	if !okA || !okB {
		return a == b
	}
	switch {
	case ra.Keep != rb.Keep, (ra.Add == nil) != (rb.Add == nil), (ra.Del == nil) != (rb.Del == nil),
		(ra.SnapshotSent == nil) != (rb.SnapshotSent == nil), ra.HandedOff != nil || rb.HandedOff != nil:
		return false
	case ra.Add != nil && (ra.Add.UID != rb.Add.UID || ra.Add.Name != rb.Add.Name || ra.Add.Namespace != rb.Add.Namespace ||
		ra.Add.ServiceAccount != rb.Add.ServiceAccount || len(ra.Add.IPs)+len(rb.Add.IPs) != 0):
		return false
	case ra.Del != nil && ra.Del.UID != rb.Del.UID:
		return false
	}
	return true
}

func connOf(tb testing.TB, fd int) *net.UnixConn {
	file := os.NewFile(uintptr(fd), "pair")
	defer file.Close()
	c, err := net.FileConn(file)
	if err != nil {
		tb.Fatal(err)
	}
	return c.(*net.UnixConn)
}

func openFDs(tb testing.TB) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		tb.Fatal(err)
	}
	return len(ents)
}
