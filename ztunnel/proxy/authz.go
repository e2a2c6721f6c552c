package proxy

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"github.com/isthmus-mesh/isthmus/ztunnel/authz"
	"github.com/isthmus-mesh/isthmus/ztunnel/hbone"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// Authorizer admits inbound connections to this node's workloads;
// ztunnel/authz.Enforcer implements it. Admit returns an *authz.DeniedError
// for a refused connection; for an admitted one it may later call revoke
// (once, without blocking) when a policy change refuses it, and the caller
// calls release when the connection ends.
type Authorizer interface {
	Admit(ctx context.Context, c authz.Conn, revoke func()) (release func(), err error)
}

// ReasonAuthzPrefix starts the refusal reason of a connection refused by
// authorization: "authz_" + one of authz.Reasons, or "authz_revoked" for
// one a policy change refused while its upstream was being dialled.
const ReasonAuthzPrefix = "authz_"

// authorize admits an HBONE CONNECT to local workload w at target:port.
// Without an Authorizer every verified peer is admitted (no tracking).
func (in *Inbound) authorize(ctx context.Context, snap *state.Snapshot, req *hbone.Request, w *state.Workload, target netip.Addr, port uint16) (*admission, error) {
	if in.deps.Authorizer == nil {
		return nil, nil
	}
	c := authz.Conn{
		Workload: w.UID, Peer: req.Peer, SourceIP: sourceIP(snap, req),
		DestinationIP: target, DestinationPort: port,
	}
	a := &admission{}
	release, err := in.deps.Authorizer.Admit(ctx, c, a.revoke)
	if err != nil {
		reason := "denied"
		var d *authz.DeniedError
		if errors.As(err, &d) {
			reason = d.Decision.Reason
		}
		return nil, hbone.Refuse(http.StatusForbidden, ReasonAuthzPrefix+reason, "%s to %s: %w", req.Peer, w.UID, err)
	}
	a.release = release
	return a, nil
}

// admission is one admitted connection: revoke closes its upstream, even
// when it is attached only after the revocation.
type admission struct {
	release func()
	mu      sync.Mutex
	conn    net.Conn
	revoked bool
}

// wasRevoked reports whether a policy change revoked the admission.
func (a *admission) wasRevoked() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.revoked
}

func (a *admission) revoke() {
	a.mu.Lock()
	a.revoked = true
	c := a.conn
	a.mu.Unlock()
	if c != nil {
		c.Close()
	}
}

// attach ties the upstream c to the admission: closing the returned conn
// releases it. It fails (and releases) when the admission was revoked
// while c was dialled.
func (a *admission) attach(c net.Conn) (net.Conn, bool) {
	a.mu.Lock()
	revoked := a.revoked
	if !revoked {
		a.conn = c
	}
	a.mu.Unlock()
	if revoked {
		c.Close()
		a.release()
		return nil, false
	}
	return &admittedConn{Conn: c, release: a.release}, true
}

// admittedConn releases its admission when closed. It keeps the upstream's
// half-close and raw-socket access, which the relay uses.
type admittedConn struct {
	net.Conn
	release func()
	once    sync.Once
}

// Close closes the upstream and releases the admission once.
func (c *admittedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}

// CloseWrite half-closes the upstream.
func (c *admittedConn) CloseWrite() error { return hbone.CloseWrite(c.Conn) }

// SyscallConn gives the upstream's raw socket, if it has one.
func (c *admittedConn) SyscallConn() (syscall.RawConn, error) {
	if sc, ok := c.Conn.(syscall.Conn); ok {
		return sc.SyscallConn()
	}
	return nil, errors.ErrUnsupported
}

// sourceIP returns the source workload's address for authorization, or the
// zero Addr when it cannot be trusted. The candidates are the HBONE
// connection's own source address (a ztunnel that keeps the original
// source, or a client speaking HBONE itself) and the address the Forwarded
// header claims (what the source ztunnel says); one counts only when this
// node's state (its own network) has it as the address of a workload,
// not hostNetwork, that runs as the verified peer identity. So a peer can
// only claim addresses of its own identity, and a source behind a gateway
// (another network, whose addresses mean nothing here) has none.
func sourceIP(snap *state.Snapshot, req *hbone.Request) netip.Addr {
	cands := []netip.Addr{req.Remote.Addr().Unmap()}
	if fwd, ok := forwardedFor(req.Header.Get(HeaderForwarded)); ok {
		cands = append(cands, fwd)
	}
	for _, a := range cands {
		w, ok := snap.WorkloadByAddr(a)
		if ok && !w.Synthetic() && !w.HostNetwork && w.Identity() == req.Peer {
			return a
		}
	}
	return netip.Addr{}
}

// forwardedFor parses the address of the first for= of a Forwarded header
// (RFC 7239: quoted or not, IPv6 in brackets, with or without a port).
func forwardedFor(h string) (netip.Addr, bool) {
	for _, elem := range strings.Split(h, ",") {
		for _, pair := range strings.Split(elem, ";") {
			k, v, ok := strings.Cut(strings.TrimSpace(pair), "=")
			if !ok || !strings.EqualFold(k, "for") {
				continue
			}
			if uq, err := strconv.Unquote(v); err == nil {
				v = uq
			}
			if ap, err := netip.ParseAddrPort(v); err == nil {
				return ap.Addr().Unmap(), true
			}
			a, err := netip.ParseAddr(strings.TrimSuffix(strings.TrimPrefix(v, "["), "]"))
			return a.Unmap(), err == nil
		}
	}
	return netip.Addr{}, false
}
