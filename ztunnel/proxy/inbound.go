package proxy

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/isthmus-mesh/isthmus/ztunnel/authz"
	"github.com/isthmus-mesh/isthmus/ztunnel/hbone"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// Inbound refusal reasons.
const (
	ReasonDestinationNotLocal = "destination_not_local"
	ReasonDestinationMismatch = "destination_mismatch"
	ReasonPortNotAllowed      = "port_not_allowed"
	ReasonUpstreamConnect     = "upstream_connect_failed"
)

// ListenFunc opens a TCP listener; net.Listen by default.
type ListenFunc func(network, address string) (net.Listener, error)

// Deps are the collaborators shared by the proxies. Store and Certs are
// required.
type Deps struct {
	Store   *state.Store
	Certs   identity.CertSource
	Metrics *metrics.Metrics
	Log     *slog.Logger
	// Dialer opens plain TCP connections (to workloads, endpoints, and for
	// Outbound to HBONE peers); a net.Dialer by default.
	Dialer hbone.Dialer
	// Listen opens listeners; net.Listen by default.
	Listen ListenFunc
	// Resolver resolves the DNS names of gateways known only by name;
	// net.DefaultResolver by default.
	Resolver Resolver
	// Authorizer admits Inbound's connections (see authz.go); nil admits
	// every verified peer.
	Authorizer Authorizer
	// Now is the clock (endpoint ejections); time.Now by default.
	Now func() time.Time
	// Self is what is ztunnel itself, never dialled (see Self): share one
	// between the proxies of a namespace so that each knows the others'
	// listeners. Nil: a Self of the proxy's own, knowing Config.NodeIPs.
	Self *Self
}

// Resolver looks up the addresses of a DNS name.
type Resolver interface {
	LookupNetIP(ctx context.Context, network, host string) ([]netip.Addr, error)
}

func (d Deps) withDefaults(cfg Config) (Deps, error) {
	if d.Store == nil || d.Certs == nil {
		return d, errors.New("proxy: Store and Certs are required")
	}
	if d.Self == nil {
		d.Self = NewSelf(SelfConfig{NodeIPs: cfg.NodeIPs})
	}
	if d.Log == nil {
		d.Log = slog.New(slog.DiscardHandler)
	}
	if d.Dialer == nil {
		d.Dialer = &net.Dialer{}
	}
	if d.Listen == nil {
		d.Listen = net.Listen
	}
	if d.Resolver == nil {
		d.Resolver = net.DefaultResolver
	}
	if d.Now == nil {
		d.Now = time.Now
	}
	return d, nil
}

// Inbound serves HBONE on <address>:HBONEPort for every HBONE workload of
// this node, presents the certificate of the workload a connection arrived
// at, and forwards each CONNECT only to that workload's address and one of
// its service target ports. Run follows the state store, opening and closing
// listeners as local workloads come and go.
type Inbound struct {
	cfg  Config
	deps Deps
	srv  *hbone.Server
	// pod, when set, pins the Inbound to one enrolled pod's workload (its
	// listener is inside the pod's network namespace): the certificate
	// presented and the only destination are that workload's, whatever
	// address a connection arrived at.
	pod string

	mu       sync.Mutex
	lns      map[netip.Addr]net.Listener
	ready    bool
	draining bool // Drain was called: no more listeners
	wg       sync.WaitGroup
	once     sync.Once
}

// NewInbound returns an Inbound.
func NewInbound(cfg Config, deps Deps) (*Inbound, error) {
	cfg = cfg.withDefaults()
	deps, err := deps.withDefaults(cfg)
	if err != nil {
		return nil, err
	}
	in := &Inbound{cfg: cfg, deps: deps, lns: map[netip.Addr]net.Listener{}}
	scfg := cfg.Server
	scfg.Reporter = metrics.ReporterDestination
	in.srv, err = hbone.NewServer(scfg, hbone.ServerDeps{
		Certs: deps.Certs, Select: in.certFor, Handler: in,
		Metrics: deps.Metrics, Log: deps.Log.With("component", "inbound"),
	})
	if err != nil {
		return nil, err
	}
	return in, nil
}

// NewPodInbound returns an Inbound for the enrolled pod whose workload has
// uid, served on listeners inside the pod's network namespace (Serve);
// deps.Dialer reaches the pod's application from inside that namespace.
func NewPodInbound(cfg Config, deps Deps, uid string) (*Inbound, error) {
	in, err := NewInbound(cfg, deps)
	if err != nil {
		return nil, err
	}
	in.pod = uid
	return in, nil
}

// Serve serves HBONE on ln (an enrolled pod's 15008) until ln or the
// Inbound is closed.
func (in *Inbound) Serve(ln net.Listener) error {
	in.deps.Self.AddHBONE(ln.Addr())
	defer in.deps.Self.Remove(ln.Addr())
	return in.srv.Serve(ln)
}

// Ready reports whether the listeners match the state at least once.
func (in *Inbound) Ready() bool {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.ready
}

// Run keeps listeners in line with the local workloads until ctx ends, then
// closes the Inbound.
func (in *Inbound) Run(ctx context.Context) error {
	defer in.Close()
	in.deps.Store.Follow(ctx, in.reconcile)
	return nil
}

func (in *Inbound) reconcile(snap *state.Snapshot) {
	want := map[netip.Addr]bool{}
	for _, w := range snap.LocalWorkloads(in.cfg.Node) {
		if w.Protocol != state.TunnelHBONE {
			continue
		}
		for _, a := range w.Addresses {
			want[a] = true
		}
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.draining {
		return
	}
	for a, ln := range in.lns {
		if !want[a] {
			in.deps.Self.Remove(ln.Addr())
			ln.Close()
			delete(in.lns, a)
		}
	}
	for a := range want {
		if _, ok := in.lns[a]; ok {
			continue
		}
		addr := netip.AddrPortFrom(a, in.cfg.HBONEPort).String()
		ln, err := in.deps.Listen("tcp", addr)
		if err != nil {
			in.deps.Log.Error("inbound listen failed", "addr", addr, "err", err)
			continue
		}
		in.lns[a] = ln
		in.deps.Self.AddHBONE(ln.Addr())
		in.wg.Go(func() {
			if err := in.srv.Serve(ln); err != nil {
				in.deps.Log.Error("inbound serve ended", "addr", addr, "err", err)
			}
		})
	}
	in.ready = true
}

// Drain stops accepting (it closes the listeners the Inbound opened itself,
// and opens no more) and tells every HBONE connection to take no new
// stream (hbone.Server.Drain); the streams open now run on until they end
// or Close. Listeners given to Serve are the caller's to close.
func (in *Inbound) Drain() {
	in.mu.Lock()
	in.draining = true
	for a, ln := range in.lns {
		in.deps.Self.Remove(ln.Addr())
		ln.Close()
		delete(in.lns, a)
	}
	in.mu.Unlock()
	in.srv.Drain()
}

// Conns returns the number of HBONE connections being served.
func (in *Inbound) Conns() int { return in.srv.Conns() }

// Close stops all listeners and connections and waits; idempotent.
func (in *Inbound) Close() error {
	in.once.Do(func() {
		in.srv.Close()
		in.mu.Lock()
		for a, ln := range in.lns {
			in.deps.Self.Remove(ln.Addr())
			ln.Close()
			delete(in.lns, a)
		}
		in.mu.Unlock()
	})
	in.wg.Wait()
	return nil
}

func (in *Inbound) localWorkload(addr netip.Addr) (*state.Workload, bool) {
	snap := in.deps.Store.Load()
	if in.pod != "" {
		w, ok := snap.Workload(in.pod)
		if !ok || w.Synthetic() || !slices.Contains(w.Addresses, addr) {
			return nil, false
		}
		return w, true
	}
	w, ok := snap.WorkloadByAddr(addr)
	if !ok || w.Node != in.cfg.Node || w.Synthetic() {
		return nil, false
	}
	return w, true
}

func (in *Inbound) certFor(ctx context.Context, local netip.Addr) (*tls.Certificate, error) {
	if in.pod != "" {
		// In the pod's own namespace, any address the connection arrived
		// at is the pod's.
		if w, ok := in.deps.Store.Load().Workload(in.pod); ok && !w.Identity().IsZero() {
			return in.deps.Certs.Certificate(ctx, w.Identity())
		}
		return nil, fmt.Errorf("%w: pod %s not (yet) known", hbone.ErrNoCertificate, in.pod)
	}
	w, ok := in.localWorkload(local)
	if !ok || w.Identity().IsZero() {
		return nil, fmt.Errorf("%w: %s", hbone.ErrNoCertificate, local)
	}
	return in.deps.Certs.Certificate(ctx, w.Identity())
}

// Connect implements hbone.Handler for inbound CONNECTs, and writes the
// access log line of each one when it is refused or ends.
func (in *Inbound) Connect(ctx context.Context, req *hbone.Request) (hbone.Upstream, error) {
	rec := in.cfg.AccessLog.Open(DirectionInbound)
	rec.Source, rec.HBONE, rec.Destination = addrString(req.Remote), addrString(req.Local), req.Authority
	rec.Labels = metrics.ConnLabels{Reporter: metrics.ReporterDestination, MutualTLS: true, SourcePrincipal: req.Peer.String(), SourceNamespace: req.Peer.Namespace}
	up, adm, err := in.connect(ctx, req, rec)
	if err != nil {
		refused(rec, err)
		return up, err
	}
	rec.Established()
	up.Done = func(res hbone.StreamResult) {
		reason := CloseOK
		switch {
		case adm != nil && adm.wasRevoked():
			reason = ClosePolicyRevoked
		case res.Err != nil:
			reason = CloseReset
		}
		rec.Close(reason, res.Sent, res.Received, res.Err)
	}
	return up, nil
}

// refused closes rec for a CONNECT refused with err.
func refused(rec *ConnRecord, err error) {
	var ref *hbone.Refusal
	if errors.As(err, &ref) {
		rec.Detail = ref.Reason
	}
	var d *authz.DeniedError
	if errors.As(err, &d) {
		rec.Policy, rec.PolicyReason = d.Decision.Policy(), d.Decision.Reason
	}
	rec.Close(closeReason(rec.Detail), 0, 0, err)
}

// connect is Connect; it fills rec's labels as soon as it knows them.
func (in *Inbound) connect(ctx context.Context, req *hbone.Request, rec *ConnRecord) (hbone.Upstream, *admission, error) {
	host, portStr, err := net.SplitHostPort(req.Authority)
	target, aerr := netip.ParseAddr(host)
	port, perr := strconv.ParseUint(portStr, 10, 16)
	if err != nil || aerr != nil || perr != nil || port == 0 {
		return hbone.Upstream{}, nil, hbone.Refuse(http.StatusBadRequest, hbone.ReasonBadAuthority, "authority %q", req.Authority)
	}
	target = target.Unmap()
	tw, ok := in.localWorkload(target)
	if !ok {
		return hbone.Upstream{}, nil, hbone.Refuse(http.StatusForbidden, ReasonDestinationNotLocal, "%s is not a workload of node %s", target, in.cfg.Node)
	}
	snap := in.deps.Store.Load()
	labels := metrics.ConnLabels{Reporter: metrics.ReporterDestination, MutualTLS: true}
	labels = withService(withDestination(inboundSource(labels, snap, req), tw), serviceServing(snap, tw, uint16(port)))
	rec.Labels = labels
	if target != req.Local.Addr() {
		return hbone.Upstream{}, nil, hbone.Refuse(http.StatusMisdirectedRequest, ReasonDestinationMismatch, "connection for %s asked for %s", req.Local.Addr(), target)
	}
	if err := in.deps.Self.Check(netip.AddrPortFrom(target, uint16(port))); err != nil {
		// One of ztunnel's listeners (the pod's 15001, 15006, 15008 or
		// 15053, a node address): dialling it would bring the connection
		// back into ztunnel, again and again.
		return hbone.Upstream{}, nil, hbone.Refuse(http.StatusForbidden, ReasonSelfDestination, "%v", err)
	}
	if !tw.ServesPort(uint16(port)) {
		return hbone.Upstream{}, nil, hbone.Refuse(http.StatusForbidden, ReasonPortNotAllowed, "%s has no port %d", tw.Name, port)
	}
	if in.pod != "" {
		in.deps.Metrics.Captured(metrics.DirectionInboundHBONE)
	}
	adm, err := in.authorize(ctx, snap, req, tw, target, uint16(port))
	if err != nil {
		return hbone.Upstream{}, nil, err
	}
	dctx, cancel := context.WithTimeout(ctx, in.cfg.DialTimeout)
	defer cancel()
	c, err := in.deps.Dialer.DialContext(dctx, "tcp", req.Authority)
	if err != nil {
		if adm != nil {
			adm.release()
		}
		return hbone.Upstream{}, nil, hbone.Refuse(http.StatusServiceUnavailable, ReasonUpstreamConnect, "dial %s: %v", req.Authority, err)
	}
	if adm != nil {
		var ok bool
		if c, ok = adm.attach(c); !ok {
			return hbone.Upstream{}, nil, hbone.Refuse(http.StatusForbidden, ReasonAuthzPrefix+"revoked", "%s to %s: revoked by a policy change while connecting", req.Peer, tw.UID)
		}
	}
	return hbone.Upstream{Conn: c, Labels: labels}, adm, nil
}
