package registry

import (
	"cmp"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// One owner per address per network.
//
// Every pod (but hostNetwork ones, which share their node's address and own
// none) and every workload made from an EndpointSlice address claims its
// addresses on its network, in whatever cluster it runs. When claims
// collide, one owner is chosen by model.Outranks: a pod beats a slice
// address, then the oldest claim, then the smallest UID. Only owners are
// served as workloads (OwnsAddresses); when an owner goes, the next claim
// becomes the owner and is announced. A slice address whose owner is a pod
// of another namespace is also dropped from its service's endpoints: a
// slice may not claim another namespace's pod. A slice address naming its
// owner by targetRef (model.Workload.NamesPod) is that pod's own endpoint,
// not a conflict.

// Reasons a claim loses an address, the label values of the conflicts
// metric.
const (
	// ReasonDuplicatePod: another pod owns the address.
	ReasonDuplicatePod = "duplicate-pod"
	// ReasonPodAddress: a pod of the slice's namespace owns the address.
	ReasonPodAddress = "pod-address"
	// ReasonOtherNamespace: a pod of another namespace owns the address;
	// the slice address is dropped from its service's endpoints.
	ReasonOtherNamespace = "other-namespace"
	// ReasonDuplicateSlice: another slice address owns it.
	ReasonDuplicateSlice = "duplicate-slice"
)

var reasons = []string{ReasonDuplicatePod, ReasonPodAddress, ReasonOtherNamespace, ReasonDuplicateSlice}

// reasonOf says why loser's claim loses to owner's ("": it does not conflict).
func reasonOf(owner, loser *model.Workload) string {
	switch {
	case !loser.FromSlice:
		return ReasonDuplicatePod
	case owner.FromSlice:
		return ReasonDuplicateSlice
	case loser.NamesPod(owner):
		return ""
	case owner.Namespace != loser.Namespace:
		return ReasonOtherNamespace
	default:
		return ReasonPodAddress
	}
}

// addrKey is an address as a map key: 16 bytes, IPv4 unmapped first so
// that ::ffff:a.b.c.d and a.b.c.d are one address.
type addrKey [16]byte

func keyOf(a netip.Addr) addrKey { return a.Unmap().As16() }

// v4 returns the IPv4 address of k as a number, and whether it is one.
func (k addrKey) v4() (uint32, bool) {
	a := netip.AddrFrom16(k).Unmap()
	if !a.Is4() {
		return 0, false
	}
	b := a.As4()
	return uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3]), true
}

// ownerMap is the owner of each claimed address of one network. IPv4
// addresses, most of them, are keyed by four bytes: a 16-byte slot per
// address instead of 24.
type ownerMap struct {
	v4 map[uint32]*model.Workload
	v6 map[addrKey]*model.Workload
}

func (m *ownerMap) get(k addrKey) *model.Workload {
	if m == nil {
		return nil
	}
	if n, ok := k.v4(); ok {
		return m.v4[n]
	}
	return m.v6[k]
}

func (m *ownerMap) set(k addrKey, w *model.Workload) {
	if n, ok := k.v4(); ok {
		if m.v4 == nil {
			m.v4 = map[uint32]*model.Workload{}
		}
		m.v4[n] = w
		return
	}
	if m.v6 == nil {
		m.v6 = map[addrKey]*model.Workload{}
	}
	m.v6[k] = w
}

func (m *ownerMap) del(k addrKey) {
	if n, ok := k.v4(); ok {
		delete(m.v4, n)
	} else {
		delete(m.v6, k)
	}
}

func (m *ownerMap) empty() bool { return len(m.v4) == 0 && len(m.v6) == 0 }

type netAddr struct {
	net  model.Network
	addr addrKey
}

// addressBook tracks every claim on an address and its owner. It is used
// under the registry's lock. An address with one claim costs one entry of
// owners (16 bytes for IPv4, 24 for IPv6, and the map's overhead); only
// contested ones cost more.
type addressBook struct {
	owners    map[model.Network]*ownerMap
	contested map[netAddr][]*model.Workload // two claims or more, owner first
	// dropped are the slice addresses owned by another namespace's pod,
	// by service, then UID.
	dropped   map[model.ServiceKey]map[string]struct{}
	conflicts map[string]int // losing claims by reason
	gauge     *prometheus.GaugeVec
	log       *slog.Logger
}

// effects are what claim changes require of the registry: workloads whose
// ownership changed (to announce) and services whose dropped endpoints
// changed (to rebuild).
type effects struct {
	owners   map[string]struct{}
	services map[model.ServiceKey]struct{}
}

func (fx *effects) owner(uid string) {
	if fx.owners == nil {
		fx.owners = map[string]struct{}{}
	}
	fx.owners[uid] = struct{}{}
}

func (fx *effects) service(k model.ServiceKey) {
	if fx.services == nil {
		fx.services = map[model.ServiceKey]struct{}{}
	}
	fx.services[k] = struct{}{}
}

func newAddressBook(reg prometheus.Registerer, log *slog.Logger) *addressBook {
	b := &addressBook{
		owners: map[model.Network]*ownerMap{}, contested: map[netAddr][]*model.Workload{},
		dropped: map[model.ServiceKey]map[string]struct{}{}, conflicts: map[string]int{}, log: log,
		gauge: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "isthmus_registry_address_conflicts",
			Help: "Claims on an address (per network) that lose to another workload's, by reason.",
		}, []string{"reason"}),
	}
	for _, r := range reasons {
		b.gauge.WithLabelValues(r).Set(0)
	}
	if reg != nil {
		reg.MustRegister(b.gauge)
	}
	return b
}

// claimsOf lists the addresses w claims (none for nil or hostNetwork).
func claimsOf(w *model.Workload) []netAddr {
	if w == nil || !w.ClaimsAddresses() {
		return nil
	}
	out := make([]netAddr, 0, len(w.Addresses))
	for _, a := range w.Addresses {
		if k := (netAddr{w.Network, keyOf(a)}); !slices.Contains(out, k) {
			out = append(out, k)
		}
	}
	return out
}

// claimState is one claim's standing on an address.
type claimState struct {
	w      *model.Workload
	owner  bool
	reason string
}

// standing returns every claim on k with its standing, owner first.
func (b *addressBook) standing(k netAddr) []claimState {
	if list := b.contested[k]; list != nil {
		out := make([]claimState, len(list))
		for i, w := range list {
			out[i] = claimState{w: w, owner: i == 0}
			if i > 0 {
				out[i].reason = reasonOf(list[0], w)
			}
		}
		return out
	}
	if w := b.owners[k.net].get(k.addr); w != nil {
		return []claimState{{w: w, owner: true}}
	}
	return nil
}

// update replaces the claims of old (nil: none) by those of w (nil: none),
// recording in fx what that changes for other workloads and services.
func (b *addressBook) update(old, w *model.Workload, fx *effects) {
	was, is := claimsOf(old), claimsOf(w)
	if len(was) == 0 && len(is) == 0 {
		return
	}
	keys := slices.Clone(was)
	for _, k := range is {
		if !slices.Contains(keys, k) {
			keys = append(keys, k)
		}
	}
	before := make([][]claimState, len(keys))
	for i, k := range keys {
		before[i] = b.standing(k)
	}
	for _, k := range was {
		b.remove(old, k)
	}
	for _, k := range is {
		b.add(w, k)
	}
	for i, k := range keys {
		b.compare(k, before[i], b.standing(k), fx)
	}
}

func (b *addressBook) add(w *model.Workload, k netAddr) {
	m := b.owners[k.net]
	if m == nil {
		m = &ownerMap{}
		b.owners[k.net] = m
	}
	cur := m.get(k.addr)
	if cur == nil {
		m.set(k.addr, w)
		return
	}
	list := b.contested[k]
	if list == nil {
		list = []*model.Workload{cur}
	}
	i, _ := slices.BinarySearchFunc(list, w, func(x, y *model.Workload) int {
		if model.Outranks(x, y) {
			return -1
		}
		return 1
	})
	list = slices.Insert(list, i, w)
	b.contested[k] = list
	m.set(k.addr, list[0])
}

func (b *addressBook) remove(w *model.Workload, k netAddr) {
	m := b.owners[k.net]
	list := b.contested[k]
	if list == nil {
		if cur := m.get(k.addr); cur != nil && cur.UID == w.UID {
			m.del(k.addr)
			if m.empty() {
				delete(b.owners, k.net)
			}
		}
		return
	}
	list = slices.DeleteFunc(list, func(x *model.Workload) bool { return x.UID == w.UID })
	if len(list) == 1 {
		delete(b.contested, k)
	} else {
		b.contested[k] = list
	}
	m.set(k.addr, list[0])
}

// compare accounts for the change of k's claims from before to after:
// ownership changes, dropped slice addresses, conflict counts and logs.
func (b *addressBook) compare(k netAddr, before, after []claimState, fx *effects) {
	find := func(list []claimState, uid string) (claimState, bool) {
		for _, c := range list {
			if c.w.UID == uid {
				return c, true
			}
		}
		return claimState{}, false
	}
	for _, c := range before {
		if c.reason != "" {
			b.count(c.reason, -1)
		}
		now, ok := find(after, c.w.UID)
		if !ok || now.owner != c.owner {
			fx.owner(c.w.UID)
		}
		if c.reason == ReasonOtherNamespace && now.reason != ReasonOtherNamespace {
			b.drop(c.w, false, fx)
		}
	}
	for _, c := range after {
		if c.reason != "" {
			b.count(c.reason, +1)
		}
		prev, ok := find(before, c.w.UID)
		if !ok || prev.owner != c.owner {
			fx.owner(c.w.UID)
		}
		if c.reason == ReasonOtherNamespace && prev.reason != ReasonOtherNamespace {
			b.drop(c.w, true, fx)
		}
		if c.reason != "" && prev.reason != c.reason {
			b.log.Warn("address claimed by several workloads; only the owner is served",
				"network", k.net, "address", netip.AddrFrom16(k.addr).Unmap(), "owner", after[0].w.UID, "loser", c.w.UID, "reason", c.reason)
		}
	}
}

func (b *addressBook) count(reason string, d int) {
	b.conflicts[reason] += d
	b.gauge.WithLabelValues(reason).Set(float64(b.conflicts[reason]))
}

// drop marks slice address w dropped from its service's endpoints (or no
// longer), noting the service when that changes.
func (b *addressBook) drop(w *model.Workload, dropped bool, fx *effects) {
	k, ok := model.SliceWorkloadService(w.UID)
	if !ok {
		return
	}
	set := b.dropped[k]
	_, was := set[w.UID]
	switch {
	case dropped && !was:
		if set == nil {
			set = map[string]struct{}{}
			b.dropped[k] = set
		}
		set[w.UID] = struct{}{}
	case !dropped && was:
		delete(set, w.UID)
		if len(set) == 0 {
			delete(b.dropped, k)
		}
	default:
		return
	}
	fx.service(k)
}

// owns reports whether w owns every address it claims (false for a
// workload that claims none).
func (b *addressBook) owns(w *model.Workload) bool {
	if !w.ClaimsAddresses() || len(w.Addresses) == 0 {
		return false
	}
	m := b.owners[w.Network]
	for _, a := range w.Addresses {
		if o := m.get(keyOf(a)); o == nil || o.UID != w.UID {
			return false
		}
	}
	return true
}

// withoutDropped returns the endpoints of shard not dropped from service k.
func (b *addressBook) withoutDropped(k model.ServiceKey, shard []model.Endpoint) []model.Endpoint {
	set := b.dropped[k]
	if len(set) == 0 {
		return shard
	}
	out := make([]model.Endpoint, 0, len(shard))
	for _, e := range shard {
		if _, drop := set[e.Workload.UID]; !drop {
			out = append(out, e)
		}
	}
	return out
}

// AddressConflict is the debug view of one address with competing claims.
type AddressConflict struct {
	Network model.Network `json:"network"`
	Address string        `json:"address"`
	// Owner is the UID of the workload served for the address.
	Owner string `json:"owner"`
	// Losers are the other claims with why they lose; a slice address
	// naming the owner by targetRef is not listed.
	Losers []AddressLoser `json:"losers"`
}

// AddressLoser is one losing claim on an address.
type AddressLoser struct {
	Workload string `json:"workload"`
	Reason   string `json:"reason"`
	// Dropped: the address is left out of its service's endpoints too.
	Dropped bool `json:"dropped,omitempty"`
}

// AddressConflicts returns every address claimed by several workloads that
// conflict, sorted by network and address.
func (r *Registry) AddressConflicts() []AddressConflict {
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := []AddressConflict{}
	for k := range r.book.contested {
		st := r.book.standing(k)
		c := AddressConflict{Network: k.net, Address: netip.AddrFrom16(k.addr).Unmap().String(), Owner: st[0].w.UID}
		for _, l := range st[1:] {
			if l.reason != "" {
				c.Losers = append(c.Losers, AddressLoser{Workload: l.w.UID, Reason: l.reason, Dropped: l.reason == ReasonOtherNamespace})
			}
		}
		if len(c.Losers) > 0 {
			out = append(out, c)
		}
	}
	slices.SortFunc(out, func(a, b AddressConflict) int {
		return cmp.Or(cmp.Compare(a.Network, b.Network), strings.Compare(a.Address, b.Address))
	})
	return out
}

// ConflictCounts returns the number of losing claims by reason.
func (r *Registry) ConflictCounts() map[string]int {
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := maps.Clone(r.book.conflicts)
	maps.DeleteFunc(out, func(_ string, n int) bool { return n == 0 })
	return out
}

// OwnsAddresses reports whether workload uid owns every address it claims
// on its network, so that it may be served as the workload of those
// addresses. False for hostNetwork pods (they own no address), for a
// workload that lost an address to another claim, and for an unknown uid.
func (r *Registry) OwnsAddresses(uid string) bool {
	r.mu.RLock()
	defer r.mu.RUnlock()
	w := r.workloadLocked(uid)
	return w != nil && r.book.owns(w)
}
