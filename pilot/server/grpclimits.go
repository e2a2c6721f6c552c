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
	return l
}

// options returns the gRPC server options enforcing l, with creds wrapped
// so that failed handshakes are counted in failures by reason.
func (l GRPCLimits) options(creds credentials.TransportCredentials, failures *prometheus.CounterVec) []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.Creds(countingCreds{TransportCredentials: creds, failures: failures}),
		grpc.ConnectionTimeout(l.HandshakeTimeout),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: l.KeepaliveMinTime, PermitWithoutStream: true}),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: l.KeepaliveTime, Timeout: l.KeepaliveTimeout}),
		grpc.MaxConcurrentStreams(l.MaxConcurrentStreams),
		grpc.MaxRecvMsgSize(l.MaxRecvMsgSize),
	}
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
