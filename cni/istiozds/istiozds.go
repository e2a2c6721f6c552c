// Package istiozds is Istio's ZDS wire format (protobuf package
// istio.workload.zds, the Go types of istio.io/istio/pkg/zdsapi), so that
// either end of pod handover can be Istio's: Codec lets the agent's server
// (cni/zds.Server) serve Istio's ztunnel, and ReadRequest, WriteHello and
// WriteAck let the Isthmus ztunnel (ztunnel/inpod) be fed by istio-cni.
//
// The framing is Istio's: a unix SOCK_SEQPACKET socket (Istio's path is
// SocketPath), one protobuf message per datagram, the pod's network
// namespace as an SCM_RIGHTS descriptor in the ancillary data of the
// datagram of its AddWorkload and of no other:
//
//	ztunnel -> agent   ZdsHello{version: V1}
//	agent   -> ztunnel WorkloadRequest{add: {uid, workload_info: {name, namespace, service_account}}} + netns
//	ztunnel -> agent   WorkloadResponse{ack: {error}}      (error empty on success)
//	...                one add (or keep) per enrolled pod, each acked before the next
//	agent   -> ztunnel WorkloadRequest{snapshot_sent: {}}   ztunnel drops pods not named since hello
//	agent   -> ztunnel WorkloadRequest{add | del: {uid}}, each acked, as pods come and go
//
// KeepWorkload{uid}, only before SnapshotSent, names a pod whose namespace
// the agent could not open: ztunnel keeps serving it if it does, without a
// new descriptor. Istio's protocol has no HandedOff and no cgroup id in its
// hello: a ZDS ztunnel is a version 1 peer of cni/zds whose cgroup the
// agent takes from the kernel (zds Config.PeerProcDir; docs/security.md
// "Istio's ZDS on the agent's socket"), and its adds carry no pod
// addresses (ztunnel takes them from xDS).
//
// Every decoder checks what the protobuf cannot: exactly one payload, a uid
// where one is needed, a descriptor exactly with an add.
package istiozds

import (
	"errors"
	"fmt"
	"net"
	"os"

	"google.golang.org/protobuf/proto"
	"istio.io/istio/pkg/zdsapi"

	"github.com/isthmus-mesh/isthmus/cni/zds"
)

// SocketPath is where Istio's istio-cni serves, and Istio's ztunnel
// connects.
const SocketPath = "/var/run/ztunnel/ztunnel.sock"

// Request is one WorkloadRequest as ztunnel receives it: exactly one of
// Add, Del, SnapshotSent (in Request) or Keep is set.
type Request struct {
	zds.Request
	// Keep is the uid of a KeepWorkload.
	Keep string
}

// Codec is Istio's ZDS for cni/zds.Server (Config.Codec).
type Codec struct{}

var _ zds.Codec = Codec{}

// ReadHello reads a ZdsHello. V1 and any later version (Istio's own agent
// does not negotiate, and later ztunnels keep speaking V1's messages) are a
// zds version 1 peer with no cgroup id; NOT_USED is refused.
func (Codec) ReadHello(c *net.UnixConn) (zds.Hello, error) {
	var h zds.Hello
	fd, err := zds.ReadDatagram(c, func(b []byte, _ bool) (err error) { h, err = DecodeHello(b); return err })
	if fd != nil {
		fd.Close()
		return zds.Hello{}, errors.New("istiozds: a file descriptor came with ZdsHello")
	}
	return h, err
}

// WriteRequest sends req as a WorkloadRequest, fd with an Add.
func (Codec) WriteRequest(c *net.UnixConn, req zds.Request, fd *os.File) error {
	b, err := EncodeRequest(req)
	if err != nil {
		return err
	}
	return zds.WriteDatagram(c, b, fd)
}

// ReadAck reads a WorkloadResponse's Ack.
func (Codec) ReadAck(c *net.UnixConn) (zds.Ack, error) {
	var a zds.Ack
	fd, err := zds.ReadDatagram(c, func(b []byte, _ bool) (err error) { a, err = DecodeAck(b); return err })
	if fd != nil {
		fd.Close()
		return zds.Ack{}, errors.New("istiozds: a file descriptor came with WorkloadResponse")
	}
	return a, err
}

// DecodeHello decodes a ZdsHello (see Codec.ReadHello).
func DecodeHello(b []byte) (zds.Hello, error) {
	var m zdsapi.ZdsHello
	if err := proto.Unmarshal(b, &m); err != nil {
		return zds.Hello{}, fmt.Errorf("istiozds: decode ZdsHello: %w", err)
	}
	if m.GetVersion() < zdsapi.Version_V1 {
		return zds.Hello{}, fmt.Errorf("istiozds: ZdsHello of version %d, want V1 (1) or later", m.GetVersion())
	}
	return zds.Hello{Version: 1}, nil
}

// DecodeAck decodes a WorkloadResponse, which must hold an Ack.
func DecodeAck(b []byte) (zds.Ack, error) {
	var m zdsapi.WorkloadResponse
	if err := proto.Unmarshal(b, &m); err != nil {
		return zds.Ack{}, fmt.Errorf("istiozds: decode WorkloadResponse: %w", err)
	}
	ack := m.GetAck()
	if ack == nil {
		return zds.Ack{}, errors.New("istiozds: WorkloadResponse without an ack")
	}
	return zds.Ack{Error: ack.GetError()}, nil
}

// EncodeRequest encodes an Add, Del or SnapshotSent as a WorkloadRequest
// (a pod's addresses are not part of Istio's message). HandedOff has no
// Istio form: the server never sends it to a version 1 peer.
func EncodeRequest(req zds.Request) ([]byte, error) {
	if err := req.Validate(req.Add != nil); err != nil {
		return nil, err
	}
	var m zdsapi.WorkloadRequest
	switch {
	case req.Add != nil:
		m.Payload = &zdsapi.WorkloadRequest_Add{Add: &zdsapi.AddWorkload{Uid: req.Add.UID, WorkloadInfo: &zdsapi.WorkloadInfo{
			Name: req.Add.Name, Namespace: req.Add.Namespace, ServiceAccount: req.Add.ServiceAccount,
		}}}
	case req.Del != nil:
		m.Payload = &zdsapi.WorkloadRequest_Del{Del: &zdsapi.DelWorkload{Uid: req.Del.UID}}
	case req.SnapshotSent != nil:
		m.Payload = &zdsapi.WorkloadRequest_SnapshotSent{SnapshotSent: &zdsapi.SnapshotSent{}}
	default:
		return nil, errors.New("istiozds: HandedOff has no form in Istio's ZDS")
	}
	return proto.Marshal(&m)
}

// DecodeRequest decodes a WorkloadRequest; hasFD says whether a descriptor
// came with it. An add needs a uid, its workload_info and the descriptor;
// keep and del a uid and no descriptor; snapshot_sent no descriptor.
func DecodeRequest(b []byte, hasFD bool) (Request, error) {
	var m zdsapi.WorkloadRequest
	if err := proto.Unmarshal(b, &m); err != nil {
		return Request{}, fmt.Errorf("istiozds: decode WorkloadRequest: %w", err)
	}
	var r Request
	switch p := m.GetPayload().(type) {
	case *zdsapi.WorkloadRequest_Add:
		a, wi := p.Add, p.Add.GetWorkloadInfo()
		switch {
		case a.GetUid() == "":
			return Request{}, errors.New("istiozds: add without a uid")
		case wi == nil:
			return Request{}, fmt.Errorf("istiozds: add of %s without workload_info", a.GetUid())
		case !hasFD:
			return Request{}, fmt.Errorf("istiozds: add of %s without its network namespace", a.GetUid())
		}
		r.Add = &zds.Pod{UID: a.GetUid(), Name: wi.GetName(), Namespace: wi.GetNamespace(), ServiceAccount: wi.GetServiceAccount()}
		return r, nil
	case *zdsapi.WorkloadRequest_Keep:
		if p.Keep.GetUid() == "" {
			return Request{}, errors.New("istiozds: keep without a uid")
		}
		r.Keep = p.Keep.GetUid()
	case *zdsapi.WorkloadRequest_Del:
		if p.Del.GetUid() == "" {
			return Request{}, errors.New("istiozds: del without a uid")
		}
		r.Del = &zds.DelPod{UID: p.Del.GetUid()}
	case *zdsapi.WorkloadRequest_SnapshotSent:
		r.SnapshotSent = &zds.SnapshotSent{}
	default:
		return Request{}, errors.New("istiozds: WorkloadRequest without a payload (add, keep, del or snapshot_sent)")
	}
	if hasFD {
		return Request{}, errors.New("istiozds: a file descriptor came with a message other than add")
	}
	return r, nil
}

// ReadRequest reads one WorkloadRequest from c (ztunnel's side); the add's
// network namespace is returned as a file the caller owns. A message that
// does not decode is refused and its descriptor closed.
func ReadRequest(c *net.UnixConn) (Request, *os.File, error) {
	var r Request
	fd, err := zds.ReadDatagram(c, func(b []byte, hasFD bool) (err error) { r, err = DecodeRequest(b, hasFD); return err })
	return r, fd, err
}

// WriteHello sends ztunnel's ZdsHello of version V1.
func WriteHello(c *net.UnixConn) error {
	b, err := proto.Marshal(&zdsapi.ZdsHello{Version: zdsapi.Version_V1})
	if err != nil {
		return err
	}
	return zds.WriteDatagram(c, b, nil)
}

// WriteAck answers the last request with an Ack; errMsg is empty on
// success.
func WriteAck(c *net.UnixConn, errMsg string) error {
	b, err := proto.Marshal(&zdsapi.WorkloadResponse{Payload: &zdsapi.WorkloadResponse_Ack{Ack: &zdsapi.Ack{Error: errMsg}}})
	if err != nil {
		return err
	}
	return zds.WriteDatagram(c, b, nil)
}
