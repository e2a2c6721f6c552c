// Package registry merges every cluster's view into the federated registry
// and publishes typed, debounced change events.
//
// Namespace sameness: a Service with the same name and namespace in several
// clusters is one service (hostname <name>.<ns>.svc.<domain>), whose
// endpoints are the union of per-cluster shards and whose VIPs are kept per
// cluster; ports are merged by name, the oldest definition winning a
// conflict (the MCS rule), and conflicts are reported. Cluster-local hosts
// never leave their cluster; a cluster's endpoints of a service whose scope
// is local there (model.ClusterService.ScopeLocal) stay in that cluster; in
// MCS export mode only exported services leave theirs.
//
// Clusters feed it through the controller.Sink contract (Activate, Update,
// Deactivate per cluster generation), so a kubeconfig rotation swaps a
// cluster's state without a gap and without events when nothing changed.
//
// Readers get immutable values: a change replaces a service's or
// workload's value under a short write lock, never mutates a published one.
// Subscribers receive model.ChangeSets from Run's goroutine: the first
// change after a quiet period goes out at once (leading edge); changes that
// follow within the quiet period are merged, bounded by a maximum delay.
package registry

import (
	"cmp"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"path"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// Config configures the Registry; zero values take the defaults beside them.
type Config struct {
	// Domain is the services' DNS suffix (default "cluster.local").
	Domain string
	// QuietPeriod merges changes that follow each other closer than this
	// (default 100 ms).
	QuietPeriod time.Duration
	// MaxDelay bounds how long a change may wait for a burst to end
	// (default 1 s).
	MaxDelay time.Duration
	// ClusterLocalHosts are hostnames (a leading "*." matches any prefix)
	// that never cross clusters (default *.kube-system.svc.<domain> and
	// kubernetes.default.svc.<domain>).
	ClusterLocalHosts []string
	// ExportMode federates only services with an MCS ServiceExport; the others
	// stay local to their cluster. Exported services also resolve as
	// <name>.<ns>.svc.clusterset.local.
	ExportMode bool
	// StaleGrace is how long an unreachable cluster's last state is kept
	// before it is removed (0: forever).
	StaleGrace time.Duration
	// Logger (default: discards).
	Logger *slog.Logger
	// Registerer receives the registry's metrics (nil: not registered).
	Registerer prometheus.Registerer
}

// withDefaults fills what c leaves empty.
func (c Config) withDefaults() Config {
	if c.Domain == "" {
		c.Domain = model.DefaultDomain
	}
	if c.QuietPeriod == 0 {
		c.QuietPeriod = 100 * time.Millisecond
	}
	if c.MaxDelay == 0 {
		c.MaxDelay = time.Second
	}
	if c.ClusterLocalHosts == nil {
		c.ClusterLocalHosts = []string{"*.kube-system.svc." + c.Domain, "kubernetes.default.svc." + c.Domain}
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

// ClusterSetDomain is the MCS clusterset domain.
const ClusterSetDomain = "clusterset.local"

// Registry is the federated registry. It is safe for concurrent use.
type Registry struct {
	cfg Config
	log *slog.Logger

	mu       sync.RWMutex
	clusters map[model.ClusterID]*clusterState
	services map[string]*model.Service // by hostname
	// placements counts workloads per (cluster, node, namespace, service
	// account) and network, and per (cluster, "", namespace, service
	// account) and network: where an identity runs, for the CA's and
	// xDS's authorization.
	placements map[saKey]map[model.Network]int
	gateways   []model.NetworkGateway
	stale      map[model.ClusterID]time.Time
	// book holds every claim on an address, per network, and its owner
	// (addresses.go); fx collects what claim changes require of the
	// change being applied.
	book *addressBook
	fx   effects

	feed *feed
}

type saKey struct {
	cluster      model.ClusterID
	node, ns, sa string
}

// clusterState is what one cluster (one generation of it) contributes.
type clusterState struct {
	gen      uint64
	services map[model.ServiceKey]*model.ClusterService
	shards   map[model.ServiceKey][]model.Endpoint
	// workloads are the pods' workloads; those made from EndpointSlice
	// addresses are found through their service's shard (workload).
	workloads map[string]*model.Workload
	gateways  []model.NetworkGateway
	staleT    *time.Timer
}

// workload returns the workload of uid, a pod's or one made from an
// EndpointSlice address (nil if none).
func (cs *clusterState) workload(uid string) *model.Workload {
	if w := cs.workloads[uid]; w != nil {
		return w
	}
	k, ok := model.SliceWorkloadService(uid)
	if !ok {
		return nil
	}
	eps := cs.shards[k]
	if i, found := model.FindEndpoint(eps, uid); found && eps[i].Workload.FromSlice {
		return eps[i].Workload
	}
	return nil
}

// eachWorkload calls fn for every workload of cs.
func (cs *clusterState) eachWorkload(fn func(*model.Workload)) {
	for _, w := range cs.workloads {
		fn(w)
	}
	cs.eachFromSlice(fn)
}

// eachFromSlice calls fn for every workload made from an EndpointSlice
// address.
func (cs *clusterState) eachFromSlice(fn func(*model.Workload)) {
	for _, eps := range cs.shards {
		for _, e := range eps {
			if e.Workload.FromSlice {
				fn(e.Workload)
			}
		}
	}
}

// New makes an empty registry; Run publishes its changes.
func New(cfg Config) *Registry {
	cfg = cfg.withDefaults()
	log := cfg.Logger.With("component", "registry")
	r := &Registry{
		cfg: cfg, log: log, book: newAddressBook(cfg.Registerer, log),
		clusters: map[model.ClusterID]*clusterState{}, services: map[string]*model.Service{},
		placements: map[saKey]map[model.Network]int{},
		stale:      map[model.ClusterID]time.Time{},
		feed:       newFeed(cfg.QuietPeriod, cfg.MaxDelay),
	}
	if cfg.Registerer != nil {
		// Istio's pilot_services, read from the one map of services.
		cfg.Registerer.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "pilot_services", Help: "Total services known to pilot: federated services by hostname (Istio's metric).",
		}, func() float64 { return float64(r.ServiceCount()) }))
	}
	return r
}

// ---- controller.Sink ----

// Activate serves gen's whole state for cluster, replacing an older
// generation's; only differences produce changes.
func (r *Registry) Activate(cluster model.ClusterID, gen uint64, st *model.ClusterState) {
	r.mu.Lock()
	defer r.mu.Unlock()
	old := r.clusters[cluster]
	if old != nil && old.gen > gen {
		return
	}
	next := &clusterState{gen: gen, services: st.Services, shards: st.Shards, workloads: st.Workloads, gateways: st.Gateways}
	if next.services == nil {
		next.services = map[model.ServiceKey]*model.ClusterService{}
	}
	if next.shards == nil {
		next.shards = map[model.ServiceKey][]model.Endpoint{}
	}
	if next.workloads == nil {
		next.workloads = map[string]*model.Workload{}
	}
	// Made workloads are found through their shards, never the index.
	maps.DeleteFunc(next.workloads, func(_ string, w *model.Workload) bool { return w.FromSlice })
	if old == nil {
		old = &clusterState{}
	} else if old.staleT != nil {
		old.staleT.Stop()
	}
	r.clusters[cluster] = next
	delete(r.stale, cluster)
	var changes []model.Change
	svcKeys := map[model.ServiceKey]bool{}
	for k, cs := range next.services {
		if o := old.services[k]; o == nil || !clusterServiceEqual(o, cs) {
			svcKeys[k] = true
		}
	}
	for k := range old.services {
		if next.services[k] == nil {
			svcKeys[k] = true
		}
	}
	for k, sh := range next.shards {
		if !shardEqual(old.shards[k], sh) {
			svcKeys[k] = true
		}
	}
	for k := range old.shards {
		if _, ok := next.shards[k]; !ok {
			svcKeys[k] = true
		}
	}
	for uid, w := range next.workloads {
		changes = r.putWorkload(changes, uid, old.workload(uid), w)
	}
	next.eachFromSlice(func(w *model.Workload) {
		changes = r.putWorkload(changes, w.UID, old.workload(w.UID), w)
	})
	old.eachWorkload(func(w *model.Workload) {
		if next.workload(w.UID) == nil {
			changes = r.putWorkload(changes, w.UID, w, nil)
		}
	})
	changes = r.applyEffects(changes, svcKeys)
	for k := range svcKeys {
		changes = r.rebuildService(changes, k)
	}
	if !gatewaysEqual(old.gateways, next.gateways) {
		changes = r.rebuildGateways(changes)
	}
	r.feed.add(changes)
}

// Update applies a change of cluster's serving generation.
func (r *Registry) Update(cluster model.ClusterID, gen uint64, d *model.ClusterDelta) {
	r.mu.Lock()
	defer r.mu.Unlock()
	cs := r.clusters[cluster]
	if cs == nil || cs.gen != gen {
		return
	}
	var changes []model.Change
	svcKeys := map[model.ServiceKey]bool{}
	for k, s := range d.Services {
		old := cs.services[k]
		switch {
		case s == nil && old == nil:
			continue
		case s == nil:
			delete(cs.services, k)
		case old != nil && clusterServiceEqual(old, s):
			continue
		default:
			cs.services[k] = s
		}
		svcKeys[k] = true
	}
	// Workloads first: a made workload's previous value is in the shard
	// that this delta may replace.
	for uid, w := range d.Workloads {
		prev := cs.workload(uid)
		if w == nil || w.FromSlice {
			delete(cs.workloads, uid)
		} else {
			cs.workloads[uid] = w
		}
		changes = r.putWorkload(changes, uid, prev, w)
	}
	for k, sh := range d.Shards {
		if shardEqual(cs.shards[k], sh) {
			continue
		}
		if len(sh) == 0 {
			delete(cs.shards, k)
		} else {
			cs.shards[k] = sh
		}
		svcKeys[k] = true
	}
	changes = r.applyEffects(changes, svcKeys)
	for k := range svcKeys {
		changes = r.rebuildService(changes, k)
	}
	if d.GatewaysChanged && !gatewaysEqual(cs.gateways, d.Gateways) {
		cs.gateways = d.Gateways
		changes = r.rebuildGateways(changes)
	}
	r.feed.add(changes)
}

// Deactivate removes cluster if gen is still its serving generation: all
// its services' shards, workloads and gateways go in one change set.
func (r *Registry) Deactivate(cluster model.ClusterID, gen uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	cs := r.clusters[cluster]
	if cs == nil || cs.gen != gen {
		return
	}
	r.removeClusterLocked(cluster, cs)
}

func (r *Registry) removeClusterLocked(cluster model.ClusterID, cs *clusterState) {
	if cs.staleT != nil {
		cs.staleT.Stop()
	}
	delete(r.clusters, cluster)
	delete(r.stale, cluster)
	var changes []model.Change
	cs.eachWorkload(func(w *model.Workload) {
		changes = r.putWorkload(changes, w.UID, w, nil)
	})
	keys := map[model.ServiceKey]bool{}
	for k := range cs.services {
		keys[k] = true
	}
	for k := range cs.shards {
		keys[k] = true
	}
	changes = r.applyEffects(changes, keys)
	for k := range keys {
		changes = r.rebuildService(changes, k)
	}
	if len(cs.gateways) > 0 {
		changes = r.rebuildGateways(changes)
	}
	r.log.Info("cluster removed from the registry", "cluster", cluster, "changes", len(changes))
	r.feed.add(changes)
}

// SetReachable records whether a cluster's API server answers. An
// unreachable cluster's last state stays, marked stale, for StaleGrace (0:
// forever), then is removed; reachable again clears the mark.
func (r *Registry) SetReachable(cluster model.ClusterID, reachable bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	cs := r.clusters[cluster]
	if cs == nil {
		return
	}
	if reachable {
		if cs.staleT != nil {
			cs.staleT.Stop()
			cs.staleT = nil
		}
		delete(r.stale, cluster)
		return
	}
	if _, ok := r.stale[cluster]; ok {
		return
	}
	r.stale[cluster] = time.Now()
	r.log.Warn("cluster unreachable; keeping its last state", "cluster", cluster, "grace", r.cfg.StaleGrace)
	if r.cfg.StaleGrace > 0 {
		gen := cs.gen
		cs.staleT = time.AfterFunc(r.cfg.StaleGrace, func() {
			r.mu.Lock()
			defer r.mu.Unlock()
			if cur := r.clusters[cluster]; cur != nil && cur.gen == gen {
				if _, still := r.stale[cluster]; still {
					r.removeClusterLocked(cluster, cur)
				}
			}
		})
	}
}

// ---- derived state (called with mu held) ----

// place adds delta to the placement counts of w, on its node and in its
// cluster as a whole.
func (r *Registry) place(w *model.Workload, delta int) {
	for _, k := range [2]saKey{{w.Cluster, w.Node, w.Namespace, w.ServiceAccount}, {w.Cluster, "", w.Namespace, w.ServiceAccount}} {
		nets := r.placements[k]
		if nets == nil {
			nets = map[model.Network]int{}
			r.placements[k] = nets
		}
		if nets[w.Network] += delta; nets[w.Network] <= 0 {
			delete(nets, w.Network)
		}
		if len(nets) == 0 {
			delete(r.placements, k)
		}
	}
}

// putWorkload accounts for uid's workload changing from old to w (nil:
// none) and reports the change, if any. What that changes for the owners
// of its addresses is collected in r.fx (see applyEffects).
func (r *Registry) putWorkload(changes []model.Change, uid string, old, w *model.Workload) []model.Change {
	if old != w {
		r.book.update(old, w, &r.fx)
	}
	if old != nil {
		r.place(old, -1)
	}
	if w != nil {
		r.place(w, +1)
	}
	op := model.Updated
	switch {
	case w == nil && old == nil:
		return changes
	case w == nil:
		op = model.Removed
	case old == nil:
		op = model.Added
	case old == w || old.Equal(w):
		return changes
	}
	return append(changes, model.Change{Kind: model.WorkloadChange, Op: op, Key: uid})
}

// applyEffects adds to svcKeys the services whose dropped endpoints
// changed, and to changes the workloads whose ownership of an address
// changed (those still present: a removed one is reported as such).
func (r *Registry) applyEffects(changes []model.Change, svcKeys map[model.ServiceKey]bool) []model.Change {
	for k := range r.fx.services {
		svcKeys[k] = true
	}
	for _, uid := range slices.Sorted(maps.Keys(r.fx.owners)) {
		if r.workloadLocked(uid) != nil {
			changes = append(changes, model.Change{Kind: model.WorkloadChange, Op: model.Updated, Key: uid})
		}
	}
	r.fx = effects{}
	return changes
}

// workloadLocked returns the workload of uid (nil if none). The caller
// holds mu.
func (r *Registry) workloadLocked(uid string) *model.Workload {
	cluster, _, _ := strings.Cut(uid, "/")
	if cs := r.clusters[model.ClusterID(cluster)]; cs != nil {
		return cs.workload(uid)
	}
	return nil
}

func (r *Registry) hostname(k model.ServiceKey) string {
	return model.Hostname(k.Name, k.Namespace, r.cfg.Domain)
}

// clusterLocal reports whether host never crosses clusters.
func (r *Registry) clusterLocal(host string) bool {
	for _, pat := range r.cfg.ClusterLocalHosts {
		if suffix, ok := strings.CutPrefix(pat, "*"); ok {
			if strings.HasSuffix(host, suffix) {
				return true
			}
		} else if ok, _ := path.Match(pat, host); ok || pat == host {
			return true
		}
	}
	return false
}

// rebuildService recomputes the federated service k from every cluster.
func (r *Registry) rebuildService(changes []model.Change, k model.ServiceKey) []model.Change {
	host := r.hostname(k)
	var defs []*model.ClusterService
	for _, cs := range r.clusters {
		if s := cs.services[k]; s != nil {
			defs = append(defs, s)
		}
	}
	old := r.services[host]
	if len(defs) == 0 {
		if old == nil {
			return changes
		}
		delete(r.services, host)
		return append(changes, model.Change{Kind: model.ServiceChange, Op: model.Removed, Key: host})
	}
	// Oldest definition first (MCS conflict rule), then by cluster ID.
	slices.SortFunc(defs, func(a, b *model.ClusterService) int {
		return cmp.Or(a.Created.Compare(b.Created), cmp.Compare(a.Cluster, b.Cluster))
	})
	svc := &model.Service{
		Name: k.Name, Namespace: k.Namespace, Hostname: host, Headless: defs[0].Headless,
		VIPs: map[model.ClusterID][]netip.Addr{}, Shards: map[model.ClusterID][]model.Endpoint{},
	}
	if r.clusterLocal(host) {
		svc.Scope = model.ScopeClusterLocal
	}
	byName := map[string]int{}
	for _, d := range defs {
		svc.Clusters = append(svc.Clusters, d.Cluster)
		if len(d.VIPs) > 0 {
			svc.VIPs[d.Cluster] = d.VIPs
			if svc.VIPNetworks == nil {
				svc.VIPNetworks = map[model.ClusterID]model.Network{}
			}
			svc.VIPNetworks[d.Cluster] = d.Network
		}
		if sh := r.book.withoutDropped(k, r.clusters[d.Cluster].shards[k]); len(sh) > 0 {
			svc.Shards[d.Cluster] = sh
		}
		// A cluster's endpoints are shared only where the service is global
		// in that cluster (and, in export mode, exported there).
		if d.ScopeLocal || (r.cfg.ExportMode && !d.Exported) {
			if svc.LocalClusters == nil {
				svc.LocalClusters = map[model.ClusterID]bool{}
			}
			svc.LocalClusters[d.Cluster] = true
		}
		for _, p := range d.Ports {
			i, seen := byName[p.Name]
			if !seen {
				byName[p.Name] = len(svc.Ports)
				svc.Ports = append(svc.Ports, p)
				continue
			}
			if svc.Ports[i] != p {
				svc.PortConflicts = append(svc.PortConflicts, fmt.Sprintf("port %q in cluster %s (%d/%s) differs from the oldest definition (%d/%s); ignored",
					p.Name, d.Cluster, p.Port, p.Protocol, svc.Ports[i].Port, svc.Ports[i].Protocol))
			}
		}
	}
	slices.Sort(svc.Clusters)
	svc.Definitions = defs
	r.services[host] = svc
	op := model.Added
	if old != nil {
		op = model.Updated
	}
	return append(changes, model.Change{Kind: model.ServiceChange, Op: op, Key: host})
}
