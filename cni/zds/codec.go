package zds

import (
	"errors"
	"fmt"
	"net"
	"os"
)

// Codec is a wire format of the agent's side: how a connection's hello and
// acks are read and its requests written, one message per datagram. The
// server's peer checks, ordering, snapshots and timeouts are the same
// whatever the codec. Implementations are stateless and safe for
// concurrent use. JSON (this package's protocol) is the default;
// cni/istiozds has Istio's ZDS protobuf.
type Codec interface {
	// ReadHello reads a connection's first message. The Hello's Version
	// is in this package's numbering (it decides whether the peer is sent
	// HandedOff); a hello this codec does not serve is an error.
	ReadHello(c *net.UnixConn) (Hello, error)
	// WriteRequest sends req, with fd (the netns of an Add, else nil).
	WriteRequest(c *net.UnixConn, req Request, fd *os.File) error
	// ReadAck reads the answer to the last request.
	ReadAck(c *net.UnixConn) (Ack, error)
}

// JSON is this package's own wire format (see the package comment).
type JSON struct{}

var _ Codec = JSON{}

// ReadHello reads a JSON Hello of a version from MinVersion to Version.
func (JSON) ReadHello(c *net.UnixConn) (Hello, error) {
	var h Hello
	fd, err := Read(c, &h)
	if fd != nil {
		fd.Close()
		return Hello{}, errors.New("zds: a file descriptor came with hello")
	}
	if err != nil {
		return Hello{}, err
	}
	if h.Version < MinVersion || h.Version > Version {
		return Hello{}, fmt.Errorf("zds: ztunnel speaks version %d, want %d to %d", h.Version, MinVersion, Version)
	}
	return h, nil
}

// WriteRequest writes req as JSON.
func (JSON) WriteRequest(c *net.UnixConn, req Request, fd *os.File) error {
	return Write(c, req, fd)
}

// ReadAck reads a JSON Ack; one that comes with a descriptor is refused.
func (JSON) ReadAck(c *net.UnixConn) (Ack, error) {
	var ack Ack
	fd, err := Read(c, &ack)
	if fd != nil {
		fd.Close()
		return Ack{}, errors.New("zds: a file descriptor came with an ack")
	}
	return ack, err
}
