package xds

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"strconv"
	"sync"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"
)

// deltaCache serves every delta subscription of one type URL (the workload
// type: ztunnels subscribe wildcard, and by name on demand) from one map of
// wire-form resources and their versions.
//
// A client is tracked by one number: the update batch it is in sync with.
// Its first request is diffed against the versions it says it holds
// (initial_resource_versions, so a reconnect is sent nothing unchanged);
// from then on it is told the names changed since its batch (from a log of
// the last changeLogSize batches), the names it newly subscribes to, and
// the names go-control-plane marks for a fresh answer. No per-resource
// version map is kept per client: responses hand go-control-plane an empty
// one, where a LinearCache (and go-control-plane's subscription with it)
// keeps a name -> version entry per resource per stream (~50 B: 2.5 GB for
// 1,000 ztunnels x 50,000 endpoints). A client the log no longer reaches
// (it has not asked for changeLogSize batches) has its stream ended with
// Aborted; it reconnects with its versions and is diffed again. A
// LinearCache would also diff every client against the whole cache, and
// clone its version map, on every ACK and push, under one exclusive lock,
// and keep ~500 bytes of its own per resource: one is made only if a SotW
// client asks for the type.
//
// Versions are a hash of the encoding (resourceVersion): stable across
// pilot restarts, so a ztunnel reconnecting to a new pilot with its
// versions is sent nothing unchanged.
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
	// builder's raw resource) and version. Responses wrap them. Only
	// UpdateResources writes it, from the builder (which holds
	// Server.buildMu); the builder also reads it without mu (view.stored).
	resources map[string]encoded
	// changes are the names changed by the last batches, oldest first.
	changes []changeBatch
	// clients are the delta clients, by response channel (one per stream),
	// with the batch each is in sync with.
	clients map[chan cache.DeltaResponse]*syncedClient
	// lastSweep is when orphaned clients were last dropped.
	lastSweep time.Time
	// sotw serves SotW watches of the type; nil until the first one.
	sotw *cache.LinearCache
}

// changeLogSize bounds the batches kept to bring a client that ACKs late up
// to date; an older client's stream is ended (it reconnects).
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
	// seq is the batch the client is in sync with.
	seq uint64
	// wildcard is whether its subscription was wildcard as of seq.
	wildcard bool
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
		w.resources[name] = encoded{raw: b, version: resourceVersion(b)}
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
		var r reply
		for _, name := range names {
			r.tell(w, c.parked.sub, name, true)
		}
		if resp := r.response(w, c.parked.req, false); resp != nil {
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

// reply collects what one response tells a client.
type reply struct {
	out     []*discovery.Resource
	removed []string
}

// visible reports whether sub receives name: every name when wildcard, else
// the names it subscribes to.
func visible(sub cache.Subscription, name string) bool {
	if sub.IsWildcard() {
		return true
	}
	_, ok := sub.SubscribedResources()[name]
	return ok
}

// tell adds name, if sub receives it: the resource when it exists, else its
// removal when the client may hold it. The caller holds mu.
func (r *reply) tell(w *deltaCache, sub cache.Subscription, name string, mayHold bool) {
	if !visible(sub, name) {
		return
	}
	if e, ok := w.resources[name]; ok {
		r.add(w, name, e)
	} else if mayHold {
		r.removed = append(r.removed, name)
	}
}

func (r *reply) add(w *deltaCache, name string, e encoded) {
	r.out = append(r.out, &discovery.Resource{Name: name, Version: e.version, Resource: &anypb.Any{TypeUrl: w.typeURL, Value: e.raw}})
}

// response wraps the reply, or returns nil when it says nothing (unless
// evenIfEmpty). The caller holds mu.
func (r *reply) response(w *deltaCache, req *cache.DeltaRequest, evenIfEmpty bool) cache.DeltaResponse {
	if len(r.out) == 0 && len(r.removed) == 0 && !evenIfEmpty {
		return nil
	}
	return &cache.DeltaPassthroughResponse{
		DeltaRequest: req,
		// go-control-plane keeps this as the stream's known versions: the
		// client is tracked by its batch here instead.
		NextVersionMap: map[string]string{},
		DeltaDiscoveryResponse: &discovery.DeltaDiscoveryResponse{
			Resources:         r.out,
			RemovedResources:  r.removed,
			TypeUrl:           w.typeURL,
			SystemVersionInfo: w.prefix + strconv.FormatUint(w.seq, 10),
		},
	}
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

// CreateDeltaWatch answers req with what the client is missing, or parks
// the watch until an update concerns it.
func (w *deltaCache) CreateDeltaWatch(req *cache.DeltaRequest, sub cache.Subscription, ch chan cache.DeltaResponse) (func(), error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	known := sub.ReturnedResources()
	var r reply
	c := w.clients[ch]
	evenIfEmpty := false
	if c == nil {
		// The stream's first request: diff against the versions the client
		// holds. A wildcard client is always answered: its initial state is
		// complete (ztunnel and Envoy wait for it), even when it has
		// everything already.
		if sub.IsWildcard() {
			for name, e := range w.resources {
				if known[name] != e.version {
					r.add(w, name, e)
				}
			}
		} else {
			for name := range sub.SubscribedResources() {
				if e, ok := w.resources[name]; ok && known[name] != e.version {
					r.add(w, name, e)
				}
			}
		}
		for name := range known {
			if _, ok := w.resources[name]; !ok || !visible(sub, name) {
				r.removed = append(r.removed, name)
			}
		}
		evenIfEmpty = sub.IsWildcard()
		c = &syncedClient{}
		w.clients[ch] = c
	} else {
		names, ok := w.namesSince(c.seq)
		if !ok {
			delete(w.clients, ch)
			return nil, status.Errorf(codes.Aborted, "%s: this stream fell more than %d updates behind; reconnect with initial_resource_versions", w.typeURL, changeLogSize)
		}
		told := make(map[string]struct{}, len(names))
		for _, name := range names {
			told[name] = struct{}{}
			r.tell(w, sub, name, true)
		}
		// Names newly subscribed to, which the client cannot hold yet.
		for _, name := range req.GetResourceNamesSubscribe() {
			if _, dup := told[name]; !dup {
				told[name] = struct{}{}
				r.tell(w, sub, name, false)
			}
		}
		// Names go-control-plane marked for a fresh answer (a wildcard
		// client unsubscribing a name explicitly must be told whether it
		// exists).
		for name := range known {
			if _, dup := told[name]; !dup {
				told[name] = struct{}{}
				r.tell(w, sub, name, true)
			}
		}
		switch {
		case c.wildcard && !sub.IsWildcard():
			// Leaving wildcard: it holds every resource; those it does not
			// subscribe to now are removed.
			for name := range w.resources {
				if _, dup := told[name]; !dup && !visible(sub, name) {
					r.removed = append(r.removed, name)
				}
			}
		case !c.wildcard && sub.IsWildcard():
			// Joining wildcard (rare): everything, the few resources it
			// held by name included.
			for name, e := range w.resources {
				if _, dup := told[name]; !dup {
					r.add(w, name, e)
				}
			}
		}
	}
	c.wildcard = sub.IsWildcard()
	c.orphaned = time.Time{}
	c.seq = w.seq
	if resp := r.response(w, req, evenIfEmpty); resp != nil {
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

// resourceVersion is the version of an encoding: the first 96 bits of its
// SHA-256, 16 characters (go-control-plane's HashResource spells all 256 in
// 64, which at 50,000 resources per class is 2.4 MB of version strings).
func resourceVersion(b []byte) string {
	sum := sha256.Sum256(b)
	return base64.RawURLEncoding.EncodeToString(sum[:12])
}
