package xds

import (
	"context"
	"errors"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	clusterservice "github.com/envoyproxy/go-control-plane/envoy/service/cluster/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	endpointservice "github.com/envoyproxy/go-control-plane/envoy/service/endpoint/v3"
	listenerservice "github.com/envoyproxy/go-control-plane/envoy/service/listener/v3"
	routeservice "github.com/envoyproxy/go-control-plane/envoy/service/route/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/sotw/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// Node metadata keys that place a client in a class, as Istio names them.
const (
	MetadataNetwork   = "NETWORK"
	MetadataClusterID = "CLUSTER_ID"
)

// Server serves the federated registry over xDS. Create it with New, expose
// it with Register, and drive it with Run. All methods are safe for
// concurrent use.
type Server struct {
	cfg   Config
	reg   Registry
	log   *slog.Logger
	envoy *envoyBuilder
	authz *authzServer
	xds   serverv3.Server
	sotw  *sotwServer
	delta *deltaServer
	stats *tracker

	// ctx bounds every xDS stream; cancel ends them when Run returns.
	ctx    context.Context
	cancel context.CancelFunc

	// buildMu serialises every build: view creation and change batches.
	buildMu sync.Mutex
	viewsMu sync.RWMutex
	views   map[class]*view

	pendingMu sync.Mutex
	pending   pendingChanges
	kick      chan struct{}
	running   atomic.Bool

	// istioMu guards istioPending: watches of Istio's workload type
	// waiting for the policies (istio_wait.go).
	istioMu      sync.Mutex
	istioPending map[*istioWatch]struct{}

	// localities admits client localities into Envoy classes (classFor).
	localities localityBound
}

// pendingChanges are the keys changed since the last applied batch.
type pendingChanges struct {
	services, workloads, networks map[string]struct{}
	// policies is set when the authorization policies changed.
	policies bool
	// trustDomains is set when a cluster's trust domain changed: every
	// identity may read differently.
	trustDomains bool
	// since is when the first of these changes arrived.
	since time.Time
}

// arrived notes the arrival of a change at now.
func (p *pendingChanges) arrived(now time.Time) {
	if p.since.IsZero() {
		p.since = now
	}
}

func (p *pendingChanges) add(kind model.ChangeKind, key string) {
	var m *map[string]struct{}
	switch kind {
	case model.ServiceChange:
		m = &p.services
	case model.WorkloadChange:
		m = &p.workloads
	case model.GatewayChange:
		m = &p.networks
	default:
		return
	}
	if *m == nil {
		*m = map[string]struct{}{}
	}
	(*m)[key] = struct{}{}
}

// New returns a Server for reg. logger may be nil (no logging).
func New(cfg Config, reg Registry, logger *slog.Logger) (*Server, error) {
	if reg == nil {
		return nil, errors.New("xds: nil registry")
	}
	cfg = cfg.withDefaults()
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	m, err := newMetrics(cfg.Metrics)
	if err != nil {
		return nil, err
	}
	envoy, err := newEnvoyBuilder(cfg.ConnectTimeout, func(c class, hostname, reason string, n uint32) {
		m.withheld.WithLabelValues(reason).Add(float64(n))
		logger.Debug("xds endpoints withheld from clients that cannot reach them", "service", hostname, "reason", reason, "endpoints", n,
			"network", c.Network, "cluster", c.Cluster, "client", c.Kind.String())
	})
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &Server{
		cfg:    cfg,
		reg:    reg,
		log:    logger,
		envoy:  envoy,
		ctx:    ctx,
		cancel: cancel,
		views:  map[class]*view{},
		kick:   make(chan struct{}, 1),

		istioPending: map[*istioWatch]struct{}{},
		localities:   localityBound{max: cfg.MaxLocalities, seen: map[class]map[model.Locality]struct{}{}},
	}
	s.authz = newAuthzServer(cfg.Policies, reg, cfg.VersionPrefix, slogAdapter{logger})
	s.stats = newTracker(m, logger, s.classOf, newAuthorizer(cfg, reg, s.trustDomainOf), s.internNames)
	s.xds = serverv3.NewServer(ctx, routerCache{s}, s.stats, sotw.WithLogger(slogAdapter{logger}))
	s.sotw = &sotwServer{ctx: ctx, stats: s.stats, watch: s.sotwWatch, intern: s.internNames, subs: newSubscriptions()}
	s.delta = &deltaServer{ctx: ctx, watcher: routerCache{s}, callbacks: s.stats, subs: s.sotw.subs}
	return s, nil
}

// Register registers the aggregated (ADS, SotW and delta) and the per-type
// CDS, EDS, LDS and RDS discovery services on gs. Transport security is the
// caller's: gs carries whatever credentials it was built with. gs should be
// built with ServerOptions (without them, SotW requests are decoded the
// slow way).
func (s *Server) Register(gs *grpc.Server) {
	x := sotwServices{xdsServer: s.xds, sotw: s.sotw, delta: s.delta}
	discovery.RegisterAggregatedDiscoveryServiceServer(gs, x)
	clusterservice.RegisterClusterDiscoveryServiceServer(gs, x)
	endpointservice.RegisterEndpointDiscoveryServiceServer(gs, x)
	listenerservice.RegisterListenerDiscoveryServiceServer(gs, x)
	routeservice.RegisterRouteDiscoveryServiceServer(gs, x)
}

// The stream types of the per-type SotW services, and go-control-plane's
// server, which serves the delta streams.
type (
	xdsServer      = serverv3.Server
	clusterStream  = clusterservice.ClusterDiscoveryService_StreamClustersServer
	endpointStream = endpointservice.EndpointDiscoveryService_StreamEndpointsServer
	listenerStream = listenerservice.ListenerDiscoveryService_StreamListenersServer
	routeStream    = routeservice.RouteDiscoveryService_StreamRoutesServer
)

// Run follows the registry's change feed and pushes every batch until ctx
// ends; then it ends every open xDS stream and returns nil. It may be called
// once.
func (s *Server) Run(ctx context.Context) error {
	if !s.running.CompareAndSwap(false, true) {
		return errors.New("xds: Run called twice")
	}
	defer s.cancel()
	stop := s.reg.Subscribe(s.enqueue)
	defer stop()
	stopPolicies := s.authz.src.Subscribe(s.enqueuePolicies)
	defer stopPolicies()
	// Views built before the subscription may have missed changes.
	if err := s.resyncAll(); err != nil {
		s.log.Error("xds resync failed", "err", err)
	}
	if err := s.authz.resync(); err != nil {
		s.log.Error("xds authorization resync failed", "err", err)
	}
	s.openIstioPending()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-s.kick:
			if err := s.applyPending(); err != nil {
				s.log.Error("xds push failed", "err", err)
			}
			s.openIstioPending()
		}
	}
}

// enqueue records a batch of changes for Run; it never waits for a build.
func (s *Server) enqueue(cs model.ChangeSet) {
	s.pendingMu.Lock()
	s.pending.arrived(time.Now())
	for _, c := range cs.Changes {
		s.pending.add(c.Kind, c.Key)
	}
	s.pendingMu.Unlock()
	s.kickRun()
}

// enqueuePolicies records that the authorization policies changed.
func (s *Server) enqueuePolicies() {
	s.pendingMu.Lock()
	s.pending.arrived(time.Now())
	s.pending.policies = true
	s.pendingMu.Unlock()
	s.kickRun()
}

func (s *Server) kickRun() {
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// Refresh rebuilds the resources of the services with these hostnames, as
// if the registry had changed them (for inputs other than the registry:
// allocated addresses). It never waits for the build.
func (s *Server) Refresh(hostnames ...string) {
	if len(hostnames) == 0 {
		return
	}
	cs := model.ChangeSet{Changes: make([]model.Change, 0, len(hostnames))}
	for _, h := range hostnames {
		cs.Changes = append(cs.Changes, model.Change{Kind: model.ServiceChange, Op: model.Updated, Key: h})
	}
	s.enqueue(cs)
}

// RefreshTrustDomains rebuilds every client's resources after the trust
// domain of a cluster changed (Config.TrustDomainOf).
func (s *Server) RefreshTrustDomains() {
	s.pendingMu.Lock()
	s.pending.trustDomains = true
	s.pendingMu.Unlock()
	s.enqueue(model.ChangeSet{})
}

// builder is what building needs for one batch.
type builder struct {
	reg   Registry
	gws   gatewayIndex
	envoy *envoyBuilder
	td    trustDomains
	alloc Allocations
	istio istioEncoder
}

func (s *Server) newBuilder() *builder {
	gws := newGatewayIndex(s.reg.Gateways())
	snap := s.authz.src.Snapshot()
	policies := func(uid string) []string { return istioPolicyNames(snap, s.reg.Workload(uid)) }
	return &builder{reg: s.reg, gws: gws, envoy: s.envoy, td: s.trustDomainOf, alloc: s.cfg.Allocations,
		istio: istioEncoder{gws: gws, policies: policies}}
}

// trustDomains gives the trust domain of a cluster's identities.
type trustDomains func(model.ClusterID) string

// trustDomainOf is the trustDomains of the server's builders and
// authorizer.
func (s *Server) trustDomainOf(cluster model.ClusterID) string {
	if s.cfg.TrustDomainOf != nil {
		if td := s.cfg.TrustDomainOf(cluster); td != "" {
			return td
		}
	}
	return s.cfg.TrustDomain
}

func (s *Server) snapshotViews() []*view {
	s.viewsMu.RLock()
	defer s.viewsMu.RUnlock()
	return slices.Collect(maps.Values(s.views))
}

// applyPending rebuilds the resources owned by the keys changed since the
// last batch, in every view, and hands them to the caches.
func (s *Server) applyPending() error {
	s.pendingMu.Lock()
	p := s.pending
	s.pending = pendingChanges{}
	s.pendingMu.Unlock()

	if p.trustDomains {
		if err := s.resyncAll(); err != nil {
			return err
		}
	}
	hosts := p.services
	if len(p.networks) > 0 {
		// A gateway change touches every service with endpoints on its network.
		if hosts == nil {
			hosts = map[string]struct{}{}
		}
		for _, svc := range s.reg.Services() {
			if hasNetwork(svc, p.networks) {
				hosts[svc.Hostname] = struct{}{}
			}
		}
	}
	start := time.Now()
	s.buildMu.Lock()
	defer s.buildMu.Unlock()
	s.stats.batchStarted(start, p.since)
	bd := s.newBuilder()
	var errs []error
	changed := 0
	var all []*model.Workload
	for _, v := range s.snapshotViews() {
		b := v.newBatch(false)
		for uid := range p.workloads {
			b.workload(bd, uid)
		}
		if p.policies && v.serves(IstioAddressType) {
			// Istio's workloads name their policies: every one may read
			// differently (policy changes are rare).
			if all == nil {
				all = s.reg.Workloads()
			}
			for _, w := range all {
				b.workload(bd, w.UID)
			}
		}
		for h := range hosts {
			if err := b.service(bd, h); err != nil {
				errs = append(errs, err)
			}
		}
		n, err := b.flush()
		changed += n
		errs = append(errs, err)
	}
	errs = append(errs, s.authz.apply(p.workloads, p.policies))
	s.stats.metrics.buildSeconds.Observe(time.Since(start).Seconds())
	s.stats.metrics.resourcesChanged.Add(float64(changed))
	return errors.Join(errs...)
}

func hasNetwork(s *model.Service, networks map[string]struct{}) bool {
	for _, shard := range s.Shards {
		for i := range shard {
			if _, ok := networks[string(shard[i].Network())]; ok {
				return true
			}
		}
	}
	return false
}

// resyncAll rebuilds every view from the registry.
func (s *Server) resyncAll() error {
	s.buildMu.Lock()
	defer s.buildMu.Unlock()
	bd := s.newBuilder()
	var errs []error
	for _, v := range s.snapshotViews() {
		errs = append(errs, s.resync(bd, v))
	}
	return errors.Join(errs...)
}

// resync rebuilds everything v holds and deletes what the registry no longer
// has. The caller holds buildMu.
func (s *Server) resync(bd *builder, v *view) error {
	b := v.newBatch(true)
	for _, w := range s.reg.Workloads() {
		b.workload(bd, w.UID)
	}
	hosts := map[string]struct{}{}
	for _, svc := range s.reg.Services() {
		hosts[svc.Hostname] = struct{}{}
	}
	for h := range v.owned {
		hosts[h] = struct{}{}
	}
	var errs []error
	for h := range hosts {
		if err := b.service(bd, h); err != nil {
			errs = append(errs, err)
		}
	}
	b.sweep()
	_, err := b.flush()
	return errors.Join(append(errs, err)...)
}

// classOf places a node in its class.
func (s *Server) classOf(node *corev3.Node) class {
	f := node.GetMetadata().GetFields()
	c := class{
		Network: model.Network(f[MetadataNetwork].GetStringValue()),
		Cluster: model.ClusterID(f[MetadataClusterID].GetStringValue()),
		Kind:    kindOf(node),
	}
	if c.Network == "" {
		c.Network = s.cfg.DefaultNetwork
	}
	return c
}

// classFor places a node in the class that serves it typeURL: its class,
// with, for EDS, its locality (node.locality) once admitted: endpoints are
// ordered into priorities by it, the other types do not depend on it.
func (s *Server) classFor(node *corev3.Node, typeURL string) class {
	c := s.classOf(node)
	if typeURL == resource.EndpointType {
		c.Locality = s.localities.admit(c, node.GetLocality())
	}
	return c
}

// localityBound admits at most max distinct localities per class; safe for
// concurrent use.
type localityBound struct {
	mu   sync.Mutex
	max  int
	seen map[class]map[model.Locality]struct{}
}

// maxLocalityLabel is the longest region, zone or subzone admitted (a
// Kubernetes label value's limit).
const maxLocalityLabel = 63

// admit returns the locality l names for clients of c: l itself if it is
// already admitted or there is room, else none (as for a locality longer
// than a label value).
func (b *localityBound) admit(c class, l *corev3.Locality) model.Locality {
	loc := model.Locality{Region: l.GetRegion(), Zone: l.GetZone(), Subzone: l.GetSubZone()}
	if loc == (model.Locality{}) || len(loc.Region) > maxLocalityLabel || len(loc.Zone) > maxLocalityLabel || len(loc.Subzone) > maxLocalityLabel {
		return model.Locality{}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	m := b.seen[c]
	if _, ok := m[loc]; ok {
		return loc
	}
	if len(m) >= b.max {
		return model.Locality{}
	}
	if m == nil {
		m = map[model.Locality]struct{}{}
		b.seen[c] = m
	}
	m[loc] = struct{}{}
	return loc
}

// viewFor returns the view of node's class, with the resources of typeURL
// built: the view is created on first use, and a group of types is built
// the first time a client of the class asks for one of them.
func (s *Server) viewFor(node *corev3.Node, typeURL string) (*view, error) {
	c := s.classFor(node, typeURL)
	s.viewsMu.RLock()
	v := s.views[c]
	s.viewsMu.RUnlock()
	if v != nil && v.isReady(typeURL) {
		return v, nil
	}
	s.buildMu.Lock()
	defer s.buildMu.Unlock()
	s.viewsMu.RLock()
	v = s.views[c]
	s.viewsMu.RUnlock()
	if v == nil {
		v = newView(c, s.cfg.VersionPrefix, slogAdapter{s.log})
		s.viewsMu.Lock()
		s.views[c] = v
		s.viewsMu.Unlock()
		s.log.Info("xds class created", "network", c.Network, "cluster", c.Cluster, "client", c.Kind.String())
	}
	if v.isReady(typeURL) {
		return v, nil
	}
	start := time.Now()
	g := groupOf(typeURL)
	v.building[g] = true
	if err := s.resync(s.newBuilder(), v); err != nil {
		v.building[g] = false
		return nil, status.Errorf(codes.Internal, "build resources of class %s: %v", c, err)
	}
	v.ready[g].Store(true)
	s.log.Info("xds class now serves", "network", c.Network, "cluster", c.Cluster, "type", typeURL, "took", time.Since(start))
	return v, nil
}

// internNames replaces the names of resources of typeURL a request of node
// subscribes to by the copies the node's class holds (typeCache.intern).
func (s *Server) internNames(node *corev3.Node, typeURL string, names []string) {
	if v := s.view(s.classFor(node, typeURL)); v != nil {
		if tc := v.caches[typeURL]; tc != nil {
			tc.intern(names)
		}
	}
}

// view returns the existing view of class c, or nil.
func (s *Server) view(c class) *view {
	s.viewsMu.RLock()
	defer s.viewsMu.RUnlock()
	return s.views[c]
}

// routerCache is the cache.Cache the xDS streams watch through: it
// routes each watch to the view of the requesting node's class, whose
// MuxCache routes it by type URL to a typeCache.
type routerCache struct{ s *Server }

var _ cache.Cache = routerCache{}

func checkType(t string) error {
	if !slices.Contains(allTypes, t) {
		return status.Errorf(codes.InvalidArgument, "unsupported type URL %q", t)
	}
	return nil
}

// CreateWatch opens a SotW watch on the view of the request's node (pilot
// serves SotW streams itself, see sotwserver.go: this completes cache.Cache).
func (r routerCache) CreateWatch(req *cache.Request, sub cache.Subscription, ch chan cache.Response) (func(), error) {
	return r.s.sotwWatch(req, sub, func(resp cache.Response) { ch <- resp })
}

// CreateDeltaWatch opens a delta watch on the view of the request's node
// (on the node's own cache for the authorization type).
func (r routerCache) CreateDeltaWatch(req *cache.DeltaRequest, sub cache.Subscription, ch chan cache.DeltaResponse) (func(), error) {
	if req.GetTypeUrl() == AuthorizationType || req.GetTypeUrl() == IstioAuthorizationType {
		return r.s.authz.createDeltaWatch(req, sub, ch)
	}
	if err := checkType(req.GetTypeUrl()); err != nil {
		return nil, err
	}
	if req.GetTypeUrl() == IstioAddressType {
		return r.s.istioAddressWatch(req, sub, ch)
	}
	return r.s.openDeltaWatch(req, sub, ch)
}

// Fetch is not served: xDS over REST is not supported.
func (routerCache) Fetch(context.Context, *cache.Request) (cache.Response, error) {
	return nil, status.Error(codes.Unimplemented, "xDS over REST is not supported")
}

// errNoView is returned by debug lookups of a class nobody connected from.
var errNoView = errors.New("no client of this class is connected")
