package controller

import (
	"cmp"
	"maps"
	"net/netip"
	"slices"
	"strings"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// The endpoints of a selector-less service come from its EndpointSlices,
// by one rule whatever the order of events (docs/architecture.md, "Slice
// addresses"):
//
//   - Every address is an endpoint of its own: a workload made from it
//     (model.Workload.FromSlice), whose readiness is the slice's conditions,
//     as Kubernetes' data plane reads them.
//   - When the address's targetRef names a pod of the slice's namespace that
//     has this address (and is no hostNetwork pod), that pod supplies the
//     identity and placement: name, network, node, service account and
//     locality. The pod's own workload is bound to the service too (with the
//     pod's readiness), since ztunnels find a service's endpoints through
//     workload bindings and keep one workload per address.
//   - Otherwise, and as soon as the named pod goes or loses the address, the
//     address stands alone: the slice's node and locality, the namespace's
//     default service account, the cluster's network.
//
// Slice addresses are indexed by the pod they name (view.podRefs), so a
// pod's change rebuilds exactly those endpoints and a slice's change the
// bindings of exactly the pods it names or named.

// sliceRef is one address of a slice: the slice and its index in it.
type sliceRef struct {
	sl *sliceInfo
	i  int
}

func (v *view) putSlice(s *sliceInfo) {
	key := s.ns + "/" + s.name
	old := v.slices[key]
	if s.equal(old) {
		return
	}
	if old != nil {
		v.unlinkSlice(key, old)
		if old.service != s.service {
			v.refreshSlices(model.ServiceKey{Namespace: old.ns, Name: old.service})
		}
	}
	v.slices[key] = s
	v.indexRefs(s, true)
	if s.service != "" {
		k := model.ServiceKey{Namespace: s.ns, Name: s.service}
		if v.slicesBy[k] == nil {
			v.slicesBy[k] = map[string]*sliceInfo{}
		}
		v.slicesBy[k][s.name] = s
		v.refreshSlices(k)
	}
	v.refreshBindings(old, s)
}

func (v *view) removeSlice(key string) {
	old := v.slices[key]
	if old == nil {
		return
	}
	v.unlinkSlice(key, old)
	v.refreshSlices(model.ServiceKey{Namespace: old.ns, Name: old.service})
	v.refreshBindings(old, nil)
}

// unlinkSlice forgets slice old (stored under key) in every index.
func (v *view) unlinkSlice(key string, old *sliceInfo) {
	delete(v.slices, key)
	v.indexRefs(old, false)
	if old.service == "" {
		return
	}
	k := model.ServiceKey{Namespace: old.ns, Name: old.service}
	delete(v.slicesBy[k], old.name)
	if len(v.slicesBy[k]) == 0 {
		delete(v.slicesBy, k)
	}
}

// indexRefs adds s's addresses that name a pod to podRefs, or removes them.
func (v *view) indexRefs(s *sliceInfo, add bool) {
	var named []string
	for i := range s.endpoints {
		pod := s.endpoints[i].pod()
		switch {
		case pod == "":
		case add:
			addIndex(v.podRefs, s.ns, pod, append(v.podRefs[s.ns][pod], sliceRef{s, i}))
		case !slices.Contains(named, pod):
			named = append(named, pod)
		}
	}
	for _, pod := range named {
		refs := slices.DeleteFunc(v.podRefs[s.ns][pod], func(r sliceRef) bool { return r.sl == s })
		if len(refs) == 0 {
			delIndex(v.podRefs, s.ns, pod)
		} else {
			v.podRefs[s.ns][pod] = refs
		}
	}
}

// refreshBindings re-derives the pods whose bindings slice old's change to
// cur (either nil: added, removed) may change: those either names.
func (v *view) refreshBindings(old, cur *sliceInfo) {
	if !old.namesPods() && !cur.namesPods() {
		return
	}
	before, after := namedAddrs(old), namedAddrs(cur)
	same := old != nil && cur != nil && old.service == cur.service && slices.Equal(old.ports, cur.ports)
	ns := cmp.Or(old, cur).ns
	for _, pod := range slices.Sorted(maps.Keys(mergeKeys(before, after))) {
		if same && slices.Equal(before[pod], after[pod]) {
			continue
		}
		if p := v.podsByNS[ns][pod]; p != nil {
			v.refreshPod(p, nil)
		}
	}
}

// namedAddrs returns the addresses of s per pod they name.
func namedAddrs(s *sliceInfo) map[string][]netip.Addr {
	if s == nil {
		return nil
	}
	out := map[string][]netip.Addr{}
	for i := range s.endpoints {
		if pod := s.endpoints[i].pod(); pod != "" {
			out[pod] = append(out[pod], s.endpoints[i].addr)
		}
	}
	return out
}

func mergeKeys[V any](a, b map[string]V) map[string]struct{} {
	out := make(map[string]struct{}, len(a)+len(b))
	for k := range a {
		out[k] = struct{}{}
	}
	for k := range b {
		out[k] = struct{}{}
	}
	return out
}

// boundPod returns the pod address se of a slice in namespace ns is bound
// to: the pod its targetRef names, when that pod has the address and is no
// hostNetwork pod (those own no address); nil otherwise.
func (v *view) boundPod(ns string, se *sliceEndpoint) *podInfo {
	name := se.pod()
	if name == "" {
		return nil
	}
	p := v.podsByNS[ns][name]
	if p == nil || p.hostNetwork || !slices.Contains(p.ips, se.addr) {
		return nil
	}
	return p
}

// sliceBindings adds to svcs the selector-less services whose slices name
// p at one of its addresses, mapped by the ports of the first such slice
// by name.
func (v *view) sliceBindings(p *podInfo, svcs map[string][]model.PortMapping) map[string][]model.PortMapping {
	refs := v.podRefs[p.ns][p.name]
	if len(refs) == 0 || p.hostNetwork {
		return svcs
	}
	first := map[model.ServiceKey]*sliceInfo{}
	for _, r := range refs {
		k := model.ServiceKey{Namespace: p.ns, Name: r.sl.service}
		if s := v.services[k]; s == nil || s.selector != nil || !slices.Contains(p.ips, r.sl.endpoints[r.i].addr) {
			continue
		}
		if f := first[k]; f == nil || r.sl.name < f.name {
			first[k] = r.sl
		}
	}
	for k, sl := range first {
		if svcs == nil {
			svcs = map[string][]model.PortMapping{}
		}
		svcs[v.hostname(k)] = v.internPorts(slicePorts(v.services[k], sl))
	}
	return svcs
}

// podsNamedBy returns the pods the slices of service k name.
func (v *view) podsNamedBy(k model.ServiceKey) []*podInfo {
	var out []*podInfo
	for _, name := range slices.Sorted(maps.Keys(v.slicesBy[k])) {
		sl := v.slicesBy[k][name]
		for i := range sl.endpoints {
			if p := v.podsByNS[k.Namespace][sl.endpoints[i].pod()]; p != nil && !slices.Contains(out, p) {
				out = append(out, p)
			}
		}
	}
	return out
}

// sliceBuild is what building the workloads of one service's slice
// addresses shares.
type sliceBuild struct {
	k      model.ServiceKey
	prefix string
	places map[string]*model.Placement // of addresses naming no pod, by node
}

func (v *view) newSliceBuild(k model.ServiceKey) *sliceBuild {
	return &sliceBuild{k: k, prefix: model.SliceWorkloadPrefix(v.cluster, k), places: map[string]*model.Placement{}}
}

// sliceWorkload returns the workload of address se of slice sl, bound to
// services: prev, when that is its value already.
func (v *view) sliceWorkload(b *sliceBuild, sl *sliceInfo, se *sliceEndpoint, services map[string][]model.PortMapping, prev *model.Workload) *model.Workload {
	var pl *model.Placement
	name := "" // the address's own (the UID's suffix) unless bound
	if p := v.boundPod(b.k.Namespace, se); p != nil {
		// A pod with an address always has its workload.
		if pw := v.workloads[model.WorkloadUID(v.cluster, p.ns, p.name)]; pw != nil {
			pl, name = pw.Placement, p.name
		}
	}
	if pl == nil {
		if pl = b.places[se.node()]; pl == nil {
			pl = v.placer.Place(model.Placement{Cluster: v.cluster, Network: v.nsNetworkOr(), Node: se.node(),
				Namespace: b.k.Namespace, ServiceAccount: "default", Locality: v.nodes[se.node()]})
			b.places[se.node()] = pl
		}
	}
	if prev != nil && prev.Placement == pl && prev.Ready == se.ready && prev.Terminating == se.terminating &&
		prev.Created == sl.created && prev.Name == cmp.Or(name, prev.UID[len(b.prefix):]) && prev.SliceOfPod == (name != "") &&
		sameServices(prev.Services, services) {
		return prev
	}
	uid := b.prefix + se.addr.String()
	return &model.Workload{
		UID: uid, Name: cmp.Or(name, uid[len(b.prefix):]), Addresses: []netip.Addr{se.addr}, Placement: pl,
		Ready: se.ready, Terminating: se.terminating, Services: services, FromSlice: true, SliceOfPod: name != "", Created: sl.created,
	}
}

// refreshNamed rebuilds the slice addresses that name pod ns/name, after
// the pod came, changed or went, and nothing else: an address listed more
// than once in its service's slices (as while one slice replaces another)
// rebuilds that service's endpoints whole, since which listing stands
// depends on all of them.
func (v *view) refreshNamed(ns, name string) {
	var whole map[model.ServiceKey]bool
	for _, r := range v.podRefs[ns][name] {
		k := model.ServiceKey{Namespace: ns, Name: r.sl.service}
		if s := v.services[k]; s == nil || s.selector != nil {
			continue // its endpoints are not the slices'
		}
		se := &r.sl.endpoints[r.i]
		b := v.newSliceBuild(k)
		uid := b.prefix + se.addr.String()
		sh := v.shards[k]
		var i int
		found := false
		if sh != nil {
			i, found = sh.find(uid)
		}
		if !found || sh.dup(se.addr) {
			if whole == nil {
				whole = map[model.ServiceKey]bool{}
			}
			whole[k] = true
			continue
		}
		e := sh.eps[i]
		if w := v.sliceWorkload(b, r.sl, se, e.Workload.Services, e.Workload); w != e.Workload {
			v.setEndpoint(k, uid, &model.Endpoint{Workload: w, Ports: e.Ports})
			v.noteWorkload(uid, w)
		}
	}
	for _, k := range slices.SortedFunc(maps.Keys(whole), func(a, b model.ServiceKey) int { return strings.Compare(a.Name, b.Name) }) {
		v.refreshSlices(k)
	}
}

// refreshSlices recomputes the endpoints of selector-less service k from its
// EndpointSlices (services with a selector take endpoints from pods; for
// them it only withdraws what slices contributed before). An unchanged
// address keeps its workload value, so a slice update costs changes only
// for the addresses that changed.
func (v *view) refreshSlices(k model.ServiceKey) {
	s := v.services[k]
	sh := v.shards[k]
	bySlices := s != nil && s.selector == nil
	if !bySlices && (sh == nil || !sh.fromSlices) {
		return
	}
	var old []model.Endpoint
	if sh != nil {
		old = sh.eps
	}
	var eps []model.Endpoint
	var dups map[netip.Addr]struct{}
	if bySlices {
		eps, dups = v.sliceEndpoints(k, s, old)
	}
	// Workload changes: made workloads that went, came or changed.
	for i := range old {
		if w := old[i].Workload; w.FromSlice {
			if _, ok := model.FindEndpoint(eps, w.UID); !ok {
				v.noteWorkload(w.UID, nil)
			}
		}
	}
	for i := range eps {
		if w := eps[i].Workload; w.FromSlice {
			if j, ok := model.FindEndpoint(old, w.UID); !ok || old[j].Workload != w {
				v.noteWorkload(w.UID, w)
			}
		}
	}
	if slices.EqualFunc(old, eps, func(a, b model.Endpoint) bool {
		return a.Workload == b.Workload && slices.Equal(a.Ports, b.Ports)
	}) {
		if sh != nil {
			sh.fromSlices, sh.dups = bySlices, dups
		}
		return
	}
	if len(eps) == 0 {
		delete(v.shards, k)
	} else {
		v.shards[k] = &shard{eps: slices.Clip(eps), fromSlices: true, dups: dups}
	}
	v.markShard(k)
}

// sliceEndpoints builds service s's endpoints from its slices, sorted by
// workload UID, reusing the workloads of old whose value is unchanged; dups
// are the addresses listed more than once.
func (v *view) sliceEndpoints(k model.ServiceKey, s *svcInfo, old []model.Endpoint) ([]model.Endpoint, map[netip.Addr]struct{}) {
	// The workloads made from addresses, by address, to keep unchanged ones.
	made := make(map[netip.Addr]*model.Workload, len(old))
	for _, e := range old {
		if e.Workload.FromSlice {
			made[e.Workload.Addresses[0]] = e.Workload
		}
	}
	n := 0
	for _, sl := range v.slicesBy[k] {
		n += len(sl.endpoints)
	}
	eps := make([]model.Endpoint, 0, n) // exact but for duplicates: kept as the shard
	host := v.hostname(k)
	b := v.newSliceBuild(k)
	for _, name := range slices.Sorted(maps.Keys(v.slicesBy[k])) {
		sl := v.slicesBy[k][name]
		ports := v.internPorts(slicePorts(s, sl))
		services := v.internServices(map[string][]model.PortMapping{host: ports})
		for i := range sl.endpoints {
			se := &sl.endpoints[i]
			eps = append(eps, model.Endpoint{Workload: v.sliceWorkload(b, sl, se, services, made[se.addr]), Ports: ports})
		}
	}
	slices.SortStableFunc(eps, func(a, b model.Endpoint) int { return strings.Compare(a.Workload.UID, b.Workload.UID) })
	// An address in two slices (as while one replaces another) is one
	// endpoint: a ready one if any, else the first slice's by name, so
	// the choice does not flap between refreshes.
	var dups map[netip.Addr]struct{}
	out := eps[:0]
	for _, e := range eps {
		if n := len(out); n > 0 && out[n-1].Workload.UID == e.Workload.UID {
			if dups == nil {
				dups = map[netip.Addr]struct{}{}
			}
			dups[e.Address()] = struct{}{}
			if !out[n-1].Workload.Ready && e.Workload.Ready {
				out[n-1] = e
			}
			continue
		}
		out = append(out, e)
	}
	return out, dups
}

// sameServices reports whether two services maps are equal.
func sameServices(a, b map[string][]model.PortMapping) bool {
	return maps.EqualFunc(a, b, slices.Equal[[]model.PortMapping])
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
