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

// wildcardDelta serves one type URL in front of a LinearCache and takes over
// the hot path of wildcard delta subscribers (ztunnels): once such a client
// is in sync, its ACK parks a watch here, and a change is pushed to it by
// looking only at the changed names. LinearCache alone diffs a wildcard
// subscription against the whole cache, and clones the client's version map,
// on every ACK and every push, under one exclusive lock: O(state) per client
// per change. Everything else (first requests, reconnects with
// initial_resource_versions, named subscriptions, SotW) goes to the
// LinearCache, which sees every update.
//
// Resource versions are the LinearCache's (a hash of the marshaled
// resource), so a client moves between both paths without resends.
//
// Concurrency: all methods are safe for concurrent use; mu serialises updates
// and watch creation, so a client can never miss an update between the diff
// that put it in sync and the parking of its watch.
type wildcardDelta struct {
	typeURL string
	prefix  string
	lc      *cache.LinearCache

	mu sync.Mutex
	// seq counts UpdateResources batches.
	seq uint64
	// resources are the current resources: their encoding (shared with the
	// raw resource in the LinearCache) and version. Responses wrap them.
	resources map[string]encoded
	// changes are the names changed by the last batches, oldest first.
	changes []changeBatch
	// clients are the wildcard delta clients known to be in sync as of a
	// seq, by response channel (one per stream).
	clients map[chan cache.DeltaResponse]*syncedClient
	// lastSweep is when orphaned clients were last dropped.
	lastSweep time.Time
}

// changeLogSize bounds the batches kept to bring a client that ACKs late up
// to date; an older client falls back to the LinearCache's full diff.
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

var _ cache.Cache = (*wildcardDelta)(nil)

func newWildcardDelta(typeURL, prefix string, lc *cache.LinearCache) *wildcardDelta {
	return &wildcardDelta{
		typeURL:   typeURL,
		prefix:    prefix,
		lc:        lc,
		resources: map[string]encoded{},
		clients:   map[chan cache.DeltaResponse]*syncedClient{},
	}
}

// UpdateResources updates the LinearCache and pushes the changed names to
// every parked wildcard client.
func (w *wildcardDelta) UpdateResources(updated map[string]types.Resource, deleted []string) error {
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
	if err := w.lc.UpdateResources(updated, deleted); err != nil {
		return err
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
		if resp := w.respond(c.parked.req, c.parked.sub, names); resp != nil {
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
func (w *wildcardDelta) sweep() {
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
// its version map in place, or returns nil when it already is. The map is
// the stream's own (go-control-plane hands the response's map back as the
// subscription's), and the stream's goroutine does not touch it while the
// watch is open or during CreateDeltaWatch. The caller holds mu.
func (w *wildcardDelta) respond(req *cache.DeltaRequest, sub cache.Subscription, names []string) cache.DeltaResponse {
	known := sub.ReturnedResources()
	var out []*discovery.Resource
	var removed []string
	for _, name := range names {
		r, ok := w.resources[name]
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
	if len(out) == 0 && len(removed) == 0 {
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

// namesSince returns the names changed after seq, and false when the change
// log no longer reaches back that far.
func (w *wildcardDelta) namesSince(seq uint64) ([]string, bool) {
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

// steady reports whether req only acknowledges (or rejects) a response on a
// wildcard subscription, without changing it.
func steady(req *cache.DeltaRequest, sub cache.Subscription) bool {
	return sub.IsWildcard() && req.GetResponseNonce() != "" &&
		len(req.GetResourceNamesSubscribe()) == 0 && len(req.GetResourceNamesUnsubscribe()) == 0
}

// CreateDeltaWatch serves a steady wildcard client from the change log and
// parks its watch; any other request goes to the LinearCache, and a
// wildcard client it leaves in sync is parked here from then on.
func (w *wildcardDelta) CreateDeltaWatch(req *cache.DeltaRequest, sub cache.Subscription, ch chan cache.DeltaResponse) (func(), error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	c := w.clients[ch]
	if c != nil && steady(req, sub) {
		if names, ok := w.namesSince(c.seq); ok {
			c.orphaned = time.Time{}
			c.seq = w.seq
			if resp := w.respond(req, sub, names); resp != nil {
				ch <- resp
			} else {
				c.parked = &parkedWatch{req: req, sub: sub}
			}
			return w.canceller(ch), nil
		}
	}
	cancel, err := w.lc.CreateDeltaWatch(req, sub, ch)
	if err != nil || !sub.IsWildcard() {
		delete(w.clients, ch)
		return cancel, err
	}
	// The LinearCache answered with everything, or found nothing to send:
	// either way the client is now in sync with seq.
	c = &syncedClient{seq: w.seq}
	w.clients[ch] = c
	if cancel != nil {
		cancel()
		c.parked = &parkedWatch{req: req, sub: sub}
	}
	return w.canceller(ch), nil
}

// canceller returns the cancel func of ch's watch: the server calls it
// before the stream's next request, or when the stream ends.
func (w *wildcardDelta) canceller(ch chan cache.DeltaResponse) func() {
	return func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		if c := w.clients[ch]; c != nil {
			c.parked = nil
			c.orphaned = time.Now()
		}
	}
}

// CreateWatch serves SotW watches from the LinearCache.
func (w *wildcardDelta) CreateWatch(req *cache.Request, sub cache.Subscription, ch chan cache.Response) (func(), error) {
	return w.lc.CreateWatch(req, sub, ch)
}

// Fetch delegates to the LinearCache.
func (w *wildcardDelta) Fetch(ctx context.Context, req *cache.Request) (cache.Response, error) {
	return w.lc.Fetch(ctx, req)
}
