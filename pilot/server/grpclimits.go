package server

import (
	"context"
	"errors"
	"net"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
)

// GRPCLimits bounds what a client of pilot's gRPC port (15012) may cost.
// Zero fields take the defaults of withDefaults.
type GRPCLimits struct {
	// HandshakeTimeout bounds the TLS and HTTP/2 handshakes of a new
	// connection (default 10 s): a stranger that connects and stays silent
	// is dropped.
	HandshakeTimeout time.Duration
	// KeepaliveMinTime is the shortest interval between client pings
	// allowed (default 15 s); a client pinging faster is disconnected.
	KeepaliveMinTime time.Duration
	// KeepaliveTime and KeepaliveTimeout: pilot pings an idle connection
	// every KeepaliveTime (default 30 s) and drops it when the ping is not
	// answered within KeepaliveTimeout (default 10 s).
	KeepaliveTime, KeepaliveTimeout time.Duration
	// MaxConcurrentStreams caps streams per connection (default 100).
	MaxConcurrentStreams uint32
	// MaxRecvMsgSize caps one request message (default 4 MiB).
	MaxRecvMsgSize int
	// RecvWindow is the fixed HTTP/2 flow-control window of each stream
	// and connection (default 1 MiB): what a client may send before pilot
	// reads it.
	RecvWindow int32
}

func (l GRPCLimits) withDefaults() GRPCLimits {
	if l.HandshakeTimeout <= 0 {
		l.HandshakeTimeout = 10 * time.Second
	}
	if l.KeepaliveMinTime <= 0 {
		l.KeepaliveMinTime = 15 * time.Second
	}
	if l.KeepaliveTime <= 0 {
		l.KeepaliveTime = 30 * time.Second
	}
	if l.KeepaliveTimeout <= 0 {
		l.KeepaliveTimeout = 10 * time.Second
	}
	if l.MaxConcurrentStreams == 0 {
		l.MaxConcurrentStreams = 100
	}
	if l.MaxRecvMsgSize <= 0 {
		l.MaxRecvMsgSize = 4 << 20
	}
	if l.RecvWindow < 64<<10 {
		l.RecvWindow = 1 << 20
	}
	return l
}

// options returns the gRPC server options enforcing l. creds, when not nil,
// secures the port and is wrapped so that failed handshakes are counted in
// failures by reason; nil serves plaintext.
//
// Receive windows are fixed (RecvWindow). gRPC's default sizes them
// dynamically: it answers a DATA frame, whenever no estimate is in flight,
// with a WINDOW_UPDATE and a PING that estimates the bandwidth-delay
// product. What pilot reads is small requests and ACKs, each some time
// after the last, so that was a write, a round trip and a read per ACK per
// client for nothing; and a client sending fast could make pilot advertise,
// and so buffer, up to 16 MiB.
//
// Clients are told to index no headers (an HPACK table of 0 bytes): a
// stream's request headers come once, so the table only held each client's
// headers for nothing (about 2 KB per connection in a heap profile).
func (l GRPCLimits) options(creds credentials.TransportCredentials, failures *prometheus.CounterVec) []grpc.ServerOption {
	opts := []grpc.ServerOption{
		grpc.ConnectionTimeout(l.HandshakeTimeout),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: l.KeepaliveMinTime, PermitWithoutStream: true}),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: l.KeepaliveTime, Timeout: l.KeepaliveTimeout}),
		grpc.MaxConcurrentStreams(l.MaxConcurrentStreams),
		grpc.MaxRecvMsgSize(l.MaxRecvMsgSize),
		grpc.StaticStreamWindowSize(l.RecvWindow),
		grpc.StaticConnWindowSize(l.RecvWindow),
		grpc.HeaderTableSize(0),
	}
	if creds != nil {
		opts = append(opts, grpc.Creds(countingCreds{TransportCredentials: creds, failures: failures}))
	}
	return opts
}

func newHandshakeFailures(reg prometheus.Registerer) *prometheus.CounterVec {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "isthmus_grpc_handshake_failures_total",
		Help: "Connections to pilot's gRPC port dropped during the TLS handshake, by reason (timeout, eof, tls).",
	}, []string{"reason"})
	reg.MustRegister(c)
	return c
}

// countingCreds counts failed server handshakes.
type countingCreds struct {
	credentials.TransportCredentials
	failures *prometheus.CounterVec
}

// ServerHandshake implements credentials.TransportCredentials.
func (c countingCreds) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	out, info, err := c.TransportCredentials.ServerHandshake(conn)
	if err != nil {
		c.failures.WithLabelValues(handshakeFailure(err)).Inc()
	}
	return out, info, err
}

// Clone implements credentials.TransportCredentials.
func (c countingCreds) Clone() credentials.TransportCredentials {
	return countingCreds{TransportCredentials: c.TransportCredentials.Clone(), failures: c.failures}
}

func handshakeFailure(err error) string {
	switch {
	case errors.Is(err, os.ErrDeadlineExceeded), errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.Is(err, net.ErrClosed), errors.Is(err, os.ErrClosed), err.Error() == "EOF":
		return "eof"
	default:
		return "tls"
	}
}
