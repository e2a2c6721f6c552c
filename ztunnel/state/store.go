package state

import (
	"cmp"
	"context"
	"maps"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
)

// Snapshot is an immutable, indexed view of the mesh. All methods are safe
// for concurrent use; returned values must not be modified.
type Snapshot struct {
	version   uint64
	workloads map[string]*Workload // by UID
	// byAddr holds the owner of each address. Pilot sends one workload per
	// address and network; should two claim one anyway, contested lists
	// every claimant (sorted by UID; the first owns the address), so that
	// removing one never drops the other's entry. hostNetwork workloads
	// share their node's address and claim none.
	byAddr    map[netip.Addr]*Workload
	contested map[netip.Addr][]*Workload
	services  map[string]*Service // by key <ns>/<hostname>
	byVIP     map[netip.Addr]*Service
	byHost    map[string]*Service
	endpoints map[string][]*Workload // service key -> backing workloads, by UID
	// clusters and networks count the workloads naming each: the clusters
	// and networks the mesh knows, the only values metrics may carry.
	clusters map[string]int
	networks map[string]int
	stale    chan struct{}
}

func emptySnapshot() *Snapshot {
	return &Snapshot{
		workloads: map[string]*Workload{},
		byAddr:    map[netip.Addr]*Workload{},
		contested: map[netip.Addr][]*Workload{},
		services:  map[string]*Service{},
		byVIP:     map[netip.Addr]*Service{},
		byHost:    map[string]*Service{},
		endpoints: map[string][]*Workload{},
		clusters:  map[string]int{},
		networks:  map[string]int{},
		stale:     make(chan struct{}),
	}
}

// Version increases by one with every applied update.
func (s *Snapshot) Version() uint64 { return s.version }

// Stale returns a channel closed when a newer snapshot replaces s.
func (s *Snapshot) Stale() <-chan struct{} { return s.stale }

// Workload returns the workload with uid.
func (s *Snapshot) Workload(uid string) (*Workload, bool) {
	w, ok := s.workloads[uid]
	return w, ok
}

// WorkloadByAddr returns the workload owning addr. Addresses are unique in a
// node's view: remote networks are represented by synthetic workloads, and
// hostNetwork workloads own no address.
func (s *Snapshot) WorkloadByAddr(addr netip.Addr) (*Workload, bool) {
	w, ok := s.byAddr[addr.Unmap()]
	return w, ok
}

// Contested returns, for each address more than one workload claims, the
// claimants' UIDs (the owner first).
func (s *Snapshot) Contested() map[netip.Addr][]string {
	out := make(map[netip.Addr][]string, len(s.contested))
	for a, ws := range s.contested {
		for _, w := range ws {
			out[a] = append(out[a], w.UID)
		}
	}
	return out
}

// KnownCluster reports whether some workload runs in cluster.
func (s *Snapshot) KnownCluster(cluster string) bool { return s.clusters[cluster] > 0 }

// KnownNetwork reports whether some workload is on network.
func (s *Snapshot) KnownNetwork(network string) bool { return s.networks[network] > 0 }

// ServiceByVIP returns the service with virtual IP vip.
func (s *Snapshot) ServiceByVIP(vip netip.Addr) (*Service, bool) {
	svc, ok := s.byVIP[vip.Unmap()]
	return svc, ok
}

// ServiceByHostname returns the service with hostname host.
func (s *Snapshot) ServiceByHostname(host string) (*Service, bool) {
	svc, ok := s.byHost[host]
	return svc, ok
}

// Endpoints returns the workloads backing the service with key svcKey,
// sorted by UID.
func (s *Snapshot) Endpoints(svcKey string) []*Workload { return s.endpoints[svcKey] }

// Workloads returns all workloads sorted by UID.
func (s *Snapshot) Workloads() []*Workload {
	return sortedValues(s.workloads, func(a, b *Workload) int { return cmp.Compare(a.UID, b.UID) })
}

// Services returns all services sorted by key.
func (s *Snapshot) Services() []*Service {
	return sortedValues(s.services, func(a, b *Service) int { return cmp.Compare(a.Key(), b.Key()) })
}

// Gateways returns the gateways the synthetic workloads name, once each,
// sorted by network and target. It scans every workload (for the admin
// view, not the data path).
func (s *Snapshot) Gateways() []*NetworkGateway {
	seen := map[string]*NetworkGateway{}
	for _, w := range s.workloads {
		for _, g := range w.Gateways {
			seen[g.Network+" "+g.Target()] = g
		}
	}
	return sortedValues(seen, func(a, b *NetworkGateway) int {
		return cmp.Or(cmp.Compare(a.Network, b.Network), cmp.Compare(a.Target(), b.Target()))
	})
}

// LocalWorkloads returns the workloads scheduled on node, sorted by UID.
func (s *Snapshot) LocalWorkloads(node string) []*Workload {
	var out []*Workload
	for _, w := range s.Workloads() {
		if w.Node == node && len(w.Addresses) > 0 {
			out = append(out, w)
		}
	}
	return out
}

func sortedValues[V any](m map[string]V, less func(a, b V) int) []V {
	out := slices.Collect(maps.Values(m))
	slices.SortFunc(out, less)
	return out
}

// Store holds the current Snapshot. Load is lock-free; Update serializes
// writers and publishes a new snapshot atomically.
type Store struct {
	mu  sync.Mutex // serializes writers
	cur atomic.Pointer[Snapshot]
}

// NewStore returns a store holding an empty snapshot.
func NewStore() *Store {
	st := &Store{}
	st.cur.Store(emptySnapshot())
	return st
}

// Load returns the current snapshot.
func (st *Store) Load() *Snapshot { return st.cur.Load() }

// Follow calls fn with the current snapshot, then with each newer one as
// it replaces the last (snapshots published in between may be skipped),
// until ctx ends.
func (st *Store) Follow(ctx context.Context, fn func(*Snapshot)) {
	for {
		snap := st.Load()
		fn(snap)
		select {
		case <-ctx.Done():
			return
		case <-snap.Stale():
		}
	}
}

// Tx collects changes for one Update. Later changes to the same key win.
type Tx struct {
	workloads map[string]*Workload // nil value = removal
	services  map[string]*Service
}

// UpsertWorkload adds or replaces the workload with w.UID. w is copied.
func (tx *Tx) UpsertWorkload(w *Workload) { tx.workloads[w.UID] = w.clone() }

// RemoveWorkload removes the workload with uid.
func (tx *Tx) RemoveWorkload(uid string) { tx.workloads[uid] = nil }

// UpsertService adds or replaces a service keyed by <ns>/<hostname>; an
// empty Hostname defaults to <name>.<ns>.svc.cluster.local. svc is copied.
func (tx *Tx) UpsertService(svc *Service) {
	c := svc.clone()
	tx.services[c.Key()] = c
}

// RemoveService removes the service with key <ns>/<hostname>.
func (tx *Tx) RemoveService(key string) { tx.services[key] = nil }

// Update runs fn to collect changes and publishes one new snapshot holding
// them. Indexes are rebuilt only for the changed keys; the maps themselves
// are copied, so an update costs O(size) map copying plus O(change) work
// (plus one pass over the services when a removed service leaves a VIP or
// hostname that another service may share).
func (st *Store) Update(fn func(tx *Tx)) *Snapshot {
	tx := &Tx{workloads: map[string]*Workload{}, services: map[string]*Service{}}
	fn(tx)
	st.mu.Lock()
	defer st.mu.Unlock()
	old := st.cur.Load()
	next := apply(old, tx)
	st.cur.Store(next)
	close(old.stale)
	return next
}

func apply(old *Snapshot, tx *Tx) *Snapshot {
	n := &Snapshot{
		version:   old.version + 1,
		workloads: maps.Clone(old.workloads),
		byAddr:    maps.Clone(old.byAddr),
		contested: maps.Clone(old.contested),
		services:  maps.Clone(old.services),
		byVIP:     maps.Clone(old.byVIP),
		byHost:    maps.Clone(old.byHost),
		endpoints: maps.Clone(old.endpoints),
		clusters:  maps.Clone(old.clusters),
		networks:  maps.Clone(old.networks),
		stale:     make(chan struct{}),
	}
	dirty := map[string]bool{} // service keys whose endpoint lists change
	for uid, w := range tx.workloads {
		if prev, ok := n.workloads[uid]; ok {
			n.unindex(prev)
			for k := range prev.Services {
				dirty[k] = true
			}
			delete(n.workloads, uid)
		}
		if w == nil {
			continue
		}
		n.workloads[uid] = w
		for i, a := range w.Addresses {
			w.Addresses[i] = a.Unmap()
		}
		n.index(w)
		for k := range w.Services {
			dirty[k] = true
		}
	}
	// VIPs and hostnames whose indexed service goes: another service may
	// have them too (overlapping service CIDRs of two clusters on one
	// network), and then keeps them.
	orphanVIPs, orphanHosts := map[netip.Addr]bool{}, map[string]bool{}
	for key, svc := range tx.services {
		if prev, ok := n.services[key]; ok {
			for _, v := range prev.VIPs {
				if n.byVIP[v] == prev {
					delete(n.byVIP, v)
					orphanVIPs[v] = true
				}
			}
			if n.byHost[prev.Hostname] == prev {
				delete(n.byHost, prev.Hostname)
				orphanHosts[prev.Hostname] = true
			}
			delete(n.services, key)
		}
		if svc == nil {
			continue
		}
		n.services[key] = svc
		n.byHost[svc.Hostname] = svc
		for i, v := range svc.VIPs {
			svc.VIPs[i] = v.Unmap()
			n.byVIP[v.Unmap()] = svc
		}
	}
	n.adoptServiceKeys(orphanVIPs, orphanHosts)
	if len(dirty) > 0 {
		rebuildEndpoints(n, dirty)
	}
	return n
}

// adoptServiceKeys indexes each of vips and hosts that no service holds any
// more to a remaining service that has it (the smallest key, whatever the
// order of writes). It costs one pass over the services, and only when an
// update left such a key behind.
func (n *Snapshot) adoptServiceKeys(vips map[netip.Addr]bool, hosts map[string]bool) {
	maps.DeleteFunc(vips, func(v netip.Addr, _ bool) bool { _, ok := n.byVIP[v]; return ok })
	maps.DeleteFunc(hosts, func(h string, _ bool) bool { _, ok := n.byHost[h]; return ok })
	if len(vips)+len(hosts) == 0 {
		return
	}
	better := func(cur *Service, ok bool, key string) bool { return !ok || key < cur.Key() }
	for key, svc := range n.services {
		for _, v := range svc.VIPs {
			if cur, ok := n.byVIP[v]; vips[v] && better(cur, ok, key) {
				n.byVIP[v] = svc
			}
		}
		if cur, ok := n.byHost[svc.Hostname]; hosts[svc.Hostname] && better(cur, ok, key) {
			n.byHost[svc.Hostname] = svc
		}
	}
}

func rebuildEndpoints(n *Snapshot, dirty map[string]bool) {
	lists := make(map[string][]*Workload, len(dirty))
	for _, w := range n.workloads {
		for k := range w.Services {
			if dirty[k] {
				lists[k] = append(lists[k], w)
			}
		}
	}
	for k := range dirty {
		l := lists[k]
		if len(l) == 0 {
			delete(n.endpoints, k)
			continue
		}
		slices.SortFunc(l, func(a, b *Workload) int { return cmp.Compare(a.UID, b.UID) })
		n.endpoints[k] = l
	}
}

// index records w's address claims and its cluster and network.
func (n *Snapshot) index(w *Workload) {
	count(n.clusters, w.Cluster, 1)
	count(n.networks, w.Network, 1)
	if w.HostNetwork {
		return
	}
	for _, a := range w.Addresses {
		cur, ok := n.byAddr[a]
		if !ok {
			n.byAddr[a] = w
			continue
		}
		claims := n.contested[a]
		if claims == nil {
			claims = []*Workload{cur}
		}
		if slices.Contains(claims, w) { // w lists a twice: one claim
			continue
		}
		claims = append(slices.Clone(claims), w)
		slices.SortFunc(claims, func(x, y *Workload) int { return cmp.Compare(x.UID, y.UID) })
		n.contested[a], n.byAddr[a] = claims, claims[0]
	}
}

// unindex withdraws w's address claims: an address another workload still
// claims passes to it.
func (n *Snapshot) unindex(w *Workload) {
	count(n.clusters, w.Cluster, -1)
	count(n.networks, w.Network, -1)
	if w.HostNetwork {
		return
	}
	for _, a := range w.Addresses {
		claims, ok := n.contested[a]
		if !ok {
			if n.byAddr[a] == w {
				delete(n.byAddr, a)
			}
			continue
		}
		claims = slices.DeleteFunc(slices.Clone(claims), func(x *Workload) bool { return x == w })
		if len(claims) == 0 { // not a claimant after all
			delete(n.byAddr, a)
			delete(n.contested, a)
			continue
		}
		n.byAddr[a] = claims[0]
		if len(claims) == 1 {
			delete(n.contested, a)
		} else {
			n.contested[a] = claims
		}
	}
}

func count(m map[string]int, key string, d int) {
	if key == "" {
		return
	}
	if m[key] += d; m[key] <= 0 {
		delete(m, key)
	}
}
