package xds

import (
	"context"
	"strconv"
	"sync"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"google.golang.org/protobuf/types/known/anypb"
)

// deltaCache serves every delta subscription of one type URL (the workload
// type: ztunnels subscribe wildcard, and by name on demand) from one map of
// wire-form resources and their versions. A change is pushed to a client
// in sync by looking only at the changed names; a first request, a
// reconnect with initial_resource_versions, a subscription change or a
// client the change log no longer reaches is diffed against the whole map
// (the subscribed names, for a client that is not wildcard). A LinearCache
// would diff every client against the whole cache, and clone its version
// map, on every ACK and push, under one exclusive lock (O(state) per client
// per change), and keep ~500 bytes of its own per resource (a cached
// resource, two once-closures, a marshaled copy and a hash): a LinearCache
// is made only if a SotW client asks for the type.
//
// Versions are go-control-plane's resource versions (a hash of the
// encoding): stable across pilot restarts, so a ztunnel reconnecting to a
// new pilot with its versions is sent nothing unchanged.
//
// Concurrency: all methods are safe for concurrent use; mu serialises updates
// and watch creation, so a client can never miss an update between the diff
// that put it in sync and the parking of its watch.
type deltaCache struct {
	typeURL string
	prefix  string
	logger  slogAdapter

	mu sync.Mutex
	// seq counts UpdateResources batches.
	seq uint64
	// resources are the current resources: their encoding (shared with the
	// builder's raw resource) and version. Responses wrap them.
	resources map[string]encoded
	// changes are the names changed by the last batches, oldest first.
	changes []changeBatch
	// clients are the delta clients known to be in sync as of a seq, by
	// response channel (one per stream).
	clients map[chan cache.DeltaResponse]*syncedClient
	// lastSweep is when orphaned clients were last dropped.
	lastSweep time.Time
	// sotw serves SotW watches of the type; nil until the first one.
	sotw *cache.LinearCache
}

// changeLogSize bounds the batches kept to bring a client that ACKs late up
// to date; an older client is diffed against every resource.
const changeLogSize = 1024

// orphanAfter is how long a client whose watch was cancelled without a new
// request (its stream ended) is kept before being dropped.
const orphanAfter = 30 * time.Second

// encoded is a resource's wire form and version.
type encoded struct {
	raw     []byte
	version string
}

type changeBatch struct {
	seq   uint64
	names []string
}

type syncedClient struct {
	seq uint64
	// parked is the open watch, nil between a response and the next request.
	parked *parkedWatch
	// orphaned is when the last watch was cancelled (zero while in use).
	orphaned time.Time
}

type parkedWatch struct {
	req *cache.DeltaRequest
	sub cache.Subscription
}

var _ cache.Cache = (*deltaCache)(nil)

func newDeltaCache(typeURL, prefix string, logger slogAdapter) *deltaCache {
	return &deltaCache{
		typeURL:   typeURL,
		prefix:    prefix,
		logger:    logger,
		resources: map[string]encoded{},
		clients:   map[chan cache.DeltaResponse]*syncedClient{},
	}
}

// UpdateResources applies a batch and pushes the changed names to every
// parked client.
func (w *deltaCache) UpdateResources(updated map[string]types.Resource, deleted []string) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	names := make([]string, 0, len(updated)+len(deleted))
	for name, r := range updated {
		// The raw encoding is shared, not copied: neither side modifies it.
		b := rawBytes(r)
		w.resources[name] = encoded{raw: b, version: cache.HashResource(b)}
		names = append(names, name)
	}
	for _, name := range deleted {
		delete(w.resources, name)
		names = append(names, name)
	}
	if w.sotw != nil {
		if err := w.sotw.UpdateResources(updated, deleted); err != nil {
			return err
		}
	}
	w.seq++
	w.changes = append(w.changes, changeBatch{seq: w.seq, names: names})
	if len(w.changes) > changeLogSize {
		w.changes = w.changes[len(w.changes)-changeLogSize:]
	}
	for ch, c := range w.clients {
		if c.parked == nil {
			continue
		}
		if resp := w.respond(c.parked.req, c.parked.sub, names, false); resp != nil {
			c.parked = nil
			ch <- resp
		}
		c.seq = w.seq
	}
	w.sweep()
	return nil
}

// sweep drops clients orphaned for longer than orphanAfter, at most every
// orphanAfter. The caller holds mu.
func (w *deltaCache) sweep() {
	now := time.Now()
	if now.Sub(w.lastSweep) < orphanAfter {
		return
	}
	w.lastSweep = now
	for ch, c := range w.clients {
		if !c.orphaned.IsZero() && now.Sub(c.orphaned) > orphanAfter {
			delete(w.clients, ch)
		}
	}
}

// respond builds the response bringing sub up to date on names, updating
// its version map in place, or returns nil when it already is. A client
// that is not wildcard gets only the names it subscribes to, and a known
// name it no longer subscribes to is removed (as LinearCache does). The
// map is the stream's own (go-control-plane hands the response's map back
// as the subscription's), and the stream's goroutine does not touch it
// while the watch is open or during CreateDeltaWatch. A name may appear
// twice in names. evenIfEmpty makes a response of nothing rather than nil.
// The caller holds mu.
func (w *deltaCache) respond(req *cache.DeltaRequest, sub cache.Subscription, names []string, evenIfEmpty bool) cache.DeltaResponse {
	known := sub.ReturnedResources()
	wildcard, subscribed := sub.IsWildcard(), sub.SubscribedResources()
	var out []*discovery.Resource
	var removed []string
	for _, name := range names {
		r, ok := w.resources[name]
		if ok && !wildcard {
			_, ok = subscribed[name]
		}
		v, had := known[name]
		switch {
		case ok && v != r.version:
			out = append(out, &discovery.Resource{Name: name, Version: r.version, Resource: &anypb.Any{TypeUrl: w.typeURL, Value: r.raw}})
			known[name] = r.version
		case !ok && had:
			removed = append(removed, name)
			delete(known, name)
		}
	}
	if len(out) == 0 && len(removed) == 0 && !evenIfEmpty {
		return nil
	}
	return &cache.DeltaPassthroughResponse{
		DeltaRequest:   req,
		NextVersionMap: known,
		DeltaDiscoveryResponse: &discovery.DeltaDiscoveryResponse{
			Resources:         out,
			RemovedResources:  removed,
			TypeUrl:           w.typeURL,
			SystemVersionInfo: w.prefix + strconv.FormatUint(w.seq, 10),
		},
	}
}

// allNames returns every name sub may need to hear of: every resource (or,
// for a client that is not wildcard, the names it subscribes to) and every
// name it knows. The caller holds mu.
func (w *deltaCache) allNames(sub cache.Subscription) []string {
	known := sub.ReturnedResources()
	var names []string
	if sub.IsWildcard() {
		names = make([]string, 0, len(w.resources)+len(known))
		for name := range w.resources {
			names = append(names, name)
		}
	} else {
		names = make([]string, 0, len(sub.SubscribedResources())+len(known))
		for name := range sub.SubscribedResources() {
			names = append(names, name)
		}
	}
	for name := range known {
		names = append(names, name)
	}
	return names
}

// namesSince returns the names changed after seq, and false when the change
// log no longer reaches back that far.
func (w *deltaCache) namesSince(seq uint64) ([]string, bool) {
	if seq == w.seq {
		return nil, true
	}
	if len(w.changes) == 0 || w.changes[0].seq > seq+1 {
		return nil, false
	}
	seen := map[string]struct{}{}
	var names []string
	for _, b := range w.changes {
		if b.seq <= seq {
			continue
		}
		for _, n := range b.names {
			if _, dup := seen[n]; !dup {
				seen[n] = struct{}{}
				names = append(names, n)
			}
		}
	}
	return names, true
}

// steady reports whether req only acknowledges (or rejects) a response,
// without changing its subscription.
func steady(req *cache.DeltaRequest) bool {
	return req.GetResponseNonce() != "" && len(req.GetResourceNamesSubscribe()) == 0 && len(req.GetResourceNamesUnsubscribe()) == 0
}

// CreateDeltaWatch answers req with what sub is missing, or parks the watch
// until an update concerns it. A steady client in sync is brought up to date
// from the change log; any other request is diffed against every resource.
func (w *deltaCache) CreateDeltaWatch(req *cache.DeltaRequest, sub cache.Subscription, ch chan cache.DeltaResponse) (func(), error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	c := w.clients[ch]
	var names []string
	inLog := false
	if c != nil && steady(req) {
		names, inLog = w.namesSince(c.seq)
	}
	if !inLog {
		names = w.allNames(sub)
	}
	if c == nil {
		c = &syncedClient{}
		w.clients[ch] = c
	}
	c.orphaned = time.Time{}
	c.seq = w.seq
	// A wildcard client's first request is always answered: its initial
	// state is complete (ztunnel and Envoy wait for it), even when it has
	// everything already.
	if resp := w.respond(req, sub, names, sub.IsWildcard() && req.GetResponseNonce() == ""); resp != nil {
		c.parked = nil
		ch <- resp
	} else {
		c.parked = &parkedWatch{req: req, sub: sub}
	}
	return w.canceller(ch), nil
}

// canceller returns the cancel func of ch's watch: the server calls it
// before the stream's next request, or when the stream ends.
func (w *deltaCache) canceller(ch chan cache.DeltaResponse) func() {
	return func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		if c := w.clients[ch]; c != nil {
			c.parked = nil
			c.orphaned = time.Now()
		}
	}
}

// CreateWatch serves a SotW watch from a LinearCache, made on first use
// from the current resources.
func (w *deltaCache) CreateWatch(req *cache.Request, sub cache.Subscription, ch chan cache.Response) (func(), error) {
	return w.sotwCache().CreateWatch(req, sub, ch)
}

// Fetch delegates to the SotW LinearCache.
func (w *deltaCache) Fetch(ctx context.Context, req *cache.Request) (cache.Response, error) {
	return w.sotwCache().Fetch(ctx, req)
}

func (w *deltaCache) sotwCache() *cache.LinearCache {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.sotw == nil {
		w.sotw = cache.NewLinearCache(w.typeURL, cache.WithVersionPrefix(w.prefix), cache.WithLogger(w.logger),
			cache.WithInitialResources(w.snapshotLocked()))
	}
	return w.sotw
}

// GetResources returns the current resources (raw, sharing their bytes).
func (w *deltaCache) GetResources() map[string]types.Resource {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.snapshotLocked()
}

func (w *deltaCache) snapshotLocked() map[string]types.Resource {
	out := make(map[string]types.Resource, len(w.resources))
	for name, r := range w.resources {
		out[name] = rawOf(r.raw)
	}
	return out
}
