package proxy

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strconv"

	"github.com/isthmus-mesh/isthmus/internal/conntrack"
	"github.com/isthmus-mesh/isthmus/ztunnel/hbone"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// Outbound refusal reasons.
const (
	ReasonUnknownSource      = "unknown_source"
	ReasonNoRoute            = "no_route"
	ReasonSOCKSProtocol      = "socks_protocol"
	ReasonUpstreamUnavailble = "upstream_unavailable"
	// ReasonSelfDestination: the destination is this node or one of
	// ztunnel's own listeners.
	ReasonSelfDestination = "self_destination"
	// ReasonNoPeerIdentity: the destination has no identity to verify.
	ReasonNoPeerIdentity = "no_peer_identity"
	// ReasonGatewayIdentity: a gateway presented an identity it may not.
	ReasonGatewayIdentity = "gateway_identity_mismatch"
	// ReasonPeerIdentity: the destination (directly, or end to end behind
	// a gateway) presented an identity it may not.
	ReasonPeerIdentity = "peer_identity_mismatch"
	// ReasonPeerTrustDomain: a peer (gateway or destination) presented an
	// identity of a trust domain that is not in the trust bundle.
	ReasonPeerTrustDomain = "peer_trust_domain_unknown"
	// ReasonPeerUntrusted: a peer's certificate does not chain to the
	// roots of the trust domain it names.
	ReasonPeerUntrusted = "peer_untrusted"
	// ReasonConnLimit and ReasonSourceConnLimit: the outbound listeners'
	// connection caps.
	ReasonConnLimit       = "connection_limit"
	ReasonSourceConnLimit = "source_connection_limit"
)

// Errors of Outbound.Dial, matched with errors.Is.
var (
	// ErrNoRoute means the destination is neither a known service nor a
	// known workload, or cannot be reached from the source's network.
	ErrNoRoute = errors.New("no route to destination")
	// ErrSelfDestination means the destination is this node or one of
	// ztunnel's own listeners.
	ErrSelfDestination = errors.New("destination is this node")
	// ErrNoPeerIdentity means the destination names no identity to verify.
	ErrNoPeerIdentity = errors.New("destination has no identity to verify")
	// ErrGatewayIdentity means a gateway presented an identity it may not.
	ErrGatewayIdentity = errors.New("gateway identity mismatch")
)

// Target is an outbound destination: a hostname or an address, and a port.
type Target struct {
	Host string
	Addr netip.Addr
	Port uint16
}

func (t Target) String() string {
	if t.Host != "" {
		return net.JoinHostPort(t.Host, strconv.Itoa(int(t.Port)))
	}
	return netip.AddrPortFrom(t.Addr, t.Port).String()
}

// Outbound carries application connections of this node's workloads over
// HBONE: directly to the destination's node on the same network, through
// the destination network's gateway (double HBONE) otherwise. The source
// workload is the one owning the client connection's remote address. Safe
// for concurrent use; Close is idempotent and waits for connections.
type Outbound struct {
	cfg    Config
	deps   Deps
	client *hbone.Client
	sel    state.Selector
	t      *conntrack.Tracker
	ej     *ejections
}

// NewOutbound returns an Outbound. sel customises endpoint selection (its
// zero value is fine).
func NewOutbound(cfg Config, deps Deps, sel state.Selector) (*Outbound, error) {
	cfg = cfg.withDefaults()
	deps, err := deps.withDefaults(cfg)
	if err != nil {
		return nil, err
	}
	client, err := hbone.NewClient(cfg.Client, hbone.ClientDeps{Certs: deps.Certs, Dialer: deps.Dialer, Log: deps.Log.With("component", "outbound")})
	if err != nil {
		return nil, err
	}
	return &Outbound{cfg: cfg, deps: deps, client: client, sel: sel,
		ej: newEjections(cfg.EjectionTime, deps.Now),
		t:  conntrack.New(conntrack.Limits{MaxConns: cfg.MaxClientConns, MaxPerPeer: cfg.MaxClientConnsPerSource})}, nil
}

// AddSelf records the address of one of ztunnel's own listeners in the
// Outbound's Self: it is never dialled (the listeners Outbound serves are
// recorded by themselves).
func (o *Outbound) AddSelf(addr net.Addr) { o.deps.Self.Add(addr) }

// Client returns the pooled HBONE client (for stats).
func (o *Outbound) Client() *hbone.Client { return o.client }

// Close stops listeners, ends connections, closes pooled HBONE connections
// and waits; idempotent.
func (o *Outbound) Close() error {
	o.t.Close()
	return o.client.Close()
}

// Conns returns the number of client connections being served.
func (o *Outbound) Conns() int { return o.t.Len() }

// source returns the local workload owning the client address of c. A node
// address is nobody's: hostNetwork workloads, and ztunnel itself, share it.
func (o *Outbound) source(c net.Conn) (*state.Workload, error) {
	ap, ok := hbone.AddrPortOf(c.RemoteAddr())
	if !ok {
		return nil, fmt.Errorf("%w: client address %s", ErrNoRoute, c.RemoteAddr())
	}
	if slices.Contains(o.cfg.NodeIPs, ap.Addr()) {
		return nil, fmt.Errorf("client %s is a node address, not a workload", ap.Addr())
	}
	w, ok := o.deps.Store.Load().WorkloadByAddr(ap.Addr())
	if !ok || w.Node != o.cfg.Node || w.Synthetic() || w.HostNetwork {
		return nil, fmt.Errorf("client %s is not a workload of node %s", ap.Addr(), o.cfg.Node)
	}
	return w, nil
}

// serve accepts client connections on ln through the tracker (with its
// caps, counted when hit) and records ln as one of ztunnel's own.
func (o *Outbound) serve(ln net.Listener, handle func(net.Conn)) error {
	o.deps.Self.Add(ln.Addr())
	defer o.deps.Self.Remove(ln.Addr())
	return o.t.Serve(ln, handle, func(c net.Conn, err error) {
		reason := ReasonConnLimit
		if errors.Is(err, conntrack.ErrPeerLimit) {
			reason = ReasonSourceConnLimit
		}
		o.deps.Metrics.Refused(metrics.ReporterSource, reason)
		o.deps.Log.Debug("outbound connection refused", "client", c.RemoteAddr(), "reason", reason)
	})
}

// route is a resolved destination: one workload addressed directly, or the
// endpoints of a service in the order to try them.
type route struct {
	svc   *state.Service
	cands []state.Endpoint
}

// maxAttempts bounds the endpoints one client connection tries.
const maxAttempts = 4

func (o *Outbound) resolve(snap *state.Snapshot, src *state.Workload, t Target) (route, error) {
	var svc *state.Service
	if t.Host != "" {
		s, ok := snap.ServiceByHostname(t.Host)
		if !ok {
			if a, err := netip.ParseAddr(t.Host); err == nil {
				t.Addr = a
			} else {
				return route{}, fmt.Errorf("%w: unknown host %s", ErrNoRoute, t.Host)
			}
		}
		svc = s
	}
	if svc == nil {
		if s, ok := snap.ServiceByVIP(t.Addr); ok {
			svc = s
		}
	}
	if svc != nil {
		cands, err := o.sel.Rank(snap, svc, t.Port, state.SourceOf(src), nil)
		if err != nil {
			return route{}, err
		}
		cands = o.ej.demote(cands)
		return route{svc: svc, cands: cands[:min(len(cands), maxAttempts)]}, nil
	}
	w, ok := snap.WorkloadByAddr(t.Addr)
	if !ok {
		return route{}, fmt.Errorf("%w: unknown address %s", ErrNoRoute, t.Addr)
	}
	return route{cands: []state.Endpoint{{Workload: w, TargetPort: t.Port}}}, nil
}

// Dial connects src (a local workload) to t the way ztunnel would. A
// service's endpoints are tried in preference order: when one cannot be
// reached (refused, unreachable, timed out after DialTimeout, or presenting
// the wrong identity), or has not answered within AttemptDelay, the next is
// tried too, within this one client connection (at most maxAttempts, see
// race); the first to connect wins, and new connections try the ones that
// failed or were overtaken last for EjectionTime. Every HBONE hop verifies its peer against the
// identities xDS says may answer: a workload's own identity on the same
// network; through a gateway, one of the gateway's identities for the outer
// tunnel and one of the remote endpoints' identities end to end.
func (o *Outbound) Dial(ctx context.Context, src *state.Workload, t Target) (net.Conn, metrics.ConnLabels, error) {
	c, d, err := o.dial(ctx, src, t)
	return c, d.labels, err
}

// dialed is a connection Dial opened, with its facts: the metric labels,
// and the HBONE address dialled when the destination was reached directly
// over HBONE (through a gateway the pooled tunnel hides it).
type dialed struct {
	conn   net.Conn
	labels metrics.ConnLabels
	hbone  string
}

// dial is Dial with the facts of the connection.
func (o *Outbound) dial(ctx context.Context, src *state.Workload, t Target) (net.Conn, dialed, error) {
	r, err := o.resolve(o.deps.Store.Load(), src, t)
	if err != nil {
		return nil, dialed{labels: withSource(metrics.ConnLabels{Reporter: metrics.ReporterSource}, src)}, err
	}
	if needsCertificate(r.cands) {
		// Fetched (or found cached) before the race: AttemptDelay measures
		// how long an endpoint takes to answer, and a source waiting for
		// its first certificate would otherwise set off (and eject) the
		// next endpoints while the first is not to blame. A failure shows
		// in the attempts.
		_, _ = o.deps.Certs.Certificate(ctx, src.Identity())
	}
	i, d, err := race(ctx, len(r.cands), o.cfg.AttemptDelay, o.cfg.DialTimeout,
		func(actx context.Context, i int) (dialed, error) {
			c, labels, err := o.dialEndpoint(actx, src, t, r.svc, r.cands[i])
			return dialed{conn: c, labels: labels, hbone: o.hboneAddrOf(src, r.cands[i].Workload)}, err
		},
		func(d dialed) { d.conn.Close() },
		func(i int, err error, last bool) {
			if ctx.Err() != nil {
				return
			}
			ep := r.cands[i]
			if r.svc != nil && (errors.Is(err, errOvertaken) || endpointFailed(err)) {
				o.ej.fail(ep.Workload.UID)
			}
			if last || errors.Is(err, errOvertaken) {
				return
			}
			// Counted here, as the connection goes on to another endpoint;
			// a last failure is counted by the caller.
			o.deps.Metrics.Refused(metrics.ReporterSource, dialReason(err))
			o.deps.Log.Debug("endpoint failed, trying the next", "endpoint", ep.Workload.UID, "err", err)
		})
	if err != nil {
		if d.labels.Reporter == "" && len(r.cands) > 0 {
			// No attempt returned labels: those of the first candidate.
			d.labels = withService(withDestination(withSource(metrics.ConnLabels{Reporter: metrics.ReporterSource}, src), r.cands[0].Workload), r.svc)
		}
		return nil, d, err
	}
	if r.svc != nil {
		o.ej.succeed(r.cands[i].Workload.UID)
	}
	return d.conn, d, nil
}

// hboneAddrOf is the HBONE address a connection from src to dst dials
// directly, or "" (plain TCP, or through a gateway).
func (o *Outbound) hboneAddrOf(src, dst *state.Workload) string {
	if dst.Synthetic() || dst.Network != src.Network || dst.Protocol != state.TunnelHBONE || len(dst.Addresses) == 0 {
		return ""
	}
	return netip.AddrPortFrom(dst.Addresses[0], o.cfg.HBONEPort).String()
}

// needsCertificate reports whether connecting to one of cands needs the
// source's certificate (an HBONE hop: to an HBONE workload, or through a
// gateway).
func needsCertificate(cands []state.Endpoint) bool {
	for _, ep := range cands {
		if dst := ep.Workload; dst.Protocol == state.TunnelHBONE || dst.Synthetic() {
			return true
		}
	}
	return false
}

// dialEndpoint connects src to endpoint ep (of svc, nil when t addressed a
// workload directly).
func (o *Outbound) dialEndpoint(ctx context.Context, src *state.Workload, t Target, svc *state.Service, ep state.Endpoint) (net.Conn, metrics.ConnLabels, error) {
	dst := ep.Workload
	labels := withService(withDestination(withSource(metrics.ConnLabels{Reporter: metrics.ReporterSource,
		MutualTLS: dst.Protocol == state.TunnelHBONE || dst.Synthetic()}, src), dst), svc)
	srcAddr := ""
	if len(src.Addresses) > 0 {
		srcAddr = src.Addresses[0].String()
	}
	bg := baggage{cluster: src.Cluster, namespace: src.Namespace, name: src.Name, network: src.Network}.String()

	if dst.Synthetic() || dst.Network != src.Network {
		if !dst.Synthetic() || svc == nil {
			return nil, labels, fmt.Errorf("%w: %s is on network %s and not addressed as a service", ErrNoRoute, t, dst.Network)
		}
		c, err := o.dialDouble(ctx, src, dst, svc, t, srcAddr, bg)
		return c, labels, err
	}
	if len(dst.Addresses) == 0 {
		return nil, labels, fmt.Errorf("%w: workload %s has no address", ErrNoRoute, dst.UID)
	}
	addr := netip.AddrPortFrom(dst.Addresses[0], ep.TargetPort)
	if err := o.deps.Self.Check(addr); err != nil {
		// Whatever carries it there, the connection would end at ztunnel.
		return nil, labels, err
	}
	if dst.Protocol != state.TunnelHBONE {
		c, err := o.deps.Dialer.DialContext(ctx, "tcp", addr.String())
		return c, labels, err
	}
	peers := dst.PeerIdentities()
	if len(peers) == 0 {
		return nil, labels, fmt.Errorf("%w: workload %s", ErrNoPeerIdentity, dst.UID)
	}
	hboneAddr := netip.AddrPortFrom(dst.Addresses[0], o.cfg.HBONEPort)
	if err := o.deps.Self.CheckTunnel(hboneAddr); err != nil {
		return nil, labels, err
	}
	c, err := o.client.Dial(ctx, hbone.DialRequest{
		Source:    src.Identity(),
		Peers:     peers,
		Addr:      hboneAddr,
		Authority: addr.String(),
		Header: http.Header{
			HeaderForwarded: {forwarded(srcAddr, t.String())},
			HeaderBaggage:   {bg},
		},
	})
	if err != nil {
		return nil, labels, err
	}
	return c, labels, nil
}

// gatewayOrder returns dst's gateways in the order to try them: a random
// order weighted by capacity, so that new tunnels spread over the gateways
// and each failure falls over to the next.
func (o *Outbound) gatewayOrder(gws []*state.NetworkGateway) []*state.NetworkGateway {
	rnd := o.sel.Rand
	if rnd == nil {
		rnd = rand.Uint64N
	}
	return state.WeightedOrder(gws, (*state.NetworkGateway).Weight, rnd)
}

// dialDouble opens an end-to-end HBONE stream to an endpoint of r.svc on a
// remote network, tunnelled through one of that network's gateways, trying
// the next gateway when one cannot be reached or does not verify. Inner
// HTTP/2 connections are pooled: streams to the same service through the
// same gateway share one outer stream while it has room.
func (o *Outbound) dialDouble(ctx context.Context, src, dst *state.Workload, svc *state.Service, t Target, srcAddr, bg string) (net.Conn, error) {
	if len(dst.Identities) == 0 {
		return nil, fmt.Errorf("%w: %s behind network %s", ErrNoPeerIdentity, svc.Hostname, dst.Network)
	}
	order := o.gatewayOrder(dst.Gateways)
	var errs []error
	for i, gw := range order {
		c, err := o.dialVia(ctx, src, dst, gw, svc, t, srcAddr, bg)
		if err == nil {
			return c, nil
		}
		errs = append(errs, err)
		if ctx.Err() != nil || i == len(order)-1 {
			break
		}
		// Counted here, as the connection goes on through the next
		// gateway; a last failure is counted by the caller.
		o.deps.Metrics.Refused(metrics.ReporterSource, dialReason(err))
		o.deps.Log.Debug("gateway failed, trying the next", "gateway", gw.Target(), "network", gw.Network, "err", err)
	}
	return nil, errors.Join(errs...)
}

// dialVia is dialDouble through gateway gw.
func (o *Outbound) dialVia(ctx context.Context, src, dst *state.Workload, gw *state.NetworkGateway, svc *state.Service, t Target, srcAddr, bg string) (net.Conn, error) {
	outerAuthority := net.JoinHostPort(svc.Hostname, strconv.Itoa(int(t.Port)))
	srcID := src.Identity()
	if len(gw.Identities) == 0 {
		return nil, fmt.Errorf("%w: gateway %s names no identity", ErrGatewayIdentity, gw.Target())
	}
	underlay := func(ctx context.Context) (net.Conn, string, error) {
		gwAddr, err := o.gatewayAddr(ctx, gw)
		if err != nil {
			return nil, "", err
		}
		if err := o.deps.Self.CheckTunnel(gwAddr); err != nil {
			return nil, "", err
		}
		s, err := o.client.Dial(ctx, hbone.DialRequest{
			Source:    srcID,
			Peers:     gw.Identities,
			Addr:      gwAddr,
			Authority: outerAuthority,
			Header: http.Header{
				HeaderForwarded: {forwarded(srcAddr, outerAuthority)},
				HeaderBaggage:   {bg},
			},
		})
		if errors.Is(err, identity.ErrUnexpectedIdentity) {
			err = fmt.Errorf("%w: %w", ErrGatewayIdentity, err)
		}
		if err != nil {
			return nil, "", fmt.Errorf("outer hbone to gateway %s: %w", gw.Target(), err)
		}
		// The gateway names the endpoint it chose and its target port: only
		// the remote network knows the port behind the service port.
		ep, err := netip.ParseAddrPort(s.ResponseHeader().Get(HeaderEndpoint))
		if err != nil {
			s.Close()
			return nil, "", fmt.Errorf("gateway %s named no valid endpoint: %w", gw.Target(), err)
		}
		return s, ep.String(), nil
	}
	return o.client.Dial(ctx, hbone.DialRequest{
		Source:       srcID,
		Peers:        dst.Identities,
		Underlay:     underlay,
		UnderlayKey:  "via " + gw.Target() + " " + outerAuthority,
		AuthorityFor: func(ep string) string { return ep },
		Header: http.Header{
			HeaderForwarded:        {forwarded(srcAddr, t.String())},
			HeaderBaggage:          {bg},
			HeaderForwardedNetwork: {src.Network},
		},
	})
}

// gatewayAddr returns where to reach gw: its address, or the first address
// its DNS name resolves to (IPv4 first). Names are resolved only when a new
// outer connection is needed: tunnels through a gateway share pooled ones.
func (o *Outbound) gatewayAddr(ctx context.Context, gw *state.NetworkGateway) (netip.AddrPort, error) {
	if gw.Address.IsValid() {
		return gw.AddrPort(), nil
	}
	ips, err := o.deps.Resolver.LookupNetIP(ctx, "ip", gw.Hostname)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("resolve gateway %s of network %s: %w", gw.Hostname, gw.Network, err)
	}
	if len(ips) == 0 {
		return netip.AddrPort{}, fmt.Errorf("resolve gateway %s of network %s: no address", gw.Hostname, gw.Network)
	}
	ip := ips[0]
	if i := slices.IndexFunc(ips, func(a netip.Addr) bool { return a.Unmap().Is4() }); i >= 0 {
		ip = ips[i]
	}
	return netip.AddrPortFrom(ip.Unmap(), gw.HBONEPort), nil
}

// handle proxies one captured client connection to t.
func (o *Outbound) handle(ctx context.Context, c net.Conn, src *state.Workload, t Target, onConnected func(error) error) {
	rec := o.cfg.AccessLog.Open(DirectionOutbound)
	if ap, ok := hbone.AddrPortOf(c.RemoteAddr()); ok {
		rec.Source = ap.String()
	}
	rec.Destination = t.String()
	up, d, err := o.dial(ctx, src, t)
	rec.Labels, rec.HBONE = d.labels, d.hbone
	if err != nil {
		// Counted before the client hears of it.
		reason := dialReason(err)
		o.deps.Metrics.Refused(metrics.ReporterSource, reason)
		o.deps.Log.Debug("outbound dial failed", "src", src.UID, "dst", t.String(), "err", err)
		rec.Detail = reason
		rec.Close(closeReason(reason), 0, 0, err)
		_ = onConnected(err)
		return
	}
	if rerr := onConnected(nil); rerr != nil {
		up.Close()
		rec.Close(CloseReset, 0, 0, rerr)
		return
	}
	defer up.Close()
	rec.Established()
	mc := o.deps.Metrics.Open(d.labels)
	defer mc.Close()
	// The relay's totals are the bytes the metrics counted.
	toDst, fromDst, err := hbone.Relay(c, up, mc.AddReceived, mc.AddSent)
	if err != nil {
		o.deps.Log.Debug("outbound relay ended", "src", src.UID, "dst", t.String(), "err", err)
		rec.Close(CloseReset, toDst, fromDst, err)
		return
	}
	rec.Close(CloseOK, toDst, fromDst, nil)
}

// dialReason is the refusal reason of a failed Dial.
// endpointFailed reports whether err says the endpoint (or, for one behind
// a gateway, its network's gateway) could not serve the connection, as
// opposed to a refusal by policy or a bad request, which another attempt
// would meet too.
func endpointFailed(err error) bool {
	var se *hbone.StatusError
	if errors.As(err, &se) {
		return se.Code >= 500
	}
	return !errors.Is(err, ErrNoRoute) && !errors.Is(err, ErrSelfDestination) && !errors.Is(err, ErrNoPeerIdentity)
}

func dialReason(err error) string {
	switch {
	case errors.Is(err, ErrNoRoute), errors.Is(err, state.ErrNoEndpoint):
		return ReasonNoRoute
	case errors.Is(err, ErrSelfDestination):
		return ReasonSelfDestination
	case errors.Is(err, ErrNoPeerIdentity), errors.Is(err, hbone.ErrNoPeerIdentity):
		return ReasonNoPeerIdentity
	case errors.Is(err, ErrGatewayIdentity):
		return ReasonGatewayIdentity
	case errors.Is(err, identity.ErrUnexpectedIdentity):
		return ReasonPeerIdentity
	case errors.Is(err, identity.ErrWrongTrustDomain):
		return ReasonPeerTrustDomain
	case errors.Is(err, identity.ErrUntrustedPeer), errors.Is(err, identity.ErrNoIdentity):
		return ReasonPeerUntrusted
	default:
		return ReasonUpstreamUnavailble
	}
}
