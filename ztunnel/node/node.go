// Package node wires one ztunnel process: the delta xDS client feeds a
// state store; the CA client keeps the certificates of the node's workloads
// (and of the ztunnel itself) following that store; and the proxies serve
// from both — in node mode the inbound HBONE listeners on <pod
// address>:15008 of each local workload (opened as workloads arrive and
// closed as they leave), outbound capture (15001) and SOCKS5 (15080); in
// gateway mode the east-west gateway — plus the admin (15000), readiness
// (15021) and metrics (15020) endpoints. In node mode the xDS client also
// takes pilot's authorization resources into an authz.Store, and an
// authz.Enforcer admits inbound connections and closes those a policy change
// refuses. Run starts everything and stops it gracefully when its context
// ends.
package node

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/isthmus-mesh/isthmus/internal/version"
	"github.com/isthmus-mesh/isthmus/ztunnel/admin"
	"github.com/isthmus-mesh/isthmus/ztunnel/authz"
	"github.com/isthmus-mesh/isthmus/ztunnel/caclient"
	"github.com/isthmus-mesh/isthmus/ztunnel/dns"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/inpod"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
	"github.com/isthmus-mesh/isthmus/ztunnel/podproxy"
	"github.com/isthmus-mesh/isthmus/ztunnel/proxy"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
	"github.com/isthmus-mesh/isthmus/ztunnel/xdsclient"
)

// Node is one ztunnel process. Build it with New and drive it with Run;
// Ready, Store and Certs are safe for concurrent use.
type Node struct {
	cfg   Config
	deps  Deps
	log   *slog.Logger
	id    identity.Identity
	store *state.Store
	xds   *xdsclient.Client
	certs *caclient.Manager
	roots *caclient.RootsFile // nil with Deps.RootsPEM
	admin http.Handler

	in  *proxy.Inbound  // node mode, without InPodSocket
	out *proxy.Outbound // node mode
	gw  *proxy.Gateway  // gateway mode

	draining atomic.Bool     // a requested stop is draining: not ready
	authz    *authz.Enforcer // node mode, unless Config.NoAuthorization
	self     *proxy.Self     // the node namespace's listeners and addresses
	// access is the proxies' access log and table of open connections.
	access *proxy.AccessLog

	pods  *podproxy.Manager // node mode with InPodSocket
	inpod *inpod.Client
	dnsM  *dns.Metrics
	m     *metrics.Metrics

	// proxyListen opens the proxies' listeners, httpListen the admin,
	// readiness and metrics ones (Deps.Listen).
	proxyListen, httpListen proxy.ListenFunc

	runMu   sync.Mutex
	started bool
	closed  bool
	cancel  context.CancelFunc
	done    chan struct{}
}

// New builds a ztunnel from cfg. It reads the root bundle file (unless
// Deps.RootsPEM is set) and opens no connection or listener.
func New(cfg Config, deps Deps) (*Node, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("ztunnel config: %w", err)
	}
	if deps.Log == nil {
		deps.Log = slog.New(slog.DiscardHandler)
	}
	if deps.Registry == nil {
		deps.Registry = prometheus.NewRegistry()
	}
	if err := registerProcessMetrics(deps.Registry); err != nil {
		return nil, fmt.Errorf("ztunnel metrics: %w", err)
	}
	if deps.Token == nil {
		deps.Token = caclient.TokenFile(cfg.TokenFile)
	}
	log := deps.Log.With("node", cfg.NodeName, "cluster", cfg.ClusterID, "network", cfg.Network, "mode", string(cfg.Mode))
	n := &Node{
		cfg: cfg, deps: deps, log: log, store: state.NewStore(), proxyListen: deps.Listen, httpListen: deps.Listen,
		id: identity.Identity{TrustDomain: cfg.TrustDomain, Namespace: cfg.Namespace, ServiceAccount: cfg.ServiceAccount},
	}
	if deps.Listen == nil {
		n.proxyListen, n.httpListen = reusePortListen, net.Listen
	}
	var roots caclient.RootSource
	if deps.RootsPEM != nil {
		static, err := caclient.NewStaticRoots(cfg.TrustDomain, deps.RootsPEM, deps.TrustBundle)
		if err != nil {
			return nil, fmt.Errorf("ztunnel: %w", err)
		}
		roots = static
	} else {
		rf, err := caclient.NewRootsFile(caclient.RootsFileConfig{Path: cfg.RootCertFile, TrustBundlePath: cfg.TrustBundleFile,
			TrustDomain: cfg.TrustDomain, Interval: cfg.RootsReloadInterval}, log)
		if err != nil {
			return nil, fmt.Errorf("ztunnel: %w", err)
		}
		roots, n.roots = rf, rf
	}
	var err error
	n.certs, err = caclient.New(caclient.Config{
		Address: cfg.CAAddress, ServerName: cfg.CAServerName, ClusterID: cfg.ClusterID,
		Node: cfg.NodeName, NodeIdentity: n.id, TTL: cfg.CertTTL, OwnOnly: cfg.Mode == ModeGateway,
	}, caclient.Deps{Token: deps.Token, Roots: roots, Store: n.store, Log: log})
	if err != nil {
		return nil, err
	}
	xdsCreds := deps.XDSCredentials
	switch {
	case xdsCreds != nil:
	case cfg.XDSPlaintext:
		xdsCreds = insecure.NewCredentials()
	default:
		xdsCreds = credentials.NewTLS(n.certs.ClientTLS(cfg.XDSServerName))
	}
	var types []xdsclient.TypeHandler
	if cfg.Mode == ModeNode && !cfg.NoAuthorization {
		as := authz.NewStore()
		if n.authz, err = authz.New(cfg.Authorization, authz.Deps{Store: as, Registerer: deps.Registry, Log: log}); err != nil {
			n.certs.Close()
			return nil, fmt.Errorf("ztunnel authorization: %w", err)
		}
		types = append(types, as)
	}
	n.xds, err = xdsclient.New(xdsclient.Config{
		Address: cfg.XDSAddress, NodeID: cfg.NodeID, NodeName: cfg.NodeName,
		ClusterID: cfg.ClusterID, Network: cfg.Network, TrustDomain: cfg.TrustDomain,
	}, xdsclient.Deps{Store: n.store, Credentials: xdsCreds, Log: log, Types: types, Registerer: deps.Registry})
	if err != nil {
		n.certs.Close()
		return nil, err
	}
	if err := n.buildProxies(); err != nil {
		n.certs.Close()
		return nil, err
	}
	ad := admin.Deps{Store: n.store, Certs: n.certs.Dump, Gatherer: deps.Registry, Ready: n.Ready, Connections: n.access.Active}
	if n.authz != nil {
		ad.Policies = n.authz.Store().Versions
	}
	n.admin = admin.New(ad)
	return n, nil
}

// registerProcessMetrics adds isthmus_build_info and the Go runtime and
// process collectors to reg.
func registerProcessMetrics(reg prometheus.Registerer) error {
	return errors.Join(reg.Register(collectors.NewGoCollector()),
		reg.Register(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})), reg.Register(version.NewCollector("ztunnel")))
}

func (n *Node) buildProxies() error {
	m, err := metrics.New(n.deps.Registry)
	if err != nil {
		return fmt.Errorf("ztunnel metrics: %w", err)
	}
	alc := proxy.AccessLogConfig{Rate: n.cfg.AccessLogRate, Burst: n.cfg.AccessLogBurst, Registerer: n.deps.Registry}
	if !n.cfg.NoAccessLog {
		alc.Log = n.log.With("scope", "access")
	}
	if n.access, err = proxy.NewAccessLog(alc); err != nil {
		return fmt.Errorf("ztunnel access log: %w", err)
	}
	pcfg := proxy.Config{Node: n.cfg.NodeName, HBONEPort: n.cfg.HBONEPort, NodeIPs: n.cfg.NodeIPs, AccessLog: n.access}
	// One Self for the node's namespace: every proxy knows every listener
	// (and the node's addresses) as ztunnel, never to be dialled.
	n.self = proxy.NewSelf(proxy.SelfConfig{NodeIPs: n.cfg.NodeIPs})
	n.m = m
	pdeps := proxy.Deps{Store: n.store, Certs: n.certs, Metrics: m, Log: n.log, Listen: n.proxyListen, Self: n.self}
	if n.authz != nil {
		pdeps.Authorizer = n.authz
	}
	if n.cfg.Mode == ModeGateway {
		n.gw, err = proxy.NewGateway(proxy.GatewayConfig{Config: pcfg, Network: n.cfg.Network, Cluster: n.cfg.ClusterID, Identity: n.id}, pdeps, state.Selector{})
		return err
	}
	if n.dnsM, err = dns.NewMetrics(n.deps.Registry); err != nil {
		return fmt.Errorf("ztunnel dns metrics: %w", err)
	}
	dnsCfg := dns.Config{Domain: n.cfg.DNSDomain, Upstreams: n.cfg.DNSUpstreams}
	if n.cfg.InPodSocket != "" {
		n.pods, err = podproxy.New(podproxy.Config{Proxy: pcfg, Cluster: n.cfg.ClusterID, Network: n.cfg.Network,
			DisableDNS: n.cfg.DisablePodDNS, DNS: dnsCfg, Mark: n.cfg.Mark},
			podproxy.Deps{Store: n.store, Certs: n.certs, Metrics: m, DNSMetrics: n.dnsM, Authorizer: pdeps.Authorizer, Plaintext: n.deps.Plaintext,
				Ready: n.xds.HasSynced, Log: n.log})
		if err != nil {
			return err
		}
		if err := n.deps.Registry.Register(n.pods.Collector()); err != nil {
			return fmt.Errorf("ztunnel metrics: %w", err)
		}
		if n.inpod, err = inpod.New(inpod.Config{SocketPath: n.cfg.InPodSocket, Protocol: n.cfg.InPodProtocol}, inpod.Deps{Handler: n.pods, Log: n.log}); err != nil {
			return err
		}
	} else {
		if n.in, err = proxy.NewInbound(pcfg, pdeps); err != nil {
			return err
		}
		// Without in-pod mode no pod has a proxy of its own: Istio's gauge
		// of them is 0.
		if err := n.deps.Registry.Register(prometheus.NewGauge(prometheus.GaugeOpts{
			Name: podproxy.ActiveProxyCount, Help: "The total number of current workloads with active in-pod proxies (Istio's ztunnel metric): none without in-pod mode.",
		})); err != nil {
			return fmt.Errorf("ztunnel metrics: %w", err)
		}
	}
	n.out, err = proxy.NewOutbound(pcfg, pdeps, state.Selector{})
	return err
}

// Store returns the state store the xDS client feeds.
func (n *Node) Store() *state.Store { return n.store }

// Certs returns the certificate manager.
func (n *Node) Certs() *caclient.Manager { return n.certs }

// Authorizer returns the authorization enforcer of the node's inbound
// paths: the HBONE inbound uses it, and the inbound plaintext path (15006)
// must admit each connection through it (authz.Conn with Plaintext set).
// Nil in gateway mode and with Config.NoAuthorization.
func (n *Node) Authorizer() *authz.Enforcer { return n.authz }

// Identity returns the ztunnel's own identity.
func (n *Node) Identity() identity.Identity { return n.id }

// Ready reports whether the first xDS response has been applied and, in
// node mode, the inbound listeners match the state, or (in-pod) the CNI
// agent's snapshot of enrolled pods is served.
func (n *Node) Ready() bool {
	if n.draining.Load() || !n.xds.HasSynced() {
		return false
	}
	if n.inpod != nil && !n.inpod.Synced() {
		return false
	}
	return n.in == nil || n.in.Ready()
}

// Pods returns the enrolled pods served in-pod (namespace/name).
func (n *Node) Pods() []string {
	if n.pods == nil {
		return nil
	}
	return n.pods.Pods()
}

// listeners are the fixed listeners of a run.
type listeners struct {
	outbound, socks, gateway net.Listener
	// gatewayTLS is the gateway's SNI passthrough listener (15443).
	gatewayTLS            net.Listener
	admin, ready, metrics net.Listener
	dnsTCP                net.Listener
	dnsUDP                net.PacketConn
}

func (l *listeners) close() {
	for _, ln := range []net.Listener{l.outbound, l.socks, l.gateway, l.gatewayTLS, l.admin, l.ready, l.metrics, l.dnsTCP} {
		if ln != nil {
			ln.Close()
		}
	}
	if l.dnsUDP != nil {
		l.dnsUDP.Close()
	}
}

func (n *Node) listen() (*listeners, error) {
	l := &listeners{}
	open := func(dst *net.Listener, addr, what string) error {
		if addr == Disabled {
			return nil
		}
		listen := n.proxyListen
		if dst == &l.admin || dst == &l.ready || dst == &l.metrics {
			listen = n.httpListen
		}
		ln, err := listen("tcp", addr)
		if err != nil {
			return fmt.Errorf("listen %s on %s: %w", what, addr, err)
		}
		*dst = ln
		return nil
	}
	var errs []error
	if n.cfg.Mode == ModeGateway {
		errs = append(errs, open(&l.gateway, n.cfg.GatewayListen, "gateway"), open(&l.gatewayTLS, n.cfg.GatewayTLSListen, "gateway tls passthrough"))
	} else {
		errs = append(errs, open(&l.outbound, n.cfg.OutboundListen, "outbound"), open(&l.socks, n.cfg.SOCKS5Listen, "socks5"),
			open(&l.dnsTCP, n.cfg.DNSListen, "dns"))
		if l.dnsTCP != nil {
			pc, err := netns.ReusePortConfig().ListenPacket(context.Background(), "udp", n.cfg.DNSListen)
			if err != nil {
				errs = append(errs, fmt.Errorf("listen dns (udp) on %s: %w", n.cfg.DNSListen, err))
			}
			l.dnsUDP = pc
		}
	}
	errs = append(errs,
		open(&l.admin, n.cfg.AdminListen, "admin"),
		open(&l.ready, n.cfg.ReadinessListen, "readiness"),
		open(&l.metrics, n.cfg.MetricsListen, "metrics"))
	if err := errors.Join(errs...); err != nil {
		l.close()
		return nil, err
	}
	return l, nil
}

// only serves h for exactly one path.
func only(path string, h http.Handler) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET "+path, h)
	return mux
}

// Run binds the listeners, starts every component and blocks until ctx
// ends, Close is called, or a component fails. On a requested stop in node
// mode it first hands over and drains (Config.HandoffWait and DrainGrace:
// it keeps serving until a newer ztunnel has the pods, then stops
// accepting and lets its connections run for the grace period); it then
// closes the proxies (ending their connections), stops the xDS and CA
// clients and returns the first failure (nil for a requested stop). Run
// may be called once.
func (n *Node) Run(ctx context.Context) error {
	ctx, cancel, err := n.begin(ctx)
	if err != nil || ctx == nil {
		return err
	}
	defer close(n.done)
	defer cancel()
	defer n.xds.Close()
	defer n.certs.Close()

	lns, err := n.listen()
	if err != nil {
		return err
	}
	g, gctx := errgroup.WithContext(ctx)
	// The components run on past ctx, through a drain (the agent's
	// connection brings word of the successor, the inbound keeps its
	// connections, policies are still enforced), until stopServing.
	sctx, stopServing := context.WithCancel(context.WithoutCancel(gctx))
	defer stopServing()
	servers := n.serveHTTP(g, lns)
	if err := n.startParts(sctx, g, lns); err != nil {
		cancel()
		stopServing()
		_ = n.stop(ctx, servers, lns) // the HTTP servers do not end with ctx
		_ = g.Wait()
		return err
	}
	n.log.Info("ztunnel started", "identity", n.id.String(), "xds", n.cfg.XDSAddress, "ca", n.cfg.CAAddress)
	g.Go(func() error {
		<-gctx.Done()
		if ctx.Err() != nil && n.cfg.HandoffWait+n.cfg.DrainGrace > 0 {
			// A requested stop, not a failure: hand over, then drain.
			n.draining.Store(true)
			if n.gw != nil {
				n.drainGateway(lns)
			} else {
				n.drain(lns)
			}
		}
		stopServing()
		return n.stop(ctx, servers, lns)
	})
	err = g.Wait()
	if n.in != nil {
		n.in.Close()
	}
	n.log.Info("ztunnel stopped", "err", err)
	return err
}

// begin marks the node started and returns the run's context; a nil
// context (and error) means Close came first and there is nothing to run.
func (n *Node) begin(ctx context.Context) (context.Context, context.CancelFunc, error) {
	n.runMu.Lock()
	defer n.runMu.Unlock()
	if n.closed {
		return nil, nil, nil
	}
	if n.started {
		return nil, nil, errors.New("ztunnel: Run called twice")
	}
	n.started = true
	ctx, cancel := context.WithCancel(ctx)
	n.cancel, n.done = cancel, make(chan struct{})
	return ctx, cancel, nil
}

// serveHTTP serves the admin, readiness and metrics listeners in g.
func (n *Node) serveHTTP(g *errgroup.Group, lns *listeners) []*http.Server {
	var servers []*http.Server
	serve := func(ln net.Listener, h http.Handler) {
		if ln == nil {
			return
		}
		n.self.Add(ln.Addr())
		srv := &http.Server{Handler: h, ErrorLog: slog.NewLogLogger(n.log.Handler(), slog.LevelWarn),
			ReadHeaderTimeout: n.cfg.HTTPReadHeaderTimeout, IdleTimeout: n.cfg.HTTPIdleTimeout, MaxHeaderBytes: 64 << 10}
		servers = append(servers, srv)
		g.Go(func() error {
			if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
				return fmt.Errorf("http on %s: %w", ln.Addr(), err)
			}
			return nil
		})
	}
	serve(lns.admin, n.admin)
	serve(lns.ready, only("/healthz/ready", n.admin))
	serve(lns.metrics, only("/metrics", n.admin))
	return servers
}

// startParts runs the xDS and CA clients and the mode's proxies in g.
func (n *Node) startParts(ctx context.Context, g *errgroup.Group, lns *listeners) error {
	g.Go(func() error { return n.xds.Run(ctx) })
	g.Go(func() error { return n.certs.Run(ctx) })
	if n.roots != nil {
		g.Go(func() error { return n.roots.Run(ctx) })
	}
	serve := func(ln net.Listener, fn func(net.Listener) error) {
		if ln != nil {
			g.Go(func() error { return ignoreClosed(fn(ln)) })
		}
	}
	if n.gw != nil {
		g.Go(func() error { return n.gw.Run(ctx) })
		serve(lns.gateway, n.gw.Serve)
		serve(lns.gatewayTLS, n.gw.ServeTLS)
		return nil
	}
	if n.in != nil {
		g.Go(func() error { return n.in.Run(ctx) })
	}
	if n.inpod != nil {
		g.Go(func() error {
			n.awaitState(ctx)
			return n.inpod.Run(ctx)
		})
	}
	if n.authz != nil {
		g.Go(func() error { return n.authz.Run(ctx) })
	}
	serve(lns.socks, n.out.ServeSOCKS5)
	serve(lns.outbound, n.out.ServeTransparent)
	if lns.dnsTCP != nil && lns.dnsUDP != nil {
		return n.serveNodeDNS(ctx, g, lns)
	}
	return nil
}

// awaitState waits, for at most InPodSyncWait, until the xDS client holds
// pilot's state: the pods are taken from the CNI agent only then.
func (n *Node) awaitState(ctx context.Context) {
	t := time.NewTimer(n.cfg.InPodSyncWait)
	defer t.Stop()
	select {
	case <-n.xds.Synced():
	case <-ctx.Done():
	case <-t.C:
		n.log.Warn("no state from pilot yet: taking the pods from the CNI agent anyway (their DNS is forwarded, mesh names unknown, until it comes)", "waited", n.cfg.InPodSyncWait)
	}
}

// stop drains the HTTP servers within ShutdownTimeout and closes the
// proxies and listeners.
func (n *Node) stop(ctx context.Context, servers []*http.Server, lns *listeners) error {
	n.log.Info("ztunnel stopping")
	sctx, scancel := context.WithTimeout(context.WithoutCancel(ctx), n.cfg.ShutdownTimeout)
	defer scancel()
	var errs []error
	for _, srv := range servers {
		if err := srv.Shutdown(sctx); err != nil {
			n.log.Warn("http server did not drain in time; closing it", "err", err)
			errs = append(errs, srv.Close())
		}
	}
	if n.out != nil {
		errs = append(errs, n.out.Close())
	}
	if n.gw != nil {
		errs = append(errs, n.gw.Close())
	}
	if n.pods != nil {
		// The pods keep their rules: their traffic fails closed until
		// a ztunnel serves them again.
		errs = append(errs, n.pods.Close())
	}
	lns.close()
	return errors.Join(errs...)
}

func ignoreClosed(err error) error {
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}

// Close stops Run as a requested stop (with the drain, when
// Config.HandoffWait or DrainGrace is set) and waits for it to return;
// idempotent, and a no-op when Run was never called.
func (n *Node) Close() error {
	n.runMu.Lock()
	cancel, done := n.cancel, n.done
	n.closed = true // a later Run returns at once
	n.runMu.Unlock()
	if cancel == nil {
		n.certs.Close()
		return nil
	}
	cancel()
	<-done
	return nil
}

// serveNodeDNS serves the DNS proxy on the node address listeners, for
// clients identified by their address: the node's pods, and nobody else.
func (n *Node) serveNodeDNS(ctx context.Context, g *errgroup.Group, lns *listeners) error {
	// Only this node's pods are clients (ClientFor): anyone else who
	// reaches the node address gets no answer, nothing forwarded.
	cat := &dns.StoreCatalog{Store: n.store, Domain: n.cfg.DNSDomain, Network: n.cfg.Network, Node: n.cfg.NodeName}
	srv, err := dns.New(dns.Config{Domain: n.cfg.DNSDomain, Upstreams: n.cfg.DNSUpstreams}, dns.Deps{
		Catalog: cat, Client: cat.ClientFor, Ready: n.xds.HasSynced,
		PacketConns: []net.PacketConn{lns.dnsUDP}, Listeners: []net.Listener{lns.dnsTCP},
		Metrics: n.dnsM, Log: n.log,
	})
	if err != nil {
		return fmt.Errorf("dns on %s: %w", n.cfg.DNSListen, err)
	}
	n.self.Add(lns.dnsTCP.Addr())
	n.self.Add(lns.dnsUDP.LocalAddr())
	lns.dnsTCP, lns.dnsUDP = nil, nil // the DNS server owns them now
	g.Go(func() error { return srv.Run(ctx) })
	return nil
}
