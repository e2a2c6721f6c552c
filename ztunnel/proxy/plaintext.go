package proxy

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"slices"
	"sync"

	"github.com/isthmus-mesh/isthmus/internal/conntrack"
	"github.com/isthmus-mesh/isthmus/ztunnel/authz"
	"github.com/isthmus-mesh/isthmus/ztunnel/hbone"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// Plaintext inbound refusal reasons.
const (
	// ReasonPlaintextRefused: plaintext to a workload whose peer
	// authentication is STRICT (the default).
	ReasonPlaintextRefused = "plaintext_refused"
	// ReasonUnknownDestination: the original destination is not the pod's.
	ReasonUnknownDestination = "unknown_destination"
)

// PlaintextPolicy decides whether plaintext (non-HBONE) connections from
// src may reach port of workload w when there is no Deps.Authorizer (which
// otherwise decides: PeerAuthentication, then the workload's
// authorization). It must be safe for concurrent use. Nil refuses all
// plaintext (STRICT).
type PlaintextPolicy func(w *state.Workload, src, dst netip.AddrPort) bool

// PlaintextInbound serves an enrolled pod's inbound plaintext capture
// (15006, inside the pod's network namespace): connections that arrive
// without HBONE. They are refused unless the policy allows plaintext to the
// destination port; allowed ones are relayed to the application. Safe for
// concurrent use; Close is idempotent and waits for connections.
type PlaintextInbound struct {
	cfg    Config
	deps   Deps
	pod    string
	policy PlaintextPolicy
	t      *conntrack.Tracker
}

// NewPlaintextInbound returns the plaintext inbound of the enrolled pod with
// workload uid; deps.Dialer reaches the application from inside the pod.
func NewPlaintextInbound(cfg Config, deps Deps, uid string, policy PlaintextPolicy) (*PlaintextInbound, error) {
	cfg = cfg.withDefaults()
	deps, err := deps.withDefaults(cfg)
	if err != nil {
		return nil, err
	}
	return &PlaintextInbound{cfg: cfg, deps: deps, pod: uid, policy: policy,
		t: conntrack.New(conntrack.Limits{MaxConns: cfg.MaxClientConns, MaxPerPeer: cfg.MaxClientConnsPerSource})}, nil
}

// Serve serves ln until ln or p is closed.
func (p *PlaintextInbound) Serve(ln net.Listener) error {
	p.deps.Self.Add(ln.Addr())
	defer p.deps.Self.Remove(ln.Addr())
	return p.t.Serve(ln, p.handle, func(net.Conn, error) {
		p.deps.Metrics.Refused(metrics.ReporterDestination, ReasonConnLimit)
	})
}

// Close ends every connection and waits; idempotent.
func (p *PlaintextInbound) Close() error {
	p.t.Close()
	return nil
}

// Conns returns the number of connections being served.
func (p *PlaintextInbound) Conns() int { return p.t.Len() }

// refuse counts a refused connection and closes its record.
func (p *PlaintextInbound) refuse(rec *ConnRecord, reason string, err error) {
	p.deps.Metrics.Refused(metrics.ReporterDestination, reason)
	rec.Detail = reason
	rec.Close(closeReason(reason), 0, 0, err)
}

func (p *PlaintextInbound) handle(c net.Conn) {
	p.deps.Metrics.Captured(metrics.DirectionInboundPlaintext)
	rec := p.cfg.AccessLog.Open(DirectionInbound)
	dst, _, err := netns.OriginalDst(c)
	src, ok := hbone.AddrPortOf(c.RemoteAddr())
	rec.Source, rec.Destination = addrString(src), addrString(dst)
	rec.Labels = metrics.ConnLabels{Reporter: metrics.ReporterDestination, SourceCluster: metrics.Unknown, SourceNetwork: metrics.Unknown}
	w, known := p.deps.Store.Load().Workload(p.pod)
	if err != nil || !ok || !known || !slices.Contains(w.Addresses, dst.Addr()) {
		p.refuse(rec, ReasonUnknownDestination, err)
		return
	}
	snap := p.deps.Store.Load()
	rec.Labels = withService(withDestination(rec.Labels, w), serviceServing(snap, w, dst.Port()))
	if err := p.deps.Self.Check(dst); err != nil {
		// Sent to one of ztunnel's in-pod ports (arriving redirected, with
		// that as its original destination): dialling it from inside the
		// pod would bring the connection back into ztunnel, again and
		// again.
		p.refuse(rec, ReasonSelfDestination, err)
		p.deps.Log.Debug("plaintext inbound to ztunnel itself refused", "pod", p.pod, "dst", dst)
		return
	}
	var upMu sync.Mutex
	var up net.Conn
	revoke := func() { // a policy change now refuses the connection
		c.Close()
		upMu.Lock()
		if up != nil {
			up.Close()
		}
		upMu.Unlock()
	}
	if p.deps.Authorizer != nil {
		// PeerAuthentication (is plaintext allowed on this port at all?),
		// then the workload's authorization with no peer identity.
		release, err := p.deps.Authorizer.Admit(context.Background(), authz.Conn{Workload: w.UID, Plaintext: true,
			SourceIP: src.Addr(), DestinationIP: dst.Addr(), DestinationPort: dst.Port()}, revoke)
		if err != nil {
			reason := ReasonPlaintextRefused
			var d *authz.DeniedError
			if errors.As(err, &d) {
				reason = ReasonAuthzPrefix + d.Decision.Reason
				rec.Policy, rec.PolicyReason = d.Decision.Policy(), d.Decision.Reason
			}
			p.refuse(rec, reason, err)
			p.deps.Log.Debug("plaintext inbound refused", "pod", p.pod, "port", dst.Port(), "err", err)
			return
		}
		defer release()
	} else if p.policy == nil || !p.policy(w, src, dst) {
		p.refuse(rec, ReasonPlaintextRefused, nil)
		p.deps.Log.Debug("plaintext inbound refused", "pod", p.pod, "port", dst.Port())
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), p.cfg.DialTimeout)
	conn, err := p.deps.Dialer.DialContext(ctx, "tcp", dst.String())
	cancel()
	if err != nil {
		p.refuse(rec, ReasonUpstreamConnect, err)
		return
	}
	upMu.Lock()
	up = conn
	upMu.Unlock()
	defer up.Close()
	rec.Established()
	mc := p.deps.Metrics.Open(rec.Labels)
	defer mc.Close()
	fromSrc, toSrc, err := hbone.Relay(c, up, mc.AddReceived, mc.AddSent)
	reason := CloseOK
	if err != nil {
		reason = CloseReset
	}
	rec.Close(reason, toSrc, fromSrc, err)
}
