package xds

import (
	"bytes"
	"errors"
	"fmt"
	"sync"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	securityv1 "github.com/isthmus-mesh/isthmus/pilot/api/security/v1"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/policy"
)

// AuthorizationType is the type URL of authorization resources.
const AuthorizationType = securityv1.TypeURL

// MetadataVerifiedNode is set by the authorizer on the node of a stream
// whose NODE_NAME was checked against its certificate (a node account), or
// taken as claimed on the development listener; it is removed from any
// other stream's node. Only such streams are served the authorization type.
const MetadataVerifiedNode = "ISTHMUS_VERIFIED_NODE"

// Policies is where the Server takes authorization policies from
// (pilot/policy.Watcher implements it).
type Policies interface {
	// HasSynced reports whether the policies were read once.
	HasSynced() bool
	// Snapshot returns the current policies.
	Snapshot() *policy.Snapshot
	// Subscribe calls fn after each change; cancel stops the calls.
	Subscribe(fn func()) (cancel func())
}

// noPolicies is the source of a Server configured without one: no policy,
// always synced.
type noPolicies struct{ snap *policy.Snapshot }

// HasSynced is always true: there is nothing to read.
func (n noPolicies) HasSynced() bool { return true }

// Snapshot returns the empty snapshot.
func (n noPolicies) Snapshot() *policy.Snapshot { return n.snap }

// Subscribe never calls fn: nothing changes.
func (n noPolicies) Subscribe(func()) (cancel func()) { return func() {} }

// nodeKey names a node ztunnel: its cluster and Kubernetes node.
type nodeKey struct {
	cluster model.ClusterID
	node    string
}

func keyOf(w *model.Workload) nodeKey { return nodeKey{cluster: w.Cluster, node: w.Node} }

// authzServer serves the authorization type, per node: each node ztunnel
// gets every mesh-wide policy, the namespace policies of the namespaces it
// runs workloads of, the selector policies that select one of its workloads
// and a binding per local workload (policy.Snapshot.NodeResources). The
// granularity is the node because that is what a ztunnel enforces for;
// a binding and the policies it names are updated in one batch, so they
// reach the ztunnel in one response.
//
// Each node has its own typeCache (policy encodings are shared between
// them), made when its ztunnel first asks. Nothing is answered before the
// policies have synced: a ztunnel that asked earlier waits, and refuses
// connections to workloads whose policies it does not know (fail closed).
//
// Concurrency: mu guards every field and serialises builds; the caches are
// safe for concurrent use, and their resource maps are read under mu only
// (their only writer is this server, under mu).
type authzServer struct {
	src    Policies
	reg    Registry
	prefix string
	logger slogAdapter

	mu      sync.Mutex
	synced  bool
	indexed bool
	nodeOf  map[string]nodeKey
	locals  map[nodeKey]map[string]struct{}
	nodes   map[nodeKey]*typeCache
	// istioNodes serve IstioAuthorizationType, made when an Istio ztunnel
	// of the node first asks (istio_authz.go).
	istioNodes map[nodeKey]*typeCache
	pending    map[*pendingWatch]struct{}
	// memo keeps the Istio encodings of memoSnap's policies.
	memoSnap *policy.Snapshot
	memo     map[string]istioMemo
}

// pendingWatch is a delta watch opened before the policies synced.
type pendingWatch struct {
	key    nodeKey
	istio  bool // the watch is of IstioAuthorizationType
	req    *cache.DeltaRequest
	sub    cache.Subscription
	ch     chan cache.DeltaResponse
	cancel func() // the real watch's, once opened
}

func newAuthzServer(src Policies, reg Registry, prefix string, logger slogAdapter) *authzServer {
	if src == nil {
		empty, _ := policy.NewSnapshot("", nil, nil)
		src = noPolicies{snap: empty}
	}
	return &authzServer{src: src, reg: reg, prefix: prefix, logger: logger,
		nodeOf: map[string]nodeKey{}, locals: map[nodeKey]map[string]struct{}{},
		nodes: map[nodeKey]*typeCache{}, istioNodes: map[nodeKey]*typeCache{}, pending: map[*pendingWatch]struct{}{}}
}

// errNotNodeProxy: a stream's node carries no verified node name.
var errNotNodeProxy = errors.New("not a verified node proxy")

// nodeKeyOf returns the node a stream's verified metadata names.
func nodeKeyOf(node *corev3.Node) (nodeKey, error) {
	f := node.GetMetadata().GetFields()
	name := f[MetadataVerifiedNode].GetStringValue()
	if name == "" {
		return nodeKey{}, errNotNodeProxy
	}
	return nodeKey{cluster: model.ClusterID(f[MetadataClusterID].GetStringValue()), node: name}, nil
}

// createDeltaWatch opens a watch on the cache of the request's node (of
// its type: AuthorizationType or IstioAuthorizationType), or parks it
// until the policies sync.
func (a *authzServer) createDeltaWatch(req *cache.DeltaRequest, sub cache.Subscription, ch chan cache.DeltaResponse) (func(), error) {
	key, err := nodeKeyOf(req.GetNode())
	if err != nil {
		return nil, status.Errorf(codes.PermissionDenied, "xds: %s is served to node proxies (ztunnel) only", req.GetTypeUrl())
	}
	istio := req.GetTypeUrl() == IstioAuthorizationType
	a.mu.Lock()
	if !a.synced {
		p := &pendingWatch{key: key, istio: istio, req: req, sub: sub, ch: ch}
		a.pending[p] = struct{}{}
		a.mu.Unlock()
		return func() {
			a.mu.Lock()
			defer a.mu.Unlock()
			delete(a.pending, p)
			if p.cancel != nil {
				p.cancel()
			}
		}, nil
	}
	// The watch opens under mu: apply must not drop the cache between
	// nodeCache and the watch, which would park it on a cache no change
	// reaches any more.
	defer a.mu.Unlock()
	c, err := a.nodeCache(key, istio)
	if err != nil {
		return nil, err
	}
	return c.CreateDeltaWatch(req, sub, ch)
}

// caches returns the node caches of one encoding. The caller holds mu.
func (a *authzServer) caches(istio bool) map[nodeKey]*typeCache {
	if istio {
		return a.istioNodes
	}
	return a.nodes
}

// nodeCache returns the cache of key in one encoding, made and built on
// first use. The caller holds mu.
func (a *authzServer) nodeCache(key nodeKey, istio bool) (*typeCache, error) {
	nodes := a.caches(istio)
	if c := nodes[key]; c != nil {
		return c, nil
	}
	a.index()
	t := AuthorizationType
	if istio {
		t = IstioAuthorizationType
	}
	c := newTypeCache(t, a.prefix, a.logger)
	nodes[key] = c
	if err := a.build(a.src.Snapshot(), key, c, istio); err != nil {
		delete(nodes, key)
		return nil, status.Errorf(codes.Internal, "build authorization of node %s/%s: %v", key.cluster, key.node, err)
	}
	return c, nil
}

// index fills the node index from the registry, once. The caller holds mu.
func (a *authzServer) index() {
	if a.indexed {
		return
	}
	a.indexed = true
	for _, w := range a.reg.Workloads() {
		a.place(w.UID, w)
	}
}

// place records where workload uid (w, nil when gone) runs and returns the
// nodes whose resources it changes. The caller holds mu.
func (a *authzServer) place(uid string, w *model.Workload) []nodeKey {
	var touched []nodeKey
	old, had := a.nodeOf[uid]
	if had {
		touched = append(touched, old)
	}
	if !policy.Enforced(w) {
		if had {
			delete(a.nodeOf, uid)
			delete(a.locals[old], uid)
			if len(a.locals[old]) == 0 {
				delete(a.locals, old)
			}
		}
		return touched
	}
	k := keyOf(w)
	if had && old != k {
		delete(a.locals[old], uid)
		if len(a.locals[old]) == 0 {
			delete(a.locals, old)
		}
	}
	a.nodeOf[uid] = k
	if a.locals[k] == nil {
		a.locals[k] = map[string]struct{}{}
	}
	a.locals[k][uid] = struct{}{}
	if !had || old != k {
		touched = append(touched, k)
	}
	return touched
}

// apply brings the served nodes in line with the changed workloads and,
// if policiesChanged, with the current policies (every node is rebuilt:
// policy changes are rare). It also answers the watches parked until the
// policies synced.
func (a *authzServer) apply(workloads map[string]struct{}, policiesChanged bool) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if !a.synced && !a.src.HasSynced() {
		return nil
	}
	snap := a.src.Snapshot()
	dirty := map[nodeKey]bool{}
	if a.indexed {
		for uid := range workloads {
			// A workload may change often: its node is the only one rebuilt.
			for _, k := range a.place(uid, a.reg.Workload(uid)) {
				dirty[k] = true
			}
		}
	}
	if policiesChanged || !a.synced {
		for k := range a.nodes {
			dirty[k] = true
		}
		for k := range a.istioNodes {
			dirty[k] = true
		}
	}
	var errs []error
	for k := range dirty {
		for _, istio := range []bool{false, true} {
			nodes := a.caches(istio)
			c := nodes[k]
			if c == nil {
				continue
			}
			if len(a.locals[k]) == 0 && !c.inUse() {
				delete(nodes, k) // a node gone, with no ztunnel left
				continue
			}
			if err := a.build(snap, k, c, istio); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if !a.synced {
		a.synced = true
		a.openPending()
	}
	if len(errs) > 0 {
		return fmt.Errorf("authorization: %d nodes not built, first: %w", len(errs), errs[0])
	}
	return nil
}

// openPending opens every parked watch on its node's cache. The caller
// holds mu.
func (a *authzServer) openPending() {
	for p := range a.pending {
		delete(a.pending, p)
		c, err := a.nodeCache(p.key, p.istio)
		if err != nil {
			a.logger.Errorf("authorization watch of node %s/%s: %v", p.key.cluster, p.key.node, err)
			continue
		}
		cancel, err := c.CreateDeltaWatch(p.req, p.sub, p.ch)
		if err != nil {
			a.logger.Errorf("authorization watch of node %s/%s: %v", p.key.cluster, p.key.node, err)
			continue
		}
		p.cancel = cancel
	}
}

// build puts in c exactly the resources of node key under snap, in
// Istio's encoding if istio. The caller holds mu.
func (a *authzServer) build(snap *policy.Snapshot, key nodeKey, c *typeCache, istio bool) error {
	locals := make([]*model.Workload, 0, len(a.locals[key]))
	for uid := range a.locals[key] {
		if w := a.reg.Workload(uid); policy.Enforced(w) && keyOf(w) == key {
			locals = append(locals, w)
		}
	}
	res, err := snap.NodeResources(locals)
	if err == nil && istio {
		res, err = a.istioNodeResources(snap, res)
	}
	if err != nil {
		return err
	}
	updated := map[string]types.Resource{}
	for name, b := range res {
		// Read without the cache's lock: only this server writes it, under mu.
		if cur, ok := c.resources[name]; !ok || !bytes.Equal(cur.raw, b) {
			updated[name] = rawOf(b)
		}
	}
	var deleted []string
	for name := range c.resources {
		if _, ok := res[name]; !ok {
			deleted = append(deleted, name)
		}
	}
	if len(updated) == 0 && len(deleted) == 0 {
		return nil
	}
	return c.UpdateResources(updated, deleted)
}

// resync rebuilds the node index from the registry (after the Server
// subscribed to its changes) and every node.
func (a *authzServer) resync() error {
	a.mu.Lock()
	if a.indexed {
		a.indexed = false
		a.nodeOf = map[string]nodeKey{}
		a.locals = map[nodeKey]map[string]struct{}{}
		a.index()
	}
	a.mu.Unlock()
	return a.apply(nil, true)
}

// nodeResources returns, for debugging, the resource names node key holds.
func (a *authzServer) nodeResources(key nodeKey) ([]string, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	c := a.nodes[key]
	if c == nil {
		return nil, false
	}
	names := make([]string, 0, len(c.resources))
	for n := range c.resources {
		names = append(names, n)
	}
	return names, true
}

// inUse reports whether a client of the cache is watching, or was within
// orphanAfter: a client between two watches (its ACK cancels the last
// before it opens the next) or resuming after a reconnect is still in
// the middle of its updates, and dropping the cache then would make its
// next watch start from a new cache, which tells it nothing of what was
// removed meanwhile.
func (w *typeCache) inUse() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	now := w.now()
	for _, c := range w.clients {
		if c.orphaned.IsZero() || now.Sub(c.orphaned) <= orphanAfter {
			return true
		}
	}
	return false
}
