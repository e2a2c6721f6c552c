package proxy

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strconv"

	"github.com/isthmus-mesh/isthmus/internal/conntrack"
	"github.com/isthmus-mesh/isthmus/ztunnel/hbone"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// Gateway refusal reasons.
const (
	ReasonUnknownService  = "unknown_service"
	ReasonUnknownPort     = "unknown_port"
	ReasonNoLocalEndpoint = "no_local_endpoint"
	// ReasonNotVisible: the service's endpoints on this network may not be
	// reached from other clusters (cluster-local, or not exported).
	ReasonNotVisible = "service_not_visible"
)

// GatewayConfig configures an east-west Gateway.
type GatewayConfig struct {
	Config
	// Network and Cluster are where the gateway runs; it forwards only to
	// endpoints of Network.
	Network string
	Cluster string
	// Identity is the gateway's own identity, presented to every client.
	Identity identity.Identity
}

// Gateway terminates outer HBONE from other networks (with its own
// identity; clients must belong to the trust domain), resolves the CONNECT
// target <hostname>:<port> to a ready endpoint of that service on its own
// network, and passes the inner (still encrypted) tunnel to
// <endpoint>:HBONEPort without decrypting it. ServeTLS serves the same
// endpoints to mTLS clients that cannot speak HBONE, routed by Istio's SNI
// (gateway_tls.go). Run closes the open tunnels a visibility change no
// longer admits. Safe for concurrent use.
type Gateway struct {
	cfg  GatewayConfig
	deps Deps
	srv  *hbone.Server
	sel  state.Selector
	ej   *ejections
	// tunnels are the open tunnels, checked again on every state change
	// (gateway_tunnels.go).
	tunnels gatewayTunnels
	// t tracks SNI passthrough connections, client opens their HBONE
	// streams (as the gateway) and stop ends them when the gateway closes.
	t       *conntrack.Tracker
	client  *hbone.Client
	stop    context.Context
	stopAll context.CancelFunc
}

// NewGateway returns a Gateway.
func NewGateway(cfg GatewayConfig, deps Deps, sel state.Selector) (*Gateway, error) {
	cfg.Config = cfg.Config.withDefaults()
	deps, err := deps.withDefaults(cfg.Config)
	if err != nil {
		return nil, err
	}
	if cfg.Identity.IsZero() || cfg.Network == "" {
		return nil, errors.New("gateway: Identity and Network are required")
	}
	g := &Gateway{cfg: cfg, deps: deps, sel: sel, ej: newEjections(cfg.EjectionTime, deps.Now), tunnels: gatewayTunnels{open: map[*openTunnel]struct{}{}}}
	scfg := cfg.Server
	scfg.Reporter = metrics.ReporterGateway
	g.srv, err = hbone.NewServer(scfg, hbone.ServerDeps{
		Certs: deps.Certs, Handler: g, Metrics: deps.Metrics, Log: deps.Log.With("component", "gateway"),
		Select: func(ctx context.Context, _ netip.Addr) (*tls.Certificate, error) {
			return deps.Certs.Certificate(ctx, cfg.Identity)
		},
	})
	if err != nil {
		return nil, err
	}
	g.client, err = hbone.NewClient(cfg.Client, hbone.ClientDeps{Certs: deps.Certs, Dialer: deps.Dialer, Log: deps.Log.With("component", "gateway-tls")})
	if err != nil {
		return nil, err
	}
	g.t = conntrack.New(conntrack.Limits{MaxConns: cfg.MaxClientConns, MaxPerPeer: cfg.MaxClientConnsPerSource})
	g.stop, g.stopAll = context.WithCancel(context.Background())
	return g, nil
}

// Serve serves outer HBONE on ln until ln or the gateway is closed.
func (g *Gateway) Serve(ln net.Listener) error {
	g.deps.Self.AddHBONE(ln.Addr())
	defer g.deps.Self.Remove(ln.Addr())
	return g.srv.Serve(ln)
}

// Drain tells every outer connection (with an HTTP/2 GOAWAY) to open no
// new tunnel on it; the tunnels open run on (hbone.Server.Drain).
func (g *Gateway) Drain() { g.srv.Drain() }

// Conns is the number of outer HBONE and SNI passthrough connections
// being served.
func (g *Gateway) Conns() int { return g.srv.Conns() + g.t.Len() }

// Close stops the gateway and waits for its connections; idempotent.
func (g *Gateway) Close() error {
	g.stopAll()
	g.t.Close()
	return errors.Join(g.srv.Close(), g.client.Close())
}

// Connect implements hbone.Handler for outer CONNECTs, and writes the
// access log line of each one when it is refused or ends.
func (g *Gateway) Connect(ctx context.Context, req *hbone.Request) (hbone.Upstream, error) {
	rec := g.cfg.AccessLog.Open(DirectionGateway)
	rec.Source, rec.HBONE = addrString(req.Remote), addrString(req.Local)
	srcCluster, srcNetwork := sourcePlace(g.deps.Store.Load(), req.Header)
	rec.Labels = metrics.ConnLabels{Reporter: metrics.ReporterGateway, MutualTLS: true, SourcePrincipal: req.Peer.String(),
		SourceNamespace: req.Peer.Namespace, SourceCluster: srcCluster, SourceNetwork: srcNetwork}
	up, err := g.connect(ctx, req, rec)
	if err != nil {
		refused(rec, err)
		return up, err
	}
	rec.Established()
	up.Done = func(res hbone.StreamResult) {
		reason := CloseOK
		if res.Err != nil {
			reason = CloseReset
		}
		rec.Close(reason, res.Sent, res.Received, res.Err)
	}
	return up, nil
}

// connect is Connect; it fills rec as soon as it knows the destination.
func (g *Gateway) connect(ctx context.Context, req *hbone.Request, rec *ConnRecord) (hbone.Upstream, error) {
	host, portStr, err := net.SplitHostPort(req.Authority)
	port, perr := strconv.ParseUint(portStr, 10, 16)
	if err != nil || perr != nil {
		return hbone.Upstream{}, hbone.Refuse(http.StatusBadRequest, hbone.ReasonBadAuthority, "authority %q", req.Authority)
	}
	svc, cands, err := g.candidates(g.deps.Store.Load(), host, uint16(port))
	if svc != nil {
		rec.Labels = withService(rec.Labels, svc)
	}
	if err != nil {
		return hbone.Upstream{}, err
	}
	c, ep, err := g.dial(ctx, cands, g.dialHBONE)
	if err != nil {
		return hbone.Upstream{}, hbone.Refuse(http.StatusServiceUnavailable, ReasonUpstreamConnect, "%v", err)
	}
	w := ep.Workload
	if !g.track(ctx, host, w.Cluster, c) {
		c.Close()
		return hbone.Upstream{}, hbone.Refuse(http.StatusForbidden, ReasonNotVisible, "service %s is no longer visible from other clusters", host)
	}
	labels := metrics.ConnLabels{
		Reporter:             metrics.ReporterGateway,
		SourcePrincipal:      req.Peer.String(),
		DestinationPrincipal: w.Identity().String(),
		SourceCluster:        rec.Labels.SourceCluster, // sourcePlace, in Connect
		DestinationCluster:   w.Cluster,
		SourceNetwork:        rec.Labels.SourceNetwork,
		DestinationNetwork:   w.Network,
	}
	// The log has the service and the endpoint too (the gateway's metrics
	// do not carry them).
	rec.Labels = withService(labels, svc)
	rec.Labels.SourceNamespace = req.Peer.Namespace
	rec.Labels.DestinationWorkload, rec.Labels.DestinationNamespace = w.WorkloadName, w.Namespace
	endpoint := netip.AddrPortFrom(w.Addresses[0], ep.TargetPort).String()
	rec.Destination = endpoint
	return hbone.Upstream{
		Conn:   c,
		Header: http.Header{HeaderEndpoint: {endpoint}},
		Labels: labels,
	}, nil
}

// candidates returns the service of host and its ready endpoints on the
// gateway's network that other clusters may reach on port, best first: the
// visibility rules every path through the gateway (HBONE and SNI
// passthrough) applies. The error is a Refusal naming the reason; svc is
// set whenever host names a service.
func (g *Gateway) candidates(snap *state.Snapshot, host string, port uint16) (*state.Service, []state.Endpoint, error) {
	svc, ok := snap.ServiceByHostname(host)
	if !ok {
		return nil, nil, hbone.Refuse(http.StatusNotFound, ReasonUnknownService, "service %s", host)
	}
	if !svc.HasPort(port) {
		return svc, nil, hbone.Refuse(http.StatusNotFound, ReasonUnknownPort, "service %s port %d", host, port)
	}
	if svc.ClusterLocal {
		// Tunnels through a gateway come from other networks, so from other
		// clusters: the same visibility rule as EDS.
		return svc, nil, hbone.Refuse(http.StatusForbidden, ReasonNotVisible, "service %s is cluster-local", host)
	}
	local := func(w *state.Workload) bool {
		return w.Network == g.cfg.Network && len(w.Addresses) > 0 && w.Protocol == state.TunnelHBONE
	}
	// Relay: the client applied a STRICT preference already (a gateway
	// falls back among its network's endpoints).
	src := state.Source{Network: g.cfg.Network, Cluster: g.cfg.Cluster, Relay: true}
	cands, err := g.sel.Rank(snap, svc, port, src, func(w *state.Workload) bool {
		return local(w) && svc.ReachableFromOtherClusters(w.Cluster)
	})
	if err != nil {
		if _, lerr := g.sel.SelectWhere(snap, svc, port, src, local); lerr == nil {
			return svc, nil, hbone.Refuse(http.StatusForbidden, ReasonNotVisible, "service %s: its endpoints on %s are not exported", host, g.cfg.Network)
		}
		// Never bounce a tunnel to another network.
		return svc, nil, hbone.Refuse(http.StatusServiceUnavailable, ReasonNoLocalEndpoint, "service %s: no ready endpoint on %s", host, g.cfg.Network)
	}
	return svc, cands, nil
}

// dialHBONE opens TCP to ep's HBONE port: the inner tunnel of double HBONE
// is passed through on it.
func (g *Gateway) dialHBONE(ctx context.Context, ep state.Endpoint) (net.Conn, error) {
	addr := netip.AddrPortFrom(ep.Workload.Addresses[0], g.cfg.HBONEPort)
	if err := g.deps.Self.CheckTunnel(addr); err != nil {
		return nil, err
	}
	c, err := g.deps.Dialer.DialContext(ctx, "tcp", addr.String())
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", addr, err)
	}
	return c, nil
}

// dial connects, with open, to the first of cands (best first) that
// answers, trying at most maxAttempts, each for DialTimeout, the next one
// once the last failed or after AttemptDelay (see race); endpoints that
// recently failed, or were overtaken, are tried last.
func (g *Gateway) dial(ctx context.Context, cands []state.Endpoint, open func(context.Context, state.Endpoint) (net.Conn, error)) (net.Conn, state.Endpoint, error) {
	cands = g.ej.demote(cands)
	cands = cands[:min(len(cands), maxAttempts)]
	i, c, err := race(ctx, len(cands), g.cfg.AttemptDelay, g.cfg.DialTimeout,
		func(actx context.Context, i int) (net.Conn, error) { return open(actx, cands[i]) },
		func(c net.Conn) { c.Close() },
		func(i int, err error, _ bool) {
			if ctx.Err() != nil {
				return
			}
			g.ej.fail(cands[i].Workload.UID)
			g.deps.Log.Debug("gateway endpoint failed, trying the next", "endpoint", cands[i].Workload.UID, "err", err)
		})
	if err != nil {
		return nil, state.Endpoint{}, err
	}
	g.ej.succeed(cands[i].Workload.UID)
	return c, cands[i], nil
}
