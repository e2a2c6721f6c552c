package controller

import (
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// Sink receives one cluster generation's view; the federated registry
// implements it. Calls for one generation are serial.
type Sink interface {
	// Activate serves gen's whole state for its cluster, replacing any older
	// generation's (the sink diffs them, so an equal state changes nothing).
	// An Activate older than the serving generation is ignored.
	Activate(cluster model.ClusterID, gen uint64, state *model.ClusterState)
	// Update applies a change of the serving generation (ignored otherwise).
	Update(cluster model.ClusterID, gen uint64, delta *model.ClusterDelta)
	// Deactivate removes the cluster if gen is still its serving generation.
	Deactivate(cluster model.ClusterID, gen uint64)
}

// view is one cluster generation's discovered state. Store callbacks of
// every watched kind mutate it under mu; after each mutation the changed
// keys go to the sink as one delta, once the view is active.
type view struct {
	mu             sync.Mutex
	cluster        model.ClusterID
	gen            uint64
	domain         string
	defaultNetwork model.Network
	sink           Sink
	active         bool

	podsByNS  map[string]map[string]*podInfo // ns -> name
	services  map[model.ServiceKey]*svcInfo
	svcsByNS  map[string]map[string]*svcInfo
	nodes     map[string]model.Locality
	nsNetwork model.Network                              // the control-plane namespace's network label
	slices    map[string]*sliceInfo                      // ns/name
	slicesBy  map[model.ServiceKey]map[string]*sliceInfo // service -> slice name
	podRefs   map[string]map[string][]sliceRef           // ns -> pod name -> slice addresses naming it
	exported  map[model.ServiceKey]time.Time             // ServiceExport creation times
	// scoper decides each service's scope from its labels and its
	// namespace's (nsLabels, every namespace's; servicescope.go).
	scoper   *Scoper
	nsLabels map[string]map[string]string
	// nsDistribution is each namespace's Istio traffic-distribution
	// annotation (only those that have one; distribution.go).
	nsDistribution map[string]string
	// gatewayNS are the namespaces whose Services may be east-west
	// gateways; selectedNS those that the operator's namespace selector
	// matches (maintained by a watch). A candidate elsewhere is ignored.
	gatewayNS  map[string]bool
	selectedNS map[string]bool
	// discovered are the namespaces the discovery selectors select (nil:
	// every namespace is discovered; scope.go); onEnter is called when one
	// enters the selection, and scoped are the stores of namespaced kinds.
	discovered map[string]bool
	onEnter    func()
	scoped     []*store

	// Derived state, as the sink has it. Workloads made from EndpointSlice
	// addresses are kept only in their service's shard, not in workloads:
	// at 100,000 addresses a second index of them is ~4 MB.
	workloads map[string]*model.Workload  // pods' workloads
	shards    map[model.ServiceKey]*shard // endpoints per service, sorted by workload uid

	// placer shares one placement among the workloads of one identity on
	// one node.
	placer model.Placer

	// Shared immutable values: identical label sets and service-port maps
	// are stored once per view; values no one holds are swept (intern.go).
	interned interned

	delta model.ClusterDelta
}

func newView(cluster model.ClusterID, gen uint64, domain string, network model.Network, sink Sink) *view {
	return &view{
		cluster: cluster, gen: gen, domain: domain, defaultNetwork: network, sink: sink,
		podsByNS: map[string]map[string]*podInfo{},
		services: map[model.ServiceKey]*svcInfo{}, svcsByNS: map[string]map[string]*svcInfo{},
		nodes: map[string]model.Locality{}, slices: map[string]*sliceInfo{}, slicesBy: map[model.ServiceKey]map[string]*sliceInfo{},
		podRefs:  map[string]map[string][]sliceRef{},
		exported: map[model.ServiceKey]time.Time{}, nsLabels: map[string]map[string]string{}, nsDistribution: map[string]string{}, gatewayNS: map[string]bool{}, selectedNS: map[string]bool{},
		workloads: map[string]*model.Workload{}, shards: map[model.ServiceKey]*shard{},
		interned: newInterned(),
	}
}

// flush sends the pending delta to the sink when active. Called with mu held.
func (v *view) flush() {
	d := v.delta
	v.delta = model.ClusterDelta{}
	if v.active && !d.Empty() {
		v.sink.Update(v.cluster, v.gen, &d)
	}
}

// activate sends the whole state to the sink; from then on deltas follow.
func (v *view) activate() {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.active {
		return
	}
	v.active = true
	v.delta = model.ClusterDelta{}
	st := &model.ClusterState{
		Services:  make(map[model.ServiceKey]*model.ClusterService, len(v.services)),
		Shards:    make(map[model.ServiceKey][]model.Endpoint, len(v.shards)),
		Workloads: maps.Clone(v.workloads),
		Gateways:  v.gatewayList(),
	}
	for k, s := range v.services {
		st.Services[k] = s.cs
	}
	for k, sh := range v.shards {
		st.Shards[k] = sh.publish()
	}
	v.sink.Activate(v.cluster, v.gen, st)
}

func (v *view) deactivate() {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.active {
		v.active = false
		v.sink.Deactivate(v.cluster, v.gen)
	}
}

// ---- derived state ----

func (v *view) networkOf(p *podInfo) model.Network {
	if n := p.labels[NetworkLabel]; n != "" {
		return model.Network(n)
	}
	if v.nsNetwork != "" {
		return v.nsNetwork
	}
	return v.defaultNetwork
}

// servicesSelecting returns the selector services in p's namespace whose
// selector matches p.
func (v *view) servicesSelecting(p *podInfo) []*svcInfo {
	var out []*svcInfo
	for _, s := range v.svcsByNS[p.ns] {
		if s.selector != nil && !s.selector.Empty() && s.selector.Matches(labelsOf(p.labels)) {
			out = append(out, s)
		}
	}
	return out
}

type labelsOf map[string]string

func (l labelsOf) Has(k string) bool              { _, ok := l[k]; return ok }
func (l labelsOf) Get(k string) string            { return l[k] }
func (l labelsOf) Lookup(k string) (string, bool) { v, ok := l[k]; return v, ok }

// portsFor maps the service's ports to p's target ports.
func portsFor(s *svcInfo, p *podInfo) []model.PortMapping {
	out := make([]model.PortMapping, 0, len(s.cs.Ports))
	for _, sp := range s.cs.Ports {
		tp := sp.TargetPort
		if sp.TargetPortName != "" {
			var ok bool
			if tp, ok = p.namedPort(sp.TargetPortName); !ok {
				continue
			}
		}
		out = append(out, model.PortMapping{ServicePort: sp.Port, TargetPort: tp})
	}
	return out
}

func (v *view) hostname(k model.ServiceKey) string {
	return model.Hostname(k.Name, k.Namespace, v.domain)
}

// workloadOf derives p's workload; nil when it has no address.
func (v *view) workloadOf(p *podInfo) *model.Workload {
	if len(p.ips) == 0 {
		return nil
	}
	w := &model.Workload{
		UID: model.WorkloadUID(v.cluster, p.ns, p.name), Name: p.name, Addresses: p.ips,
		Placement: v.placer.Place(model.Placement{Cluster: v.cluster, Network: v.networkOf(p), Node: p.node,
			Namespace: p.ns, ServiceAccount: p.sa, Locality: v.nodes[p.node]}),
		Labels: p.labels, Ready: p.ready && !p.terminating, Terminating: p.terminating, HostNetwork: p.hostNetwork,
		Created: int64(p.created),
	}
	var svcs map[string][]model.PortMapping
	for _, s := range v.servicesSelecting(p) {
		if svcs == nil {
			svcs = map[string][]model.PortMapping{}
		}
		svcs[v.hostname(s.cs.Key())] = portsFor(s, p)
	}
	w.Services = v.internServices(v.sliceBindings(p, svcs))
	return w
}

// portsOf returns the view's shared copy of s's port mapping for p.
func (v *view) portsOf(s *svcInfo, p *podInfo) []model.PortMapping {
	return v.internPorts(portsFor(s, p))
}

// setWorkload records pod workload uid (nil: none) and notes it in the
// delta when it changed; it reports whether it did.
func (v *view) setWorkload(uid string, w *model.Workload) bool {
	old, had := v.workloads[uid]
	if w == nil {
		if !had {
			return false
		}
		delete(v.workloads, uid)
	} else {
		if had && old.Equal(w) {
			return false
		}
		v.workloads[uid] = w
	}
	v.noteWorkload(uid, w)
	return true
}

// noteWorkload records a change of workload uid (nil: removed) in the delta.
func (v *view) noteWorkload(uid string, w *model.Workload) {
	if v.delta.Workloads == nil {
		v.delta.Workloads = map[string]*model.Workload{}
	}
	v.delta.Workloads[uid] = w
}

// finish renders the changed shards and flushes. Called with mu held after
// every store callback.
func (v *view) finish() {
	for k := range v.delta.Shards {
		if sh := v.shards[k]; sh != nil {
			v.delta.Shards[k] = sh.publish()
		}
		if s := v.services[k]; s != nil && s.gateway != nil {
			v.gatewaysChanged() // its identities or capacity may have changed
		}
	}
	if v.delta.GatewaysChanged {
		v.delta.Gateways = v.gatewayList()
	}
	v.flush()
	v.maybeSweep()
}

// refreshPod recomputes p's workload, its endpoints in the services of
// extra (services whose selection of p may have changed) and in those that
// select it now, and the slice addresses that name it.
func (v *view) refreshPod(p *podInfo, extra []*svcInfo) {
	uid := model.WorkloadUID(v.cluster, p.ns, p.name)
	v.setWorkload(uid, v.workloadOf(p))
	w := v.workloads[uid] // the stored (possibly unchanged) value
	now := map[model.ServiceKey]bool{}
	if w != nil {
		for _, s := range v.servicesSelecting(p) {
			k := s.cs.Key()
			now[k] = true
			v.setEndpoint(k, uid, &model.Endpoint{Workload: w, Ports: v.portsOf(s, p)})
		}
	}
	for _, s := range extra {
		if k := s.cs.Key(); !now[k] {
			v.setEndpoint(k, uid, nil)
		}
	}
	v.refreshNamed(p.ns, p.name)
}

// ---- store callbacks: called with mu held; the store finishes ----

func (v *view) putPod(p *podInfo) {
	p.labels = v.internLabels(p.labels)
	old := v.podsByNS[p.ns][p.name]
	if p.equal(old) {
		return
	}
	var before []*svcInfo
	if old != nil {
		before = v.servicesSelecting(old)
		v.unindexPod(old)
	}
	addIndex(v.podsByNS, p.ns, p.name, p)
	v.refreshPod(p, before)
}

func (v *view) removePod(key string) {
	ns, name := splitKey(key)
	old := v.podsByNS[ns][name]
	if old == nil {
		return
	}
	for _, s := range v.servicesSelecting(old) {
		v.setEndpoint(s.cs.Key(), model.WorkloadUID(v.cluster, old.ns, old.name), nil)
	}
	v.unindexPod(old)
	v.setWorkload(model.WorkloadUID(v.cluster, old.ns, old.name), nil)
	v.refreshNamed(old.ns, old.name)
}

func (v *view) unindexPod(p *podInfo) {
	delIndex(v.podsByNS, p.ns, p.name)
}

func (v *view) putService(s *svcInfo) {
	k := s.cs.Key()
	if at, ok := v.exported[k]; ok {
		s.cs.Exported, s.cs.ExportCreated = true, at
	}
	s.cs.Network = v.nsNetworkOr()
	s.cs.ScopeLocal = v.scoper.Local(s.labels, v.nsLabels[k.Namespace])
	s.cs.LoadBalancing, s.cs.LoadBalancingError = s.loadBalancing(v.nsDistribution, k.Namespace)
	old := v.services[k]
	if serviceEqual(old, s) {
		old.labels = s.labels // what the next scope decision reads
		old.ownLB, old.ownLBErr = s.ownLB, s.ownLBErr
		return
	}
	v.services[k] = s
	addIndex(v.svcsByNS, k.Namespace, k.Name, s)
	v.setServiceDelta(k, s.cs)
	v.markShard(k)
	if old != nil && (old.gateway != nil) || s.gateway != nil {
		v.gatewaysChanged()
	}
	v.refreshService(k, old, s)
}

func (v *view) removeService(key string) {
	ns, name := splitKey(key)
	k := model.ServiceKey{Namespace: ns, Name: name}
	old := v.services[k]
	if old == nil {
		return
	}
	delete(v.services, k)
	delIndex(v.svcsByNS, ns, name)
	v.setServiceDelta(k, nil)
	v.markShard(k)
	if old.gateway != nil {
		v.gatewaysChanged()
	}
	v.refreshService(k, old, nil)
}

func (v *view) setServiceDelta(k model.ServiceKey, cs *model.ClusterService) {
	if v.delta.Services == nil {
		v.delta.Services = map[model.ServiceKey]*model.ClusterService{}
	}
	v.delta.Services[k] = cs
}

// refreshService recomputes the workloads and endpoints of the pods old
// or cur selected, and the slice endpoints of a selector-less service.
func (v *view) refreshService(k model.ServiceKey, old, cur *svcInfo) {
	if cur != nil && cur.selector != nil {
		// Withdraw what slices contributed before the pods come in.
		v.refreshSlices(k)
	}
	for _, p := range v.podsByNS[k.Namespace] {
		if (old != nil && old.selector != nil && !old.selector.Empty() && old.selector.Matches(labelsOf(p.labels))) ||
			(cur != nil && cur.selector != nil && !cur.selector.Empty() && cur.selector.Matches(labelsOf(p.labels))) {
			var extra []*svcInfo
			if old != nil {
				extra = []*svcInfo{old}
			}
			v.refreshPod(p, extra)
		}
	}
	if cur == nil || cur.selector == nil {
		v.refreshSlices(k)
	}
	// The pods its slices name are bound to a selector-less service.
	if (old != nil && old.selector == nil) || (cur != nil && cur.selector == nil) {
		for _, p := range v.podsNamedBy(k) {
			v.refreshPod(p, nil)
		}
	}
}

func (v *view) putNode(name string, loc model.Locality) {
	if old, ok := v.nodes[name]; ok && old == loc {
		return
	}
	v.nodes[name] = loc
	v.refreshNode(name)
}

func (v *view) removeNode(name string) {
	if _, ok := v.nodes[name]; !ok {
		return
	}
	delete(v.nodes, name)
	v.refreshNode(name)
}

// refreshNode re-derives the pods on node name after its locality changed.
// Localities rarely change, so this scans the pods rather than keep a
// per-node index for every pod.
func (v *view) refreshNode(name string) {
	for _, byName := range v.podsByNS {
		for _, p := range byName {
			if p.node == name {
				v.refreshPod(p, nil)
			}
		}
	}
	for k, bySlice := range v.slicesBy {
		if slices.ContainsFunc(slices.Collect(maps.Values(bySlice)), func(sl *sliceInfo) bool {
			return slices.ContainsFunc(sl.endpoints, func(e sliceEndpoint) bool { return e.node() == name })
		}) {
			v.refreshSlices(k)
		}
	}
}

// setNamespaceNetwork records the control-plane namespace's network label;
// a change re-derives every pod's network.
func (v *view) setNamespaceNetwork(n model.Network) {
	if v.nsNetwork == n {
		return
	}
	v.nsNetwork = n
	for k, s := range v.services {
		if s.cs.Network != v.nsNetworkOr() {
			cs := *s.cs
			cs.Network = v.nsNetworkOr()
			v.services[k] = s.with(&cs)
			v.setServiceDelta(k, &cs)
		}
	}
	for _, byName := range v.podsByNS {
		for _, p := range byName {
			v.refreshPod(p, nil)
		}
	}
	for k := range v.slicesBy {
		v.refreshSlices(k)
	}
}

// setNamespaceLabels records namespace ns's labels (nil: gone or none) and
// re-scopes its services: a namespace relabelled istio.io/global, or into
// or out of a scope rule's selector, takes effect at once.
func (v *view) setNamespaceLabels(ns string, l map[string]string) {
	if old, ok := v.nsLabels[ns]; ok == (l != nil) && maps.Equal(old, l) {
		return
	}
	if l == nil {
		delete(v.nsLabels, ns)
	} else {
		v.nsLabels[ns] = l
	}
	for name := range v.svcsByNS[ns] {
		k := model.ServiceKey{Namespace: ns, Name: name}
		s := v.services[k] // the current value (the index may hold an older one)
		if s == nil {
			continue
		}
		local := v.scoper.Local(s.labels, l)
		if local == s.cs.ScopeLocal {
			continue
		}
		cs := *s.cs
		cs.ScopeLocal = local
		v.services[k] = s.with(&cs)
		v.setServiceDelta(k, &cs)
	}
}

// setNamespaceDistribution records namespace ns's Istio traffic-distribution
// annotation ("" for none, or gone) and re-derives the routing preference of
// its services that set none of their own.
func (v *view) setNamespaceDistribution(ns, value string) {
	if v.nsDistribution[ns] == value {
		return
	}
	if value == "" {
		delete(v.nsDistribution, ns)
	} else {
		v.nsDistribution[ns] = intern(value)
	}
	for name := range v.svcsByNS[ns] {
		k := model.ServiceKey{Namespace: ns, Name: name}
		s := v.services[k] // the current value (the index may hold an older one)
		if s == nil {
			continue
		}
		lb, lbErr := s.loadBalancing(v.nsDistribution, ns)
		if lb.Equal(s.cs.LoadBalancing) && lbErr == s.cs.LoadBalancingError {
			continue
		}
		cs := *s.cs
		cs.LoadBalancing, cs.LoadBalancingError = lb, lbErr
		v.services[k] = s.with(&cs)
		v.setServiceDelta(k, &cs)
	}
}

// setExported records whether service k has a ServiceExport, created at.
func (v *view) setExported(k model.ServiceKey, exported bool, at time.Time) {
	if old, ok := v.exported[k]; ok == exported && old.Equal(at) {
		return
	}
	if exported {
		v.exported[k] = at
	} else {
		delete(v.exported, k)
		at = time.Time{}
	}
	if s := v.services[k]; s != nil {
		cs := *s.cs
		cs.Exported, cs.ExportCreated = exported, at
		v.services[k] = s.with(&cs)
		v.setServiceDelta(k, &cs)
	}
}

// ---- helpers ----

func addIndex[T any](idx map[string]map[string]T, outer, inner string, val T) {
	m := idx[outer]
	if m == nil {
		m = map[string]T{}
		idx[outer] = m
	}
	m[inner] = val
}

func delIndex[T any](idx map[string]map[string]T, outer, inner string) {
	if m := idx[outer]; m != nil {
		delete(m, inner)
		if len(m) == 0 {
			delete(idx, outer)
		}
	}
}
