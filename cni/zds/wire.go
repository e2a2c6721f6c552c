// Package zds is the protocol by which the CNI node agent tells ztunnel
// which pods of its node are enrolled, in the spirit of Istio's ZDS (ztunnel
// discovery service), and the agent's side of it (Server). ztunnel's side is
// ztunnel/inpod.
//
// The transport is a unix SOCK_SEQPACKET socket the agent listens on (one
// JSON document per datagram, so message boundaries are kept and a file
// descriptor travels with exactly one message):
//
//	ztunnel -> agent   Hello{version: 1, cgroupID: 1234}
//	agent   -> ztunnel Request{add: {uid, name, namespace, serviceAccount, ips}} + the pod's netns (SCM_RIGHTS)
//	ztunnel -> agent   Ack{}                  (or Ack{error: "..."})
//	...                one add per enrolled pod
//	agent   -> ztunnel Request{snapshotSent: {}}
//	ztunnel -> agent   Ack{}                  ztunnel drops pods the snapshot did not name
//	agent   -> ztunnel Request{add: ...} / Request{del: {uid}}, each acked, as pods come and go
//	agent   -> ztunnel Request{handedOff: {}}  (version 2) a newer ztunnel has every pod
//	ztunnel -> agent   Ack{}
//
// Several ztunnels may be connected at once (a new one starting while the
// old one drains, make-before-break): each gets every pod, and the pods'
// rules exempt all of them (below). When a ztunnel has acked its whole
// snapshot without refusing a pod, the agent sends HandedOff to every
// ztunnel connected before it that speaks version 2: that one may now stop
// accepting in the pods and drain (its listeners and the new one's share
// the ports with SO_REUSEPORT; see ztunnel/podproxy). The agent accepts a
// hello of any version from MinVersion to Version and sends a peer only the
// messages of its version.
//
// The socket file is mode 0600 from its creation, and the agent accepts a
// connection only from a process whose uid (SO_PEERCRED) is its own or one
// Config.AllowedUIDs names: a peer that says hello can exempt sockets from
// capture (below).
//
// Hello's cgroupID is ztunnel's cgroup v2 id (the inode number of its
// cgroup directory). The pods' rules exempt from capture only the marked
// sockets of the connected ztunnels' cgroups (cni/redirect); before a new
// ztunnel gets its snapshot, every enrolled pod's rules are re-written to
// include its cgroup (Deps.OnCapture). A ztunnel that sends none (one on a
// node without cgroup v2), or the root cgroup's id, turns the exemption
// into the mark alone; with Config.PeerProcDir (Istio's ztunnel, whose
// hello has no cgroup id) the cgroup is taken from the kernel's record of
// the connecting process instead, and a peer whose cgroup is not found is
// refused unless Config.MarkOnlyFallback.
//
// The wire format is a Codec: JSON, above, by default; cni/istiozds has
// Istio's ZDS protobuf, so that Istio's ztunnel can take the pods. The
// peer checks, ordering, snapshots and timeouts are the same for both.
//
// Every request waits for its ack before the next is sent. A ztunnel that
// (re)connects is sent the full snapshot. While no ztunnel is connected the
// agent keeps enrolling pods (their rules capture traffic, which then fails
// closed) and sends them in the next snapshot.
package zds

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"

	"golang.org/x/sys/unix"
)

// Version is the protocol version this package speaks: 2 adds HandedOff.
const Version = 2

// MinVersion is the oldest version the agent still serves.
const MinVersion = 1

// MaxMessage bounds one datagram; a larger one is a protocol error.
const MaxMessage = 64 << 10

// Hello is ztunnel's first message on a connection.
type Hello struct {
	Version int `json:"version"`
	// CgroupID is ztunnel's cgroup v2 id; 0 when it does not know it.
	CgroupID uint64 `json:"cgroupID,omitempty"`
}

// RootCgroupID is the id of a cgroup v2 hierarchy's root: a ztunnel there
// shares its cgroup with everything, so its id exempts nothing more than
// the mark.
const RootCgroupID = 1

// Pod is an enrolled pod as ztunnel needs it: its UID (which names its
// workload in xDS), name, namespace, service account and addresses.
type Pod struct {
	UID            string       `json:"uid"`
	Name           string       `json:"name"`
	Namespace      string       `json:"namespace"`
	ServiceAccount string       `json:"serviceAccount,omitempty"`
	IPs            []netip.Addr `json:"ips,omitempty"`
}

// DelPod names a pod ztunnel must stop serving.
type DelPod struct {
	UID string `json:"uid"`
}

// SnapshotSent follows the adds of a full snapshot.
type SnapshotSent struct{}

// HandedOff tells a ztunnel (of version 2 or later) that a ztunnel which
// connected after it has taken every enrolled pod: it may stop accepting
// and drain. It is sent once per newer ztunnel in step.
type HandedOff struct{}

// Request is one message from the agent; exactly one field is set. An Add
// carries the pod's network namespace as its file descriptor.
type Request struct {
	Add          *Pod          `json:"add,omitempty"`
	Del          *DelPod       `json:"del,omitempty"`
	SnapshotSent *SnapshotSent `json:"snapshotSent,omitempty"`
	HandedOff    *HandedOff    `json:"handedOff,omitempty"`
}

// Ack answers one Request; Error is empty on success.
type Ack struct {
	Error string `json:"error,omitempty"`
}

// Validate checks that exactly one field is set and that it is complete;
// hasFD says whether a descriptor came with the message.
func (r *Request) Validate(hasFD bool) error {
	n := 0
	for _, set := range []bool{r.Add != nil, r.Del != nil, r.SnapshotSent != nil, r.HandedOff != nil} {
		if set {
			n++
		}
	}
	switch {
	case n != 1:
		return fmt.Errorf("zds: a request sets exactly one of add, del, snapshotSent, handedOff (%d set)", n)
	case r.Add != nil && r.Add.UID == "":
		return errors.New("zds: add without a pod uid")
	case r.Add != nil && !hasFD:
		return fmt.Errorf("zds: add of pod %s without its network namespace", r.Add.UID)
	case r.Add == nil && hasFD:
		return errors.New("zds: a file descriptor came with a message other than add")
	case r.Del != nil && r.Del.UID == "":
		return errors.New("zds: del without a pod uid")
	}
	return nil
}

// Write sends v as one JSON datagram on c, with fd (if not nil) as
// SCM_RIGHTS.
func Write(c *net.UnixConn, v any, fd *os.File) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return WriteDatagram(c, b, fd)
}

// WriteDatagram sends b as one datagram on c, with fd (if not nil) as
// SCM_RIGHTS; b longer than MaxMessage is refused unsent.
func WriteDatagram(c *net.UnixConn, b []byte, fd *os.File) error {
	if len(b) > MaxMessage {
		return fmt.Errorf("zds: message of %d bytes exceeds %d", len(b), MaxMessage)
	}
	var oob []byte
	if fd != nil {
		oob = unix.UnixRights(int(fd.Fd()))
	}
	_, _, err := c.WriteMsgUnix(b, oob, nil)
	return err
}

// Read receives one JSON datagram from c into v, with ReadDatagram's rules;
// a message that does not decode is refused (and its descriptor closed).
func Read(c *net.UnixConn, v any) (*os.File, error) {
	return ReadDatagram(c, func(b []byte, _ bool) error {
		if err := json.Unmarshal(b, v); err != nil {
			return fmt.Errorf("zds: decode message: %w", err)
		}
		return nil
	})
}

// ReadDatagram receives one datagram from c and gives its bytes to decode
// (which must not keep them), with whether a descriptor came with it. A descriptor that came with it is returned
// as a file the caller owns; a message with more than one descriptor, a
// truncated one, an empty one (a seqpacket peer that closed: io.EOF) or
// one decode refuses is refused, and its descriptors closed.
func ReadDatagram(c *net.UnixConn, decode func(b []byte, hasFD bool) error) (*os.File, error) {
	buf := make([]byte, MaxMessage+1)
	oob := make([]byte, unix.CmsgSpace(4*4))
	n, oobn, flags, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		return nil, err
	}
	fds, perr := parseRights(oob[:oobn])
	switch {
	case perr != nil:
	case flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 || n > MaxMessage:
		perr = errors.New("zds: message truncated")
	case len(fds) > 1:
		perr = fmt.Errorf("zds: %d file descriptors in one message", len(fds))
	case n == 0:
		perr = io.EOF // a seqpacket peer that closed reads as an empty message
	}
	if perr == nil {
		perr = decode(buf[:n], len(fds) == 1)
	}
	if perr != nil {
		for _, fd := range fds {
			unix.Close(fd)
		}
		return nil, perr
	}
	if len(fds) == 1 {
		return os.NewFile(uintptr(fds[0]), "zds-netns"), nil
	}
	return nil, nil
}

func parseRights(oob []byte) ([]int, error) {
	if len(oob) == 0 {
		return nil, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("zds: control message: %w", err)
	}
	var fds []int
	for _, m := range msgs {
		got, err := unix.ParseUnixRights(&m)
		if err != nil {
			continue
		}
		fds = append(fds, got...)
	}
	return fds, nil
}
