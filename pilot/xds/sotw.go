package xds

import (
	"context"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"time"
	"unsafe"

	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// SotW clients of a typeCache. A SotW stream is tracked, like a delta one,
// by the batch it is in sync with and the subscription it had then (the
// map its stream made from its last request, shared, not copied). It is
// named by the returned-resources map of its subscription, which pilot's
// SotW server (sotwserver.go) makes for each stream and type, empty, and
// never writes: the node cannot name the stream, Envoy sends it with every
// request. A request is answered with what changed since, and with the
// names it newly subscribes to; a push tells each parked client the changed
// names it subscribes to. CDS and LDS responses carry every resource
// subscribed to (they are full state in SotW), EDS and RDS only the changed
// ones; as in go-control-plane's LinearCache, a request without a version
// is always answered, and one with another server's version is sent
// everything. No per-resource versions are kept per stream, where a
// LinearCache keeps a name -> version map per stream and clones it for
// every response.

// sotwClient is one SotW stream's state for the cache's type.
type sotwClient struct {
	// seq is the batch the client is in sync with.
	seq uint64
	// subscribed and wildcard are its subscription as of seq, names the
	// resource names of the request that made it (shared with the request).
	subscribed map[string]struct{}
	names      []string
	wildcard   bool
	// parked is the open watch, nil between a response and the next request.
	parked *sotwWatch
	// orphaned is when the last watch was cancelled (zero while in use).
	orphaned time.Time
	// returned is the stream's returned-resources map, which names it.
	returned map[string]string
}

// streamOf names the stream of a SotW subscription (see above).
func streamOf(sub cache.Subscription) (unsafe.Pointer, map[string]string) {
	m := sub.ReturnedResources()
	return reflect.ValueOf(m).UnsafePointer(), m
}

type sotwWatch struct {
	req     *cache.Request
	sub     cache.Subscription
	deliver func(cache.Response)
}

// CreateWatch is watchSotw for a channel (cache.Cache).
func (w *typeCache) CreateWatch(req *cache.Request, sub cache.Subscription, ch chan cache.Response) (func(), error) {
	return w.watchSotw(req, sub, func(r cache.Response) { ch <- r })
}

// watchSotw answers a SotW request with what the stream is missing, or
// parks the watch until an update concerns it. deliver is called with
// the cache's lock held: it must not block.
func (w *typeCache) watchSotw(req *cache.Request, sub cache.Subscription, deliver func(cache.Response)) (func(), error) {
	if req.GetTypeUrl() != w.typeURL {
		return nil, fmt.Errorf("request type %s does not match cache type %s", req.GetTypeUrl(), w.typeURL)
	}
	key, returned := streamOf(sub)
	if returned == nil {
		return nil, status.Error(codes.Internal, "SotW subscription without a returned-resources map")
	}
	// A request without a version is answered even when nothing changed
	// (Envoy waits for it). One with another server's version holds no
	// state of this one: it is sent everything.
	evenIfEmpty := req.GetVersionInfo() == ""
	foreign := !evenIfEmpty && !strings.HasPrefix(req.GetVersionInfo(), w.prefix)
	w.mu.Lock()
	defer w.mu.Unlock()
	c := w.sotw[key]
	var candidates []string
	all, unsubscribed := true, false
	switch {
	case c == nil:
		c = &sotwClient{returned: returned}
		w.sotw[key] = c
	case !foreign:
		candidates, all, unsubscribed = w.sotwChanges(c, req, sub)
	}
	c.seq, c.subscribed, c.names, c.wildcard, c.orphaned = w.seq, sub.SubscribedResources(), req.GetResourceNames(), sub.IsWildcard(), time.Time{}
	watch := &sotwWatch{req: req, sub: sub, deliver: deliver}
	if resp := w.sotwResponse(c, req, sub, candidates, all, unsubscribed, evenIfEmpty); resp != nil {
		c.parked = nil
		deliver(resp)
	} else {
		c.parked = watch
	}
	return w.sotwCanceller(key, watch), nil
}

// sotwChanges returns the names that may have changed for client c since
// its last request, now that it subscribes to sub (or all, when it must be
// sent everything), and whether it unsubscribed a name. The caller holds
// mu.
func (w *typeCache) sotwChanges(c *sotwClient, req *cache.Request, sub cache.Subscription) (candidates []string, all, unsubscribed bool) {
	names, ok := w.namesSince(c.seq)
	if !ok || c.wildcard != sub.IsWildcard() {
		// Out of the change log's reach, or in or out of wildcard: the
		// whole subscription is sent again (harmless in SotW).
		return nil, true, false
	}
	if sub.IsWildcard() || slices.Equal(req.GetResourceNames(), c.names) {
		// The same subscription (an ACK): comparing the names as sent is
		// cheaper than looking each up in the other's map.
		return names, false, false
	}
	cur := sub.SubscribedResources()
	for n := range cur {
		if _, held := c.subscribed[n]; !held {
			names = append(names, n)
		}
	}
	for n := range c.subscribed {
		if _, still := cur[n]; !still {
			unsubscribed = true
			break
		}
	}
	return names, false, unsubscribed
}

// pushSotw tells every parked SotW client the changed names it subscribes
// to. The caller holds mu.
func (w *typeCache) pushSotw(names []string) {
	for _, c := range w.sotw {
		p := c.parked
		if p == nil {
			continue
		}
		if resp := w.sotwResponse(c, p.req, p.sub, names, false, false, false); resp != nil {
			c.parked = nil
			p.deliver(resp)
		}
		c.seq = w.seq
	}
}

// sotwResponse builds the response to a client of sub, given the names
// that may have changed for it (or all of them), or returns nil when it
// has nothing to be told. The caller holds mu.
func (w *typeCache) sotwResponse(c *sotwClient, req *cache.Request, sub cache.Subscription, candidates []string, all, unsubscribed, evenIfEmpty bool) cache.Response {
	var send []string
	changed := unsubscribed
	if all {
		send = w.subscribedNames(sub)
		changed = changed || len(send) > 0
	} else {
		for _, n := range candidates {
			if !visible(sub, n) {
				continue
			}
			changed = true
			if _, ok := w.resources[n]; ok {
				send = append(send, n)
			}
		}
	}
	switch {
	case w.fullState:
		if !changed && !evenIfEmpty {
			return nil
		}
		if !all {
			send = w.subscribedNames(sub)
		}
	case len(send) == 0 && !evenIfEmpty:
		return nil
	}
	slices.Sort(send)
	send = slices.Compact(send)
	return &cache.PassthroughResponse{
		Request: req,
		// No per-resource versions (the client is tracked by its batch):
		// the stream's empty map, which names it.
		ReturnedResources: c.returned,
		DiscoveryResponse: sotwEnvelope(w.typeURL, w.version(), w.sotwBody(send, all && sub.IsWildcard())),
	}
}

// subscribedNames returns the present resources sub receives. The caller
// holds mu.
func (w *typeCache) subscribedNames(sub cache.Subscription) []string {
	if sub.IsWildcard() {
		out := make([]string, 0, len(w.resources))
		for n := range w.resources {
			out = append(out, n)
		}
		return out
	}
	var out []string
	for n := range sub.SubscribedResources() {
		if _, ok := w.resources[n]; ok {
			out = append(out, n)
		}
	}
	return out
}

// sotwBody returns the encoded resources names (sorted, all present),
// shared with every stream of the batch that is sent the same; everything
// is the whole cache. The caller holds mu.
func (w *typeCache) sotwBody(names []string, everything bool) []byte {
	build := func() []byte {
		size := 0
		for _, n := range names {
			size += sotwResourceSize(w.typeURL, w.resources[n].raw)
		}
		b := make([]byte, 0, size)
		for _, n := range names {
			b = appendSotwResource(b, w.typeURL, w.resources[n].raw)
		}
		return b
	}
	switch {
	case everything:
		return w.sotwBodies.get(w.seq, "\x01*", build)
	case len(names) <= memoMaxNames:
		return w.sotwBodies.get(w.seq, strings.Join(names, "\x00"), build)
	default:
		return build()
	}
}

// sotwCanceller returns the cancel func of a SotW watch: go-control-plane
// calls it before the stream's next request of the type, and when the
// stream ends.
func (w *typeCache) sotwCanceller(key unsafe.Pointer, watch *sotwWatch) func() {
	return func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		c := w.sotw[key]
		if c == nil || (c.parked != nil && c.parked != watch) {
			return
		}
		c.parked = nil
		c.orphaned = w.now()
		w.sweep()
	}
}

// Fetch is not served: xDS over REST is not supported.
func (w *typeCache) Fetch(context.Context, *cache.Request) (cache.Response, error) {
	return nil, status.Error(codes.Unimplemented, "xDS over REST is not supported")
}
