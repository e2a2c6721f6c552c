// Package server assembles pilot: the multicluster controller, per-cluster
// discovery, the federated registry, the mesh CA (gRPC over TLS), and the
// debug and health endpoints.
// cmd/pilot maps flags into Config and runs a Server; tests and benchmarks
// run the same Server in-process.
package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"

	"github.com/isthmus-mesh/isthmus/controller"
	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/internal/version"
	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/pilot/ca"
	"github.com/isthmus-mesh/isthmus/pilot/eastwest"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/policy"
	"github.com/isthmus-mesh/isthmus/pilot/registry"
	"github.com/isthmus-mesh/isthmus/pilot/vip"
	"github.com/isthmus-mesh/isthmus/pilot/xds"
)

// Config configures pilot. Zero values take the defaults of each part.
type Config struct {
	// Namespace is the control plane's namespace (default "isthmus-system").
	Namespace string
	// ClusterID of the config cluster pilot runs in (default "primary").
	ClusterID model.ClusterID
	// Network is the config cluster's default network.
	Network model.Network
	// Multicluster, Discovery and Registry configure those parts; the
	// namespace, cluster ID, network and logger above are copied into them.
	Multicluster multicluster.Config
	Discovery    controller.Config
	Registry     registry.Config
	// XDS configures the xDS server (its trust domain and default network
	// are copied from CA and Network).
	XDS xds.Config
	// CA configures the mesh CA (its ClusterID and Namespace are copied
	// from above).
	CA ca.Config
	// TrustDomainAliases are trust domains whose identities count as the
	// mesh's (CA.TrustDomain's) in AuthorizationPolicy principals, as
	// Istio's meshConfig trustDomainAliases.
	TrustDomainAliases []string
	// GRPCAddr serves the CA (and xDS) over TLS (default ":15012";
	// defaults.Disabled turns it off, as for every listen address here).
	GRPCAddr string
	// XDSPlaintextAddr serves xDS without TLS, for development only
	// (default: disabled).
	XDSPlaintextAddr string
	// DebugAddr serves /debug/* (default "127.0.0.1:8080").
	DebugAddr string
	// MonitoringAddr serves /metrics, /healthz and /readyz (default ":15014").
	MonitoringAddr string
	// NoLeaderElection turns leader election off: this replica writes the
	// shared state (ServiceExport and ServiceImport status, Gateway status,
	// published roots, Events) without holding the leader Lease. For a
	// single replica only (development, tests). By default only the replica
	// holding the Lease in Namespace writes them, so several can run.
	NoLeaderElection bool
	// Identity of this replica in leader election (default hostname-pid).
	Identity string
	// LeaderElection times the leader Lease (defaults: lease 15 s, renew
	// deadline 10 s, retry 2 s).
	LeaderElection LeaderElection
	// GRPCLimits bound what a client of a gRPC port (TLS or plaintext) may cost.
	GRPCLimits GRPCLimits
	// Gateways configures the GatewayClass controller (east-west gateways
	// declared as Gateway API Gateways); the namespace, gateway namespaces,
	// trust domain and logger are copied in.
	Gateways eastwest.Config
	// NoGatewayClass turns the GatewayClass controller off: no GatewayClass
	// is written and Gateways are not served.
	NoGatewayClass bool
	// VIP configures the allocation of virtual addresses to services with
	// none on a client's network (its table lives in a ConfigMap of
	// Namespace, which is copied in).
	VIP vip.Config
	// ShutdownTimeout bounds the graceful shutdown of HTTP servers (default
	// 10 s, as the binary's --shutdown-timeout).
	ShutdownTimeout time.Duration
	// Logger (default: discards).
	Logger *slog.Logger
}

// withDefaults fills what c leaves empty and copies the shared settings
// into the parts' configurations.
func (c Config) withDefaults() Config {
	if c.Namespace == "" {
		c.Namespace = defaults.Namespace
	}
	if c.ClusterID == "" {
		c.ClusterID = "primary"
	}
	if c.DebugAddr == "" {
		c.DebugAddr = "127.0.0.1:8080"
	}
	if c.GRPCAddr == "" {
		c.GRPCAddr = ":" + strconv.Itoa(defaults.XDSPort)
	}
	if c.XDSPlaintextAddr == "" {
		c.XDSPlaintextAddr = defaults.Disabled
	}
	if c.MonitoringAddr == "" {
		c.MonitoringAddr = ":" + strconv.Itoa(defaults.MonitoringPort)
	}
	if c.Identity == "" {
		host, _ := os.Hostname()
		c.Identity = fmt.Sprintf("%s-%d", host, os.Getpid())
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = 10 * time.Second
	}
	c.GRPCLimits = c.GRPCLimits.withDefaults()
	c.LeaderElection = c.LeaderElection.withDefaults()
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	c.Multicluster.Namespace, c.Multicluster.ConfigClusterID, c.Multicluster.ConfigClusterNetwork = c.Namespace, c.ClusterID, c.Network
	c.Multicluster.Logger = c.Logger
	c.Discovery.ControlPlaneNamespace, c.Discovery.Logger = c.Namespace, c.Logger
	if c.Registry.Logger == nil {
		c.Registry.Logger = c.Logger
	}
	c.CA.ClusterID, c.CA.Namespace = string(c.ClusterID), c.Namespace
	c.VIP.Namespace = c.Namespace
	c.Gateways.Namespace, c.Gateways.Logger = c.Namespace, c.Logger.With("component", "eastwest-gateways")
	c.Gateways.GatewayNamespaces, c.Gateways.GatewayNamespaceSelector = c.Discovery.GatewayNamespaces, c.Discovery.GatewayNamespaceSelector
	if c.Gateways.TrustDomain == "" {
		c.Gateways.TrustDomain = c.CA.TrustDomain
	}
	c.XDS.TrustDomain, c.XDS.DefaultNetwork = c.CA.TrustDomain, c.Network
	c.XDS.AllowPlaintext = c.XDSPlaintextAddr != defaults.Disabled
	if len(c.XDS.NodeAccounts) == 0 {
		c.XDS.NodeAccounts = c.CA.TrustedNodeAccounts
		if len(c.XDS.NodeAccounts) == 0 {
			c.XDS.NodeAccounts = []string{c.Namespace + "/ztunnel"}
		}
	}
	// ServiceExports are watched in every mode: exported services get a
	// ServiceImport and a clusterset name; in export mode only they are
	// federated.
	c.Discovery.WatchServiceExports = true
	return c
}

// validate rejects what withDefaults cannot fix.
func (c Config) validate() error {
	for name, addr := range map[string]string{"GRPCAddr": c.GRPCAddr, "XDSPlaintextAddr": c.XDSPlaintextAddr,
		"DebugAddr": c.DebugAddr, "MonitoringAddr": c.MonitoringAddr} {
		if addr == "-" {
			return fmt.Errorf("pilot: %s %q: a listener is disabled by %q", name, addr, defaults.Disabled)
		}
	}
	if err := c.Discovery.ServiceScope.Validate(); err != nil {
		return fmt.Errorf("pilot: %w", err)
	}
	return nil
}

// Server is one pilot.
type Server struct {
	cfg          Config
	log          *slog.Logger
	Metrics      *prometheus.Registry
	Multicluster *multicluster.Controller
	Registry     *registry.Registry
	CA           *ca.CA
	XDS          *xds.Server
	VIP          *vip.Allocator
	// Policies follows the config cluster's AuthorizationPolicies and
	// PeerAuthentications (root namespace: Namespace).
	Policies *policy.Watcher
	local    *multicluster.Client

	mu        sync.Mutex
	grpcLn    net.Listener
	plainLn   net.Listener
	debugLn   net.Listener
	monitorLn net.Listener
	ready     chan struct{}

	handshakeFailures *prometheus.CounterVec
	vipHooks          *hooks
	// leader runs the tasks that write shared state (one replica).
	leader func(context.Context) error
	lead   *leadership
}

// New assembles a pilot for the config cluster reached by configREST;
// build makes remote clients (nil: multicluster.DefaultClientBuilder).
func New(cfg Config, configREST *rest.Config, build multicluster.ClientBuilder) (*Server, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), version.NewCollector("pilot"))
	cfg.Multicluster.Registerer = reg
	local, err := multicluster.NewClient(configREST)
	if err != nil {
		return nil, fmt.Errorf("config cluster client: %w", err)
	}
	lead := &leadership{}
	lead.leading.Store(cfg.NoLeaderElection)
	cfg.Multicluster.RecordEvents = lead.leading.Load
	mc, err := multicluster.New(cfg.Multicluster, local, build)
	if err != nil {
		return nil, err
	}
	cfg.Registry.Registerer = reg
	r := registry.New(cfg.Registry)
	reg.MustRegister(newGatewayCollector(r))
	authority, err := ca.New(cfg.CA, ca.Deps{
		ConfigClient: local.Kube, Clusters: kubeClients{mc}, Nodes: r, Logger: cfg.Logger.With("component", "ca"), Registerer: reg,
		Leading: lead.leading.Load,
	})
	if err != nil {
		return nil, fmt.Errorf("ca: %w", err)
	}
	// A remote Secret's trust-domain annotation: the CA issues that
	// cluster's identities in it, and xDS names them so.
	mc.AddComponent("ca-trust-domain", func(_ context.Context, c *multicluster.Cluster) (multicluster.Component, error) {
		return authority.AssignTrustDomain(string(c.ID), c.Generation, c.TrustDomain)
	})
	mc.AddComponent("discovery", controller.NewBuilder(cfg.Discovery, r))
	mc.Subscribe(reachability(r))
	pol, err := newPolicies(cfg, configREST, reg)
	if err != nil {
		return nil, err
	}
	cfg.XDS.Metrics, cfg.XDS.Policies = reg, pol
	vipHooks := &hooks{}
	alloc, err := vip.New(cfg.VIP, vip.Deps{Client: local.Kube, Log: cfg.Logger.With("component", "vip"), OnChange: vipHooks.call})
	if err != nil {
		return nil, err
	}
	cfg.XDS.Allocations = alloc
	cfg.XDS.TrustDomainOf = func(c model.ClusterID) string { return authority.TrustDomainOf(string(c)) }
	xs, err := xds.New(cfg.XDS, r, cfg.Logger.With("component", "xds"))
	if err != nil {
		return nil, fmt.Errorf("xds: %w", err)
	}
	authority.SubscribeTrustDomains(xs.RefreshTrustDomains)
	vipHooks.add(func(hosts []string) { xs.Refresh(hosts...) })
	mc.AddComponent("ca-root-publisher", func(ctx context.Context, c *multicluster.Cluster) (multicluster.Component, error) {
		return authority.PublishRoots(ctx, string(c.ID), c.Client.Kube)
	})
	if err := addGatewayClass(cfg, mc, authority, lead); err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, log: cfg.Logger, Metrics: reg, Multicluster: mc, Registry: r, CA: authority, XDS: xs, VIP: alloc, Policies: pol, local: local,
		ready: make(chan struct{}), handshakeFailures: newHandshakeFailures(reg), vipHooks: vipHooks, lead: lead}
	if s.leader, err = s.leaderTasks(cfg.Logger); err != nil {
		return nil, err
	}
	return s, nil
}

// kubeClients adapts the multicluster controller to the CA's Clusters.
type kubeClients struct{ mc *multicluster.Controller }

func (k kubeClients) KubeClient(id string) (kubernetes.Interface, bool) {
	c, ok := k.mc.KubeClient(id)
	if !ok {
		return nil, false
	}
	return c.Kube, true
}

// XDSPlaintextAddr returns the bound plaintext xDS address once Run
// listens ("" before or when disabled).
func (s *Server) XDSPlaintextAddr() string { return addrOf(&s.mu, &s.plainLn) }

// GRPCAddr returns the bound address of the TLS gRPC listener once Run
// listens ("" before).
func (s *Server) GRPCAddr() string { return addrOf(&s.mu, &s.grpcLn) }

// Ready reports whether the config cluster has synced (remote clusters
// never hold readiness back).
func (s *Server) Ready() bool { return s.Multicluster.Ready() }

// DebugMux returns the debug endpoints, and /version (the build, as JSON,
// read by `isthmusctl version`).
func (s *Server) DebugMux() *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle("/version", version.Handler())
	mux.Handle("/debug/clusterz", s.Multicluster.ClusterzHandler())
	mux.Handle("/debug/registryz", s.Registry.RegistryzHandler())
	mux.Handle("/debug/endpointz", s.Registry.EndpointzHandler())
	mux.Handle("/debug/workloadz", s.Registry.WorkloadzHandler())
	mux.Handle("/debug/addressz", s.Registry.AddresszHandler())
	xdsDebug := s.XDS.DebugHandler()
	mux.Handle("/debug/syncz", xdsDebug)
	mux.Handle("/debug/config_dump", xdsDebug)
	polDebug := s.Policies.DebugHandler(s.Registry.Workload)
	mux.Handle("/debug/authorizationz", polDebug)
	mux.Handle("/debug/authz", polDebug)
	// Go runtime profiles (the debug listener is loopback-only by default).
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	return mux
}

// MonitoringMux returns /metrics, /healthz and /readyz.
func (s *Server) MonitoringMux() *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(s.Metrics, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !s.Ready() {
			http.Error(w, "config cluster not synced", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok\n"))
	})
	return mux
}

// DebugAddr returns the bound debug address once Run listens ("" before).
func (s *Server) DebugAddr() string { return addrOf(&s.mu, &s.debugLn) }

// MonitoringAddr returns the bound monitoring address once Run listens.
func (s *Server) MonitoringAddr() string { return addrOf(&s.mu, &s.monitorLn) }

func addrOf(mu *sync.Mutex, ln *net.Listener) string {
	mu.Lock()
	defer mu.Unlock()
	if *ln == nil {
		return ""
	}
	return (*ln).Addr().String()
}

// reachability marks a cluster's endpoints unreachable, and reachable
// again, as the multicluster controller reports its API server.
func reachability(r *registry.Registry) func(multicluster.Status) {
	return func(s multicluster.Status) {
		switch s.State {
		case multicluster.StateUnreachable:
			r.SetReachable(s.ID, false)
		case multicluster.StateSynced:
			r.SetReachable(s.ID, true)
		}
	}
}

// addGatewayClass runs the GatewayClass controller in every cluster unless
// disabled.
func addGatewayClass(cfg Config, mc *multicluster.Controller, authority *ca.CA, lead *leadership) error {
	if cfg.NoGatewayClass {
		return nil
	}
	gws, err := eastwest.New(cfg.Gateways, eastwest.Deps{Leading: lead.leading.Load, Roots: authority.Roots, TrustBundle: authority.TrustBundleJSON})
	if err != nil {
		return err
	}
	// A new root bundle, or this replica becoming the leader (Republish),
	// makes every cluster's controller look again.
	authority.OnRootsChange(gws.Resync)
	mc.AddComponent("eastwest-gateways", gws.Build)
	return nil
}

// listen binds every listener not disabled; on a failure it closes those
// it bound.
func (s *Server) listen() error {
	listeners := []struct {
		name, addr string
		into       *net.Listener
	}{{"debug", s.cfg.DebugAddr, &s.debugLn}, {"monitoring", s.cfg.MonitoringAddr, &s.monitorLn},
		{"grpc", s.cfg.GRPCAddr, &s.grpcLn}, {"xds-plaintext", s.cfg.XDSPlaintextAddr, &s.plainLn}}
	for i, l := range listeners {
		if l.addr == defaults.Disabled {
			continue
		}
		ln, err := net.Listen("tcp", l.addr)
		if err != nil {
			for _, prev := range listeners[:i] {
				if *prev.into != nil {
					_ = (*prev.into).Close()
				}
			}
			return fmt.Errorf("%s listener: %w", l.name, err)
		}
		s.mu.Lock()
		*l.into = ln
		s.mu.Unlock()
	}
	return nil
}

// Run runs every part until ctx ends, then shuts down within
// ShutdownTimeout and returns the first error of any part.
func (s *Server) Run(ctx context.Context) error {
	if err := s.CA.Init(ctx); err != nil {
		return fmt.Errorf("ca: %w", err)
	}
	if err := s.listen(); err != nil {
		return err
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, 10)
	run := func(name string, fn func(context.Context) error) {
		wg.Go(func() {
			if err := fn(ctx); err != nil {
				errs <- fmt.Errorf("%s: %w", name, err)
				cancel()
			}
		})
	}
	serve := func(name string, ln net.Listener, fn func(context.Context, net.Listener) error) {
		if ln != nil {
			run(name, func(ctx context.Context) error { return fn(ctx, ln) })
		}
	}
	httpServe := func(mux *http.ServeMux) func(context.Context, net.Listener) error {
		return func(ctx context.Context, ln net.Listener) error {
			return serveHTTP(ctx, &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}, ln, s.cfg.ShutdownTimeout)
		}
	}
	grpcServe := func(srv *grpc.Server) func(context.Context, net.Listener) error {
		return func(ctx context.Context, ln net.Listener) error {
			return serveGRPC(ctx, srv, ln, s.cfg.ShutdownTimeout)
		}
	}
	serve("debug", s.debugLn, httpServe(s.DebugMux()))
	serve("monitoring", s.monitorLn, httpServe(s.MonitoringMux()))
	tlsSrv := grpc.NewServer(append(s.cfg.GRPCLimits.options(credentials.NewTLS(s.CA.ServerTLSConfig()), s.handshakeFailures), xds.ServerOptions()...)...)
	s.CA.Register(tlsSrv)
	s.XDS.Register(tlsSrv)
	serve("grpc", s.grpcLn, grpcServe(tlsSrv))
	plainSrv := grpc.NewServer(append(s.cfg.GRPCLimits.options(nil, nil), xds.ServerOptions()...)...) // xDS only: certificates are never issued in plaintext
	s.XDS.Register(plainSrv)
	serve("xds-plaintext", s.plainLn, grpcServe(plainSrv))
	run("ca", s.CA.Run)
	run("vip", s.VIP.Run)
	run("vip-sync", (&vipSync{alloc: s.VIP, reg: s.Registry, log: s.log.With("component", "vip"), retry: 10 * time.Second}).Run)
	run("xds", s.XDS.Run)
	run("policy", s.Policies.Run)
	run("registry", s.Registry.Run)
	run("multicluster", s.Multicluster.Run)
	if s.cfg.NoLeaderElection {
		run("leader-tasks", s.leader)
	} else {
		run("leader-tasks", func(ctx context.Context) error { return s.leading(ctx, s.leader) })
	}
	s.log.Info("pilot running", "cluster", s.cfg.ClusterID, "namespace", s.cfg.Namespace, "debug", s.DebugAddr(), "monitoring", s.MonitoringAddr())
	wg.Wait()
	close(errs)
	var all []error
	for err := range errs {
		all = append(all, err)
	}
	return errors.Join(all...)
}

// leading runs fn while this replica holds the leader Lease, until ctx ends.
func (s *Server) leading(ctx context.Context, fn func(context.Context) error) error {
	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Namespace: s.cfg.Namespace, Name: LeaseName},
		Client:     s.local.Kube.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: s.cfg.Identity},
	}
	le := s.cfg.LeaderElection
	for ctx.Err() == nil {
		elector, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
			Lock: lock, LeaseDuration: le.LeaseDuration, RenewDeadline: le.RenewDeadline, RetryPeriod: le.RetryPeriod,
			ReleaseOnCancel: true, Name: "isthmus-pilot",
			Callbacks: leaderelection.LeaderCallbacks{
				OnStartedLeading: func(ctx context.Context) {
					s.log.Info("leading: writing shared state (published roots, GatewayClasses and Gateways, ServiceImports, ServiceExport status, Events)", "identity", s.cfg.Identity)
					s.lead.leading.Store(true)
					s.CA.Republish()
					if err := fn(ctx); err != nil {
						s.log.Error("leader task failed", "error", err)
					}
				},
				OnStoppedLeading: func() {
					s.lead.leading.Store(false)
					s.log.Info("no longer leading", "identity", s.cfg.Identity)
				},
			},
		})
		if err != nil {
			return err
		}
		elector.Run(ctx) // returns when leadership is lost or ctx ends; then campaign again
	}
	return nil
}

func serveGRPC(ctx context.Context, srv *grpc.Server, ln net.Listener, timeout time.Duration) error {
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		stopped := make(chan struct{})
		go func() { srv.GracefulStop(); close(stopped) }()
		select {
		case <-stopped:
		case <-time.After(timeout):
			srv.Stop()
		}
		<-done
		return nil
	}
}

func serveHTTP(ctx context.Context, srv *http.Server, ln net.Listener, timeout time.Duration) error {
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		_ = srv.Shutdown(sctx)
		<-done
		return nil
	}
}
