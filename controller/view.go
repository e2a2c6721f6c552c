package controller

import (
	"cmp"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"sync"

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

	pods       map[string]*podInfo            // ns/name
	podsByNS   map[string]map[string]*podInfo // ns -> name
	podsByNode map[string]map[string]*podInfo // node -> ns/name
	services   map[model.ServiceKey]*svcInfo
	svcsByNS   map[string]map[string]*svcInfo
	nodes      map[string]model.Locality
	nsNetwork  model.Network                              // the control-plane namespace's network label
	slices     map[string]*sliceInfo                      // ns/name
	slicesBy   map[model.ServiceKey]map[string]*sliceInfo // service -> slice name
	exported   map[model.ServiceKey]bool

	// Derived state, as the sink has it.
	workloads map[string]*model.Workload
	members   map[model.ServiceKey]map[string]struct{}       // pods (by name) backing a selector service
	sliceEPs  map[model.ServiceKey]map[string]model.Endpoint // endpoints of selector-less services, by address
	sliceWLs  map[model.ServiceKey]map[string]bool           // uids of workloads made from slices

	// Shared immutable values: identical label sets and service-port maps
	// are stored once per view.
	labelSets   map[string]map[string]string
	serviceMaps map[string]map[string][]model.PortMapping

	delta model.ClusterDelta
}

func newView(cluster model.ClusterID, gen uint64, domain string, network model.Network, sink Sink) *view {
	return &view{
		cluster: cluster, gen: gen, domain: domain, defaultNetwork: network, sink: sink,
		pods: map[string]*podInfo{}, podsByNS: map[string]map[string]*podInfo{}, podsByNode: map[string]map[string]*podInfo{},
		services: map[model.ServiceKey]*svcInfo{}, svcsByNS: map[string]map[string]*svcInfo{},
		nodes: map[string]model.Locality{}, slices: map[string]*sliceInfo{}, slicesBy: map[model.ServiceKey]map[string]*sliceInfo{},
		exported:  map[model.ServiceKey]bool{},
		workloads: map[string]*model.Workload{}, members: map[model.ServiceKey]map[string]struct{}{},
		sliceEPs: map[model.ServiceKey]map[string]model.Endpoint{}, sliceWLs: map[model.ServiceKey]map[string]bool{},
		labelSets: map[string]map[string]string{}, serviceMaps: map[string]map[string][]model.PortMapping{},
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
		Shards:    make(map[model.ServiceKey][]model.Endpoint, len(v.members)+len(v.sliceEPs)),
		Workloads: maps.Clone(v.workloads),
		Gateways:  v.gatewayList(),
	}
	for k, s := range v.services {
		st.Services[k] = s.cs
	}
	for _, keys := range []map[model.ServiceKey]struct{}{setOf(v.members), setOf(v.sliceEPs)} {
		for k := range keys {
			if sh := v.shardSlice(k); len(sh) > 0 {
				st.Shards[k] = sh
			}
		}
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
		UID: model.WorkloadUID(v.cluster, p.ns, p.name), Name: p.name, Namespace: p.ns, Addresses: p.ips,
		ServiceAccount: p.sa, Node: p.node, Cluster: v.cluster, Network: v.networkOf(p), Locality: v.nodes[p.node],
		Labels: p.labels, Ready: p.ready && !p.terminating, Terminating: p.terminating,
	}
	var svcs map[string][]model.PortMapping
	for _, s := range v.servicesSelecting(p) {
		if svcs == nil {
			svcs = map[string][]model.PortMapping{}
		}
		svcs[v.hostname(s.cs.Key())] = portsFor(s, p)
	}
	w.Services = v.internServices(svcs)
	return w
}

// internServices returns the view's shared copy of an equal services map.
func (v *view) internServices(m map[string][]model.PortMapping) map[string][]model.PortMapping {
	if len(m) == 0 {
		return nil
	}
	var b strings.Builder
	for _, h := range slices.Sorted(maps.Keys(m)) {
		b.WriteString(h)
		for _, pm := range m[h] {
			fmt.Fprintf(&b, ",%d:%d", pm.ServicePort, pm.TargetPort)
		}
		b.WriteByte(';')
	}
	key := b.String()
	if shared, ok := v.serviceMaps[key]; ok {
		return shared
	}
	v.serviceMaps[key] = m
	return m
}

// internLabels returns the view's shared copy of an equal label set, with
// interned keys and values.
func (v *view) internLabels(m map[string]string) map[string]string {
	if len(m) == 0 {
		return nil
	}
	var b strings.Builder
	for _, k := range slices.Sorted(maps.Keys(m)) {
		b.WriteString(k)
		b.WriteByte(0)
		b.WriteString(m[k])
		b.WriteByte(0)
	}
	key := b.String()
	if shared, ok := v.labelSets[key]; ok {
		return shared
	}
	shared := internMap(m)
	v.labelSets[key] = shared
	return shared
}

func setOf[V any](m map[model.ServiceKey]V) map[model.ServiceKey]struct{} {
	out := make(map[model.ServiceKey]struct{}, len(m))
	for k := range m {
		out[k] = struct{}{}
	}
	return out
}

func (v *view) endpointOf(w *model.Workload, s *svcInfo, p *podInfo) model.Endpoint {
	return model.Endpoint{
		WorkloadUID: w.UID, Address: w.Addresses[0], Cluster: v.cluster, Network: w.Network, Locality: w.Locality,
		ServiceAccount: w.ServiceAccount, Namespace: w.Namespace, Node: w.Node, Ready: w.Ready, Terminating: w.Terminating,
		Ports: portsFor(s, p),
	}
}

// setWorkload records uid's workload (nil: none) in the delta when it
// changed, and reports whether it did.
func (v *view) setWorkload(uid string, w *model.Workload) bool {
	old, had := v.workloads[uid]
	if w == nil {
		if !had {
			return false
		}
		delete(v.workloads, uid)
	} else {
		if had && workloadEqual(old, w) {
			return false
		}
		v.workloads[uid] = w
	}
	if v.delta.Workloads == nil {
		v.delta.Workloads = map[string]*model.Workload{}
	}
	v.delta.Workloads[uid] = w
	return true
}

// setSliceMember records one endpoint of selector-less service k (nil:
// none) and marks the shard changed when it did.
func (v *view) setSliceMember(k model.ServiceKey, member string, ep *model.Endpoint) {
	sh := v.sliceEPs[k]
	old, had := sh[member]
	switch {
	case ep == nil && !had:
		return
	case ep == nil:
		delete(sh, member)
		if len(sh) == 0 {
			delete(v.sliceEPs, k)
		}
	case had && endpointEqual(&old, ep):
		return
	default:
		if sh == nil {
			sh = map[string]model.Endpoint{}
			v.sliceEPs[k] = sh
		}
		sh[member] = *ep
	}
	v.markShard(k)
}

// setPodMember adds or removes pod name as a member of service k; it
// reports whether membership changed.
func (v *view) setPodMember(k model.ServiceKey, name string, member bool) bool {
	set := v.members[k]
	_, had := set[name]
	switch {
	case member == had:
		return false
	case member:
		if set == nil {
			set = map[string]struct{}{}
			v.members[k] = set
		}
		set[name] = struct{}{}
	default:
		delete(set, name)
		if len(set) == 0 {
			delete(v.members, k)
		}
	}
	return true
}

func (v *view) markShard(k model.ServiceKey) {
	if v.delta.Shards == nil {
		v.delta.Shards = map[model.ServiceKey][]model.Endpoint{}
	}
	v.delta.Shards[k] = nil // filled at flush time
}

// shardSlice renders service k's shard, sorted by address: the endpoints of
// its member pods (derived from their workloads, not stored) and of its
// EndpointSlices.
func (v *view) shardSlice(k model.ServiceKey) []model.Endpoint {
	members, sliceEPs := v.members[k], v.sliceEPs[k]
	s := v.services[k]
	if len(members)+len(sliceEPs) == 0 || s == nil {
		return nil
	}
	out := make([]model.Endpoint, 0, len(members)+len(sliceEPs))
	for name := range members {
		p := v.pods[k.Namespace+"/"+name]
		if p == nil {
			continue
		}
		if w := v.workloads[model.WorkloadUID(v.cluster, p.ns, p.name)]; w != nil {
			out = append(out, v.endpointOf(w, s, p))
		}
	}
	for _, ep := range sliceEPs {
		out = append(out, ep)
	}
	slices.SortFunc(out, func(a, b model.Endpoint) int {
		return cmp.Or(a.Address.Compare(b.Address), cmp.Compare(a.WorkloadUID, b.WorkloadUID))
	})
	return out
}

// finish renders the changed shards and flushes. Called with mu held after
// every store callback.
func (v *view) finish() {
	for k := range v.delta.Shards {
		v.delta.Shards[k] = v.shardSlice(k)
	}
	v.flush()
}

// refreshPod recomputes p's workload and its endpoints in the services of
// extra (services whose selection of p may have changed) and in those that
// select it now.
func (v *view) refreshPod(p *podInfo, extra []*svcInfo) {
	w := v.workloadOf(p)
	changed := v.setWorkload(model.WorkloadUID(v.cluster, p.ns, p.name), w)
	now := map[model.ServiceKey]bool{}
	if w != nil {
		for _, s := range v.servicesSelecting(p) {
			k := s.cs.Key()
			now[k] = true
			if v.setPodMember(k, p.name, true) || changed {
				v.markShard(k)
			}
		}
	}
	for _, s := range extra {
		if k := s.cs.Key(); !now[k] && v.setPodMember(k, p.name, false) {
			v.markShard(k)
		}
	}
}

// ---- store callbacks: called with mu held; the store finishes ----

func (v *view) putPod(p *podInfo) {
	p.labels = v.internLabels(p.labels)
	key := p.key()
	old := v.pods[key]
	if p.equal(old) {
		return
	}
	var before []*svcInfo
	if old != nil {
		before = v.servicesSelecting(old)
		v.unindexPod(old)
	}
	v.pods[key] = p
	addIndex(v.podsByNS, p.ns, p.name, p)
	if p.node != "" {
		addIndex(v.podsByNode, p.node, key, p)
	}
	v.refreshPod(p, before)
}

func (v *view) removePod(key string) {
	old := v.pods[key]
	if old == nil {
		return
	}
	for _, s := range v.servicesSelecting(old) {
		if v.setPodMember(s.cs.Key(), old.name, false) {
			v.markShard(s.cs.Key())
		}
	}
	v.unindexPod(old)
	delete(v.pods, key)
	v.setWorkload(model.WorkloadUID(v.cluster, old.ns, old.name), nil)
}

func (v *view) unindexPod(p *podInfo) {
	delIndex(v.podsByNS, p.ns, p.name)
	if p.node != "" {
		delIndex(v.podsByNode, p.node, p.key())
	}
}

func (v *view) putService(s *svcInfo) {
	k := s.cs.Key()
	if v.exported[k] {
		s.cs.Exported = true
	}
	old := v.services[k]
	if serviceEqual(old, s) {
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
	v.refreshSlices(k)
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

func (v *view) refreshNode(name string) {
	for _, p := range v.podsByNode[name] {
		v.refreshPod(p, nil)
	}
}

// setNamespaceNetwork records the control-plane namespace's network label;
// a change re-derives every pod's network.
func (v *view) setNamespaceNetwork(n model.Network) {
	if v.nsNetwork == n {
		return
	}
	v.nsNetwork = n
	for _, p := range v.pods {
		v.refreshPod(p, nil)
	}
	for k := range v.slicesBy {
		v.refreshSlices(k)
	}
}

func (v *view) setExported(k model.ServiceKey, exported bool) {
	if v.exported[k] == exported {
		return
	}
	if exported {
		v.exported[k] = true
	} else {
		delete(v.exported, k)
	}
	if s := v.services[k]; s != nil {
		cs := *s.cs
		cs.Exported = exported
		v.services[k] = &svcInfo{cs: &cs, selector: s.selector, gateway: s.gateway}
		v.setServiceDelta(k, &cs)
	}
}

func (v *view) putSlice(s *sliceInfo) {
	key := s.ns + "/" + s.name
	old := v.slices[key]
	if s.equal(old) {
		return
	}
	if old != nil && old.service != s.service {
		v.dropSlice(key, old)
	}
	v.slices[key] = s
	if s.service != "" {
		k := model.ServiceKey{Namespace: s.ns, Name: s.service}
		if v.slicesBy[k] == nil {
			v.slicesBy[k] = map[string]*sliceInfo{}
		}
		v.slicesBy[k][s.name] = s
		v.refreshSlices(k)
	}
}

func (v *view) removeSlice(key string) {
	if old := v.slices[key]; old != nil {
		v.dropSlice(key, old)
	}
}

func (v *view) dropSlice(key string, old *sliceInfo) {
	delete(v.slices, key)
	if old.service == "" {
		return
	}
	k := model.ServiceKey{Namespace: old.ns, Name: old.service}
	delete(v.slicesBy[k], old.name)
	if len(v.slicesBy[k]) == 0 {
		delete(v.slicesBy, k)
	}
	v.refreshSlices(k)
}

// refreshSlices recomputes the endpoints of selector-less service k from its
// EndpointSlices (services with a selector take endpoints from pods). An
// address that names no known pod becomes a workload of its own.
func (v *view) refreshSlices(k model.ServiceKey) {
	s := v.services[k]
	want := map[string]model.Endpoint{}
	wantWL := map[string]*model.Workload{}
	if s != nil && s.selector == nil {
		for _, sl := range v.slicesBy[k] {
			ports := slicePorts(s, sl)
			for _, se := range sl.endpoints {
				ep := model.Endpoint{Address: se.addr, Cluster: v.cluster, Network: v.nsNetworkOr(), Namespace: k.Namespace,
					Node: se.node, Locality: v.nodes[se.node], Ready: se.ready, Terminating: se.terminating, Ports: ports, ServiceAccount: "default"}
				if p := v.pods[k.Namespace+"/"+se.pod]; se.pod != "" && p != nil {
					ep.WorkloadUID = model.WorkloadUID(v.cluster, p.ns, p.name)
					ep.ServiceAccount, ep.Network = p.sa, v.networkOf(p)
				} else {
					ep.WorkloadUID = model.WorkloadUID(v.cluster, k.Namespace, "endpointslice."+k.Name+"."+se.addr.String())
					wantWL[ep.WorkloadUID] = &model.Workload{
						UID: ep.WorkloadUID, Name: se.addr.String(), Namespace: k.Namespace, Addresses: []netip.Addr{se.addr},
						ServiceAccount: ep.ServiceAccount, Node: se.node, Cluster: v.cluster, Network: ep.Network, Locality: ep.Locality,
						Ready: se.ready, Terminating: se.terminating,
						Services: v.internServices(map[string][]model.PortMapping{v.hostname(k): ports}),
					}
				}
				want[se.addr.String()] = ep
			}
		}
	}
	for member := range v.sliceEPs[k] {
		if _, ok := want[member]; !ok {
			v.setSliceMember(k, member, nil)
		}
	}
	for member, ep := range want {
		v.setSliceMember(k, member, &ep)
	}
	for uid := range v.sliceWLs[k] {
		if wantWL[uid] == nil {
			v.setWorkload(uid, nil)
		}
	}
	if len(wantWL) == 0 {
		delete(v.sliceWLs, k)
	} else {
		v.sliceWLs[k] = map[string]bool{}
		for uid, w := range wantWL {
			v.sliceWLs[k][uid] = true
			v.setWorkload(uid, w)
		}
	}
}

func (v *view) nsNetworkOr() model.Network {
	if v.nsNetwork != "" {
		return v.nsNetwork
	}
	return v.defaultNetwork
}

// slicePorts maps service ports to a slice's ports by name.
func slicePorts(s *svcInfo, sl *sliceInfo) []model.PortMapping {
	var out []model.PortMapping
	for _, sp := range s.cs.Ports {
		for _, p := range sl.ports {
			if p.name == sp.Name {
				out = append(out, model.PortMapping{ServicePort: sp.Port, TargetPort: p.port})
				break
			}
		}
	}
	return out
}

func (v *view) gatewaysChanged() {
	v.delta.GatewaysChanged = true
	v.delta.Gateways = v.gatewayList()
}

func (v *view) gatewayList() []model.NetworkGateway {
	var out []model.NetworkGateway
	for _, s := range v.services {
		if s.gateway != nil {
			out = append(out, *s.gateway)
		}
	}
	slices.SortFunc(out, func(a, b model.NetworkGateway) int { return cmp.Compare(a.Key(), b.Key()) })
	return out
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

func workloadEqual(a, b *model.Workload) bool {
	if len(a.Services) != len(b.Services) {
		return false
	}
	for h, pm := range a.Services {
		if !slices.Equal(pm, b.Services[h]) {
			return false
		}
	}
	return a.UID == b.UID && a.Name == b.Name && a.Namespace == b.Namespace && slices.Equal(a.Addresses, b.Addresses) &&
		a.ServiceAccount == b.ServiceAccount && a.Node == b.Node && a.Cluster == b.Cluster && a.Network == b.Network &&
		a.Locality == b.Locality && maps.Equal(a.Labels, b.Labels) && a.Ready == b.Ready && a.Terminating == b.Terminating
}

func endpointEqual(a, b *model.Endpoint) bool {
	return a.WorkloadUID == b.WorkloadUID && a.Address == b.Address && a.Cluster == b.Cluster && a.Network == b.Network &&
		a.Locality == b.Locality && a.ServiceAccount == b.ServiceAccount && a.Namespace == b.Namespace && a.Node == b.Node &&
		a.Ready == b.Ready && a.Terminating == b.Terminating && slices.Equal(a.Ports, b.Ports)
}
