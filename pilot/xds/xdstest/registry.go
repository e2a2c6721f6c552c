// Package xdstest provides an in-memory implementation of xds.Registry for
// tests and benchmarks, and helpers to build services from workloads.
package xdstest

import (
	"maps"
	"net/netip"
	"slices"
	"sync"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// Registry is an in-memory federated registry. Every mutation publishes one
// ChangeSet to every subscriber, in order, from one goroutine per
// subscriber. All methods are safe for concurrent use.
type Registry struct {
	mu        sync.RWMutex
	services  map[string]*model.Service
	workloads map[string]*model.Workload
	gateways  map[string]model.NetworkGateway
	// claims are the workloads claiming each address, per network.
	claims  map[claimKey][]string
	version uint64
	subs    map[int]*subscriber
	nextSub int
}

// New returns an empty Registry.
func New() *Registry {
	return &Registry{
		services:  map[string]*model.Service{},
		workloads: map[string]*model.Workload{},
		gateways:  map[string]model.NetworkGateway{},
		claims:    map[claimKey][]string{},
		subs:      map[int]*subscriber{},
	}
}

type claimKey struct {
	network model.Network
	addr    netip.Addr
}

func claimKeys(w *model.Workload) []claimKey {
	if w == nil || !w.ClaimsAddresses() {
		return nil
	}
	out := make([]claimKey, 0, len(w.Addresses))
	for _, a := range w.Addresses {
		out = append(out, claimKey{w.Network, a.Unmap()})
	}
	return out
}

// OwnsAddresses reports whether workload uid's claim wins every address it
// carries on its network (model.Outranks). Unlike the real registry, it
// announces no ownership change: a test making claims collide sets every
// workload concerned in one Tx.
func (r *Registry) OwnsAddresses(uid string) bool {
	r.mu.RLock()
	defer r.mu.RUnlock()
	w := r.workloads[uid]
	if w == nil || !w.ClaimsAddresses() || len(w.Addresses) == 0 {
		return false
	}
	for _, a := range w.Addresses {
		for _, other := range r.claims[claimKey{w.Network, a.Unmap()}] {
			if o := r.workloads[other]; other != uid && model.Outranks(o, w) {
				return false
			}
		}
	}
	return true
}

// Services returns every service.
func (r *Registry) Services() []*model.Service {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return slices.Collect(maps.Values(r.services))
}

// Service returns the service with hostname, or nil.
func (r *Registry) Service(hostname string) *model.Service {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.services[hostname]
}

// Workloads returns every workload.
func (r *Registry) Workloads() []*model.Workload {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return slices.Collect(maps.Values(r.workloads))
}

// Workload returns the workload with uid, or nil.
func (r *Registry) Workload(uid string) *model.Workload {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.workloads[uid]
}

// IdentityNetworks returns, sorted, the networks of the workloads of ns/sa
// in cluster, on node ("" for any node).
func (r *Registry) IdentityNetworks(cluster, node, ns, sa string) []model.Network {
	r.mu.RLock()
	defer r.mu.RUnlock()
	nets := map[model.Network]bool{}
	for _, w := range r.workloads {
		if string(w.Cluster) == cluster && (node == "" || w.Node == node) && w.Namespace == ns && w.ServiceAccount == sa {
			nets[w.Network] = true
		}
	}
	return slices.Sorted(maps.Keys(nets))
}

// HasCluster reports whether a workload or a service definition of cluster
// is in the registry.
func (r *Registry) HasCluster(cluster string) bool {
	r.mu.RLock()
	defer r.mu.RUnlock()
	for _, w := range r.workloads {
		if string(w.Cluster) == cluster {
			return true
		}
	}
	for _, s := range r.services {
		if slices.Contains(s.Clusters, model.ClusterID(cluster)) {
			return true
		}
	}
	return false
}

// Gateways returns every gateway.
func (r *Registry) Gateways() []model.NetworkGateway {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return slices.Collect(maps.Values(r.gateways))
}

// Tx is a batch of mutations published as one ChangeSet. Values passed in
// must not be mutated afterwards.
type Tx struct {
	r       *Registry
	changes map[model.Change]struct{}
}

func (tx *Tx) change(kind model.ChangeKind, op model.Op, key string) {
	for _, o := range []model.Op{model.Added, model.Updated, model.Removed} {
		delete(tx.changes, model.Change{Kind: kind, Op: o, Key: key})
	}
	tx.changes[model.Change{Kind: kind, Op: op, Key: key}] = struct{}{}
}

// SetService adds or replaces a service.
func (tx *Tx) SetService(s *model.Service) {
	op := model.Added
	if _, ok := tx.r.services[s.Hostname]; ok {
		op = model.Updated
	}
	tx.r.services[s.Hostname] = s
	tx.change(model.ServiceChange, op, s.Hostname)
}

// RemoveService removes the service with hostname.
func (tx *Tx) RemoveService(hostname string) {
	delete(tx.r.services, hostname)
	tx.change(model.ServiceChange, model.Removed, hostname)
}

// SetWorkload adds or replaces a workload.
func (tx *Tx) SetWorkload(w *model.Workload) {
	op := model.Added
	if _, ok := tx.r.workloads[w.UID]; ok {
		op = model.Updated
	}
	tx.r.unclaim(tx.r.workloads[w.UID])
	tx.r.workloads[w.UID] = w
	for _, k := range claimKeys(w) {
		tx.r.claims[k] = append(tx.r.claims[k], w.UID)
	}
	tx.change(model.WorkloadChange, op, w.UID)
}

func (r *Registry) unclaim(w *model.Workload) {
	for _, k := range claimKeys(w) {
		if uids := slices.DeleteFunc(r.claims[k], func(u string) bool { return u == w.UID }); len(uids) > 0 {
			r.claims[k] = uids
		} else {
			delete(r.claims, k)
		}
	}
}

// RemoveWorkload removes the workload with uid.
func (tx *Tx) RemoveWorkload(uid string) {
	tx.r.unclaim(tx.r.workloads[uid])
	delete(tx.r.workloads, uid)
	tx.change(model.WorkloadChange, model.Removed, uid)
}

// SetGateway adds or replaces a gateway (identified by its Key).
func (tx *Tx) SetGateway(g model.NetworkGateway) {
	tx.r.gateways[g.Key()] = g
	tx.change(model.GatewayChange, model.Updated, string(g.Network))
}

// RemoveGateway removes a gateway (identified by its Key).
func (tx *Tx) RemoveGateway(g model.NetworkGateway) {
	delete(tx.r.gateways, g.Key())
	tx.change(model.GatewayChange, model.Updated, string(g.Network))
}

// Update applies fn's mutations and publishes them as one ChangeSet.
func (r *Registry) Update(fn func(tx *Tx)) {
	r.mu.Lock()
	tx := &Tx{r: r, changes: map[model.Change]struct{}{}}
	fn(tx)
	if len(tx.changes) == 0 {
		r.mu.Unlock()
		return
	}
	r.version++
	cs := model.ChangeSet{Changes: slices.Collect(maps.Keys(tx.changes)), Version: r.version}
	subs := slices.Collect(maps.Values(r.subs))
	// Enqueue under the lock so every subscriber sees batches in order.
	for _, s := range subs {
		s.push(cs)
	}
	r.mu.Unlock()
}

// SetService adds or replaces a service and publishes the change.
func (r *Registry) SetService(s *model.Service) { r.Update(func(tx *Tx) { tx.SetService(s) }) }

// RemoveService removes a service and publishes the change.
func (r *Registry) RemoveService(hostname string) {
	r.Update(func(tx *Tx) { tx.RemoveService(hostname) })
}

// SetWorkload adds or replaces a workload and publishes the change.
func (r *Registry) SetWorkload(w *model.Workload) { r.Update(func(tx *Tx) { tx.SetWorkload(w) }) }

// RemoveWorkload removes a workload and publishes the change.
func (r *Registry) RemoveWorkload(uid string) { r.Update(func(tx *Tx) { tx.RemoveWorkload(uid) }) }

// SetGateway adds or replaces a gateway and publishes the change.
func (r *Registry) SetGateway(g model.NetworkGateway) { r.Update(func(tx *Tx) { tx.SetGateway(g) }) }

// Subscribe calls fn with every later ChangeSet, serially from one
// goroutine. cancel stops it and waits for a running call to return.
func (r *Registry) Subscribe(fn func(model.ChangeSet)) (cancel func()) {
	s := &subscriber{fn: fn, done: make(chan struct{})}
	s.cond = sync.NewCond(&s.mu)
	r.mu.Lock()
	id := r.nextSub
	r.nextSub++
	r.subs[id] = s
	r.mu.Unlock()
	go s.run()
	var once sync.Once
	return func() {
		once.Do(func() {
			r.mu.Lock()
			delete(r.subs, id)
			r.mu.Unlock()
			s.stop()
		})
	}
}

type subscriber struct {
	fn      func(model.ChangeSet)
	mu      sync.Mutex
	cond    *sync.Cond
	queue   []model.ChangeSet
	stopped bool
	done    chan struct{}
}

func (s *subscriber) push(cs model.ChangeSet) {
	s.mu.Lock()
	s.queue = append(s.queue, cs)
	s.mu.Unlock()
	s.cond.Signal()
}

func (s *subscriber) stop() {
	s.mu.Lock()
	s.stopped = true
	s.mu.Unlock()
	s.cond.Signal()
	<-s.done
}

func (s *subscriber) run() {
	defer close(s.done)
	for {
		s.mu.Lock()
		for len(s.queue) == 0 && !s.stopped {
			s.cond.Wait()
		}
		if s.stopped {
			s.mu.Unlock()
			return
		}
		cs := s.queue[0]
		s.queue = s.queue[1:]
		s.mu.Unlock()
		s.fn(cs)
	}
}

// Pod returns a ready workload for pod name in namespace ns of cluster, on
// network, at addr.
func Pod(cluster model.ClusterID, network model.Network, ns, name string, addr netip.Addr) *model.Workload {
	return &model.Workload{
		UID:       model.WorkloadUID(cluster, ns, name),
		Name:      name,
		Addresses: []netip.Addr{addr},
		Placement: &model.Placement{Cluster: cluster, Network: network, Node: string(cluster) + "-node", Namespace: ns, ServiceAccount: "default"},
		Ready:     true,
	}
}

// Backing returns copies of ws that back the service with hostname on ports
// (service port -> target port of ports), and the service with those
// workloads as its endpoint shards (one shard per cluster, one VIP per
// cluster from vips if given). The inputs are not modified.
func Backing(name, ns string, ports []model.Port, vips map[model.ClusterID][]netip.Addr, ws ...*model.Workload) (*model.Service, []*model.Workload) {
	host := model.Hostname(name, ns, "")
	mappings := make([]model.PortMapping, 0, len(ports))
	for _, p := range ports {
		mappings = append(mappings, model.PortMapping{ServicePort: p.Port, TargetPort: p.TargetPort})
	}
	svc := &model.Service{
		Name: name, Namespace: ns, Hostname: host, Ports: ports, VIPs: vips,
		Shards: map[model.ClusterID][]model.Endpoint{},
	}
	out := make([]*model.Workload, 0, len(ws))
	for _, w := range ws {
		c := *w
		c.Services = maps.Clone(w.Services)
		if c.Services == nil {
			c.Services = map[string][]model.PortMapping{}
		}
		c.Services[host] = mappings
		out = append(out, &c)
		if len(w.Addresses) > 0 {
			svc.Shards[w.Cluster] = append(svc.Shards[w.Cluster], model.Endpoint{Workload: &c, Ports: mappings})
		}
		if !slices.Contains(svc.Clusters, w.Cluster) {
			svc.Clusters = append(svc.Clusters, w.Cluster)
		}
	}
	for cl := range vips {
		if !slices.Contains(svc.Clusters, cl) {
			svc.Clusters = append(svc.Clusters, cl)
		}
	}
	slices.Sort(svc.Clusters)
	return svc, out
}
