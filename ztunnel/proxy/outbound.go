package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strconv"

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
)

// ErrNoRoute means the destination is neither a known service nor a known
// workload, or cannot be reached from the source's network.
var ErrNoRoute = errors.New("no route to destination")

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
	t      *tracker
}

// NewOutbound returns an Outbound. sel customises endpoint selection (its
// zero value is fine).
func NewOutbound(cfg Config, deps Deps, sel state.Selector) (*Outbound, error) {
	cfg = cfg.withDefaults()
	deps, err := deps.withDefaults()
	if err != nil {
		return nil, err
	}
	client, err := hbone.NewClient(cfg.Client, hbone.ClientDeps{Certs: deps.Certs, Dialer: deps.Dialer, Log: deps.Log.With("component", "outbound")})
	if err != nil {
		return nil, err
	}
	return &Outbound{cfg: cfg, deps: deps, client: client, sel: sel, t: newTracker()}, nil
}

// Client returns the pooled HBONE client (for stats).
func (o *Outbound) Client() *hbone.Client { return o.client }

// Close stops listeners, ends connections, closes pooled HBONE connections
// and waits; idempotent.
func (o *Outbound) Close() error {
	o.t.close()
	return o.client.Close()
}

// source returns the local workload owning the client address of c.
func (o *Outbound) source(c net.Conn) (*state.Workload, error) {
	ap, ok := hbone.AddrPortOf(c.RemoteAddr())
	if !ok {
		return nil, fmt.Errorf("%w: client address %s", ErrNoRoute, c.RemoteAddr())
	}
	w, ok := o.deps.Store.Load().WorkloadByAddr(ap.Addr())
	if !ok || w.Node != o.cfg.Node || w.Synthetic() {
		return nil, fmt.Errorf("client %s is not a workload of node %s", ap.Addr(), o.cfg.Node)
	}
	return w, nil
}

// route is a resolved destination.
type route struct {
	dst        *state.Workload
	svc        *state.Service
	targetPort uint16
}

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
		ep, err := o.sel.Select(snap, svc, t.Port, state.SourceOf(src))
		if err != nil {
			return route{}, err
		}
		return route{dst: ep.Workload, svc: svc, targetPort: ep.TargetPort}, nil
	}
	w, ok := snap.WorkloadByAddr(t.Addr)
	if !ok {
		return route{}, fmt.Errorf("%w: unknown address %s", ErrNoRoute, t.Addr)
	}
	return route{dst: w, targetPort: t.Port}, nil
}

// Dial connects src (a local workload) to t the way ztunnel would.
func (o *Outbound) Dial(ctx context.Context, src *state.Workload, t Target) (net.Conn, metrics.ConnLabels, error) {
	snap := o.deps.Store.Load()
	r, err := o.resolve(snap, src, t)
	if err != nil {
		return nil, metrics.ConnLabels{}, err
	}
	dst := r.dst
	labels := metrics.ConnLabels{
		Reporter:             metrics.ReporterSource,
		SourcePrincipal:      src.Identity().String(),
		DestinationPrincipal: dst.Identity().String(),
		SourceCluster:        src.Cluster,
		DestinationCluster:   dst.Cluster,
		SourceNetwork:        src.Network,
		DestinationNetwork:   dst.Network,
	}
	srcAddr := ""
	if len(src.Addresses) > 0 {
		srcAddr = src.Addresses[0].String()
	}
	bg := baggage{cluster: src.Cluster, namespace: src.Namespace, name: src.Name, network: src.Network}.String()

	if dst.Synthetic() || dst.Network != src.Network {
		gw := dst.Gateway
		if gw == nil {
			g, ok := snap.Gateway(dst.Network)
			if !ok {
				return nil, labels, fmt.Errorf("%w: no gateway for network %s", ErrNoRoute, dst.Network)
			}
			gw = g
		}
		if r.svc == nil {
			return nil, labels, fmt.Errorf("%w: %s is on network %s and not addressed as a service", ErrNoRoute, t, dst.Network)
		}
		c, err := o.dialDouble(ctx, src, dst, gw, r, t, srcAddr, bg)
		return c, labels, err
	}
	if len(dst.Addresses) == 0 {
		return nil, labels, fmt.Errorf("%w: workload %s has no address", ErrNoRoute, dst.UID)
	}
	addr := netip.AddrPortFrom(dst.Addresses[0], r.targetPort)
	if dst.Protocol != state.TunnelHBONE {
		dctx, cancel := context.WithTimeout(ctx, o.cfg.DialTimeout)
		defer cancel()
		c, err := o.deps.Dialer.DialContext(dctx, "tcp", addr.String())
		return c, labels, err
	}
	c, err := o.client.Dial(ctx, hbone.DialRequest{
		Source:    src.Identity(),
		Peer:      dst.Identity(),
		Addr:      netip.AddrPortFrom(dst.Addresses[0], o.cfg.HBONEPort),
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

// dialDouble opens an end-to-end HBONE stream to an endpoint of r.svc on a
// remote network, tunnelled through that network's gateway. Inner HTTP/2
// connections are pooled: streams to the same service through the same
// gateway share one outer stream while it has room.
func (o *Outbound) dialDouble(ctx context.Context, src, dst *state.Workload, gw *state.NetworkGateway, r route, t Target, srcAddr, bg string) (net.Conn, error) {
	outerAuthority := net.JoinHostPort(r.svc.Hostname, strconv.Itoa(int(t.Port)))
	srcID := src.Identity()
	underlay := func(ctx context.Context) (net.Conn, string, error) {
		gwAddr, err := o.gatewayAddr(ctx, gw)
		if err != nil {
			return nil, "", err
		}
		s, err := o.client.Dial(ctx, hbone.DialRequest{
			Source:    srcID,
			Peer:      gw.Identity,
			Addr:      gwAddr,
			Authority: outerAuthority,
			Header: http.Header{
				HeaderForwarded: {forwarded(srcAddr, outerAuthority)},
				HeaderBaggage:   {bg},
			},
		})
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
		Peer:         innerPeer(dst),
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

// innerPeer is the identity the end-to-end tunnel must reach: the remote
// workloads' identity when the control plane gives one, else (zero) any
// identity of the trust domain.
func innerPeer(dst *state.Workload) identity.Identity { return dst.Identity() }

// handle proxies one captured client connection to t.
func (o *Outbound) handle(ctx context.Context, c net.Conn, src *state.Workload, t Target, onConnected func(error) error) {
	up, labels, err := o.Dial(ctx, src, t)
	if err != nil {
		// Counted before the client hears of it.
		reason := ReasonUpstreamUnavailble
		if errors.Is(err, ErrNoRoute) || errors.Is(err, state.ErrNoEndpoint) {
			reason = ReasonNoRoute
		}
		o.deps.Metrics.Refused(metrics.ReporterSource, reason)
		o.deps.Log.Debug("outbound dial failed", "src", src.UID, "dst", t.String(), "err", err)
		_ = onConnected(err)
		return
	}
	if rerr := onConnected(nil); rerr != nil {
		up.Close()
		return
	}
	defer up.Close()
	mc := o.deps.Metrics.Open(labels)
	defer mc.Close()
	_, _, err = hbone.Relay(c, up, mc.AddReceived, mc.AddSent)
	if err != nil {
		o.deps.Log.Debug("outbound relay ended", "src", src.UID, "dst", t.String(), "err", err)
	}
}
