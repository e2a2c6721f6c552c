package proxy

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"time"

	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// SOCKS5 constants (RFC 1928).
const (
	socksVersion      = 5
	socksNoAuth       = 0
	socksNoAcceptable = 0xff
	socksCmdConnect   = 1
	socksAtypIPv4     = 1
	socksAtypDomain   = 3
	socksAtypIPv6     = 4

	socksSucceeded          = 0
	socksGeneralFailure     = 1
	socksNotAllowed         = 2
	socksHostUnreachable    = 4
	socksCmdNotSupported    = 7
	socksAddrNotSupported   = 8
	socksReplyIPv4ZeroBytes = 10
)

// ServeSOCKS5 serves SOCKS5 CONNECT (IPv4, IPv6 and domain names, no
// authentication) on ln until ln or the Outbound is closed.
func (o *Outbound) ServeSOCKS5(ln net.Listener) error {
	return o.serve(ln, o.handleSOCKS)
}

func (o *Outbound) handleSOCKS(c net.Conn) {
	_ = c.SetDeadline(time.Now().Add(o.cfg.SOCKSHandshakeTimeout))
	t, err := readSOCKSRequest(c)
	if err != nil {
		o.deps.Metrics.Refused(metrics.ReporterSource, ReasonSOCKSProtocol)
		o.deps.Log.Debug("socks5 negotiation failed", "client", c.RemoteAddr(), "err", err)
		return
	}
	src, err := o.source(c)
	if err != nil {
		o.deps.Metrics.Refused(metrics.ReporterSource, ReasonUnknownSource)
		writeSOCKSReply(c, socksNotAllowed)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), o.cfg.SOCKSHandshakeTimeout)
	defer cancel()
	o.handle(ctx, c, src, t, func(err error) error {
		code := byte(socksSucceeded)
		switch {
		case err == nil:
		case errors.Is(err, ErrNoRoute), errors.Is(err, state.ErrNoEndpoint):
			code = socksHostUnreachable
		default:
			code = socksGeneralFailure
		}
		if werr := writeSOCKSReply(c, code); werr != nil {
			return werr
		}
		return c.SetDeadline(time.Time{})
	})
}

func writeSOCKSReply(c net.Conn, code byte) error {
	reply := [socksReplyIPv4ZeroBytes]byte{socksVersion, code, 0, socksAtypIPv4}
	_, err := c.Write(reply[:])
	return err
}

type socksError struct {
	reply byte
	msg   string
}

func (e *socksError) Error() string { return "socks5: " + e.msg }

func readSOCKSRequest(c net.Conn) (Target, error) {
	var hdr [2]byte
	if _, err := io.ReadFull(c, hdr[:]); err != nil {
		return Target{}, err
	}
	if hdr[0] != socksVersion {
		return Target{}, fmt.Errorf("socks5: version %d", hdr[0])
	}
	methods := make([]byte, hdr[1])
	if _, err := io.ReadFull(c, methods); err != nil {
		return Target{}, err
	}
	noAuth := false
	for _, m := range methods {
		noAuth = noAuth || m == socksNoAuth
	}
	if !noAuth {
		_, _ = c.Write([]byte{socksVersion, socksNoAcceptable})
		return Target{}, errors.New("socks5: client does not offer no-auth")
	}
	if _, err := c.Write([]byte{socksVersion, socksNoAuth}); err != nil {
		return Target{}, err
	}
	var req [4]byte
	if _, err := io.ReadFull(c, req[:]); err != nil {
		return Target{}, err
	}
	if req[0] != socksVersion {
		return Target{}, fmt.Errorf("socks5: request version %d", req[0])
	}
	t, err := readSOCKSAddr(c, req[3])
	if err == nil && req[1] != socksCmdConnect {
		err = &socksError{reply: socksCmdNotSupported, msg: fmt.Sprintf("command %d not supported", req[1])}
	}
	var se *socksError
	if errors.As(err, &se) {
		_ = writeSOCKSReply(c, se.reply)
	}
	return t, err
}

func readSOCKSAddr(c net.Conn, atyp byte) (Target, error) {
	var t Target
	switch atyp {
	case socksAtypIPv4:
		var b [4]byte
		if _, err := io.ReadFull(c, b[:]); err != nil {
			return t, err
		}
		t.Addr = netip.AddrFrom4(b)
	case socksAtypIPv6:
		var b [16]byte
		if _, err := io.ReadFull(c, b[:]); err != nil {
			return t, err
		}
		t.Addr = netip.AddrFrom16(b).Unmap()
	case socksAtypDomain:
		var n [1]byte
		if _, err := io.ReadFull(c, n[:]); err != nil {
			return t, err
		}
		if n[0] == 0 {
			return t, &socksError{reply: socksGeneralFailure, msg: "empty domain name"}
		}
		name := make([]byte, n[0])
		if _, err := io.ReadFull(c, name); err != nil {
			return t, err
		}
		t.Host = string(name)
		if a, err := netip.ParseAddr(t.Host); err == nil {
			t.Host, t.Addr = "", a.Unmap()
		}
	default:
		return t, &socksError{reply: socksAddrNotSupported, msg: fmt.Sprintf("address type %d", atyp)}
	}
	var p [2]byte
	if _, err := io.ReadFull(c, p[:]); err != nil {
		return t, err
	}
	t.Port = binary.BigEndian.Uint16(p[:])
	return t, nil
}

// ServeTransparent serves captured connections (port 15001) on ln: the
// destination is the SO_ORIGINAL_DST of each connection, or its local
// address when it was not redirected; the source is the workload owning
// the client address.
func (o *Outbound) ServeTransparent(ln net.Listener) error {
	return o.serve(ln, func(c net.Conn) {
		src, err := o.source(c)
		if err != nil {
			o.deps.Metrics.Refused(metrics.ReporterSource, ReasonUnknownSource)
			return
		}
		o.handleTransparent(c, src)
	})
}

// ServeCaptured serves the connections an enrolled pod's rules redirect to
// ln (its 15001, inside its network namespace). The source is the pod's
// workload, uid, from its enrolment: never an address. Until xDS knows the
// workload, or when it is not on this node, connections are refused.
func (o *Outbound) ServeCaptured(ln net.Listener, uid string) error {
	return o.serve(ln, func(c net.Conn) {
		w, ok := o.deps.Store.Load().Workload(uid)
		if !ok || w.Synthetic() || w.Node != o.cfg.Node {
			o.deps.Metrics.Refused(metrics.ReporterSource, ReasonUnknownSource)
			o.deps.Log.Debug("captured connection of a pod xDS does not place on this node", "uid", uid)
			return
		}
		o.deps.Metrics.Captured(metrics.DirectionOutbound)
		o.handleTransparent(c, w)
	})
}

func (o *Outbound) handleTransparent(c net.Conn, src *state.Workload) {
	dst, _, err := netns.OriginalDst(c)
	if err != nil {
		o.deps.Metrics.Refused(metrics.ReporterSource, ReasonNoRoute)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(maxAttempts)*o.cfg.DialTimeout)
	defer cancel()
	o.handle(ctx, c, src, Target{Addr: dst.Addr(), Port: dst.Port()}, func(error) error { return nil })
}
