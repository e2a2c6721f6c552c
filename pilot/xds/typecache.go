package xds

import (
	"crypto/sha256"
	"encoding/base64"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// typeCache serves every subscription of one type URL in one class, delta
// and SotW, from one map of wire-form resources and their versions. Every
// response is encoded once and its bytes shared by all the streams that get
// it (see wire.go): a push to N clients encodes the changed resources once.
//
// A delta client is tracked by one number: the update batch it is in sync
// with. Its first request is diffed against the versions it says it holds
// (initial_resource_versions, so a reconnect is sent nothing unchanged);
// from then on it is told the names changed since its batch (from a log of
// the last changeLogSize batches), the names it newly subscribes to, and
// the names go-control-plane marks for a fresh answer (how it marks them,
// and that it keeps the empty map handed back, is pinned by contract_test.go:
// a library upgrade that changes either fails there). No per-resource
// version map is kept per client: responses hand go-control-plane an empty
// one, where a LinearCache (and go-control-plane's subscription with it)
// keeps a name -> version entry per resource per stream (~50 B: 2.5 GB for
// 1,000 ztunnels x 50,000 endpoints). A client the log no longer reaches
// (it has not asked for changeLogSize batches) has its stream ended with
// Aborted; it reconnects with its versions and is diffed again. A
// LinearCache would also diff every client against the whole cache, and
// clone its version map, on every ACK and push, under one exclusive lock,
// and keep ~500 bytes of its own per resource. SotW clients are tracked
// the same way (sotw.go).
//
// Versions are a hash of the encoding (resourceVersion): stable across
// pilot restarts, so a ztunnel reconnecting to a new pilot with its
// versions is sent nothing unchanged.
//
// Concurrency: all methods are safe for concurrent use; mu serialises updates
// and watch creation, so a client can never miss an update between the diff
// that put it in sync and the parking of its watch.
type typeCache struct {
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
	// sotw are the SotW clients, by stream (see streamOf), with what each
	// is in sync with.
	sotw map[unsafe.Pointer]*sotwClient
	// fullState is whether SotW responses carry every resource subscribed
	// to, changed or not (CDS and LDS).
	fullState bool
	// deltaBodies and sotwBodies keep the bodies built for the current
	// batch, for the other streams that get the same response.
	deltaBodies, sotwBodies bodyMemo
	// lastSweep is when orphaned clients were last dropped.
	lastSweep time.Time
	// now is the clock of orphaning and sweeping (time.Now).
	now func() time.Time
	// canon maps each resource name to the cache's own copy of it, for
	// the types clients subscribe to by name (EDS and RDS); nil for the
	// others. See intern.
	canon map[string]string
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

var _ cache.Cache = (*typeCache)(nil)

func newTypeCache(typeURL, prefix string, logger slogAdapter) *typeCache {
	var canon map[string]string
	if typeURL == resource.EndpointType || typeURL == resource.RouteType {
		canon = map[string]string{}
	}
	return &typeCache{
		canon:     canon,
		typeURL:   typeURL,
		prefix:    prefix,
		logger:    logger,
		resources: map[string]encoded{},
		clients:   map[chan cache.DeltaResponse]*syncedClient{},
		sotw:      map[unsafe.Pointer]*sotwClient{},
		now:       time.Now,
		fullState: cache.ResourceRequiresFullStateInSotw(typeURL),
	}
}

// UpdateResources applies a batch and pushes the changed names to every
// parked client, delta and SotW.
func (w *typeCache) UpdateResources(updated map[string]types.Resource, deleted []string) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	names := make([]string, 0, len(updated)+len(deleted))
	for name, r := range updated {
		// The raw encoding is shared, not copied: neither side modifies it.
		b := rawBytes(r)
		w.resources[name] = encoded{raw: b, version: resourceVersion(b)}
		if w.canon != nil {
			w.canon[name] = name
		}
		names = append(names, name)
	}
	for _, name := range deleted {
		delete(w.resources, name)
		delete(w.canon, name)
		names = append(names, name)
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
	w.pushSotw(names)
	w.sweep()
	return nil
}

// intern replaces each of names that names a resource of the cache by the
// cache's own copy of that name. go-control-plane keeps the names of a
// stream's last request as its subscription (and a parked watch keeps the
// request), each decoded into its own string: a thousand Envoys that
// subscribe to the same hundred clusters would hold a hundred thousand
// copies of a hundred names, most of what an idle client costs. Names the
// cache does not hold are left as they are (they are bounded by the
// request size, and a client may not grow the cache's own table).
func (w *typeCache) intern(names []string) {
	if w.canon == nil || len(names) == 0 {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	for i, n := range names {
		if c, ok := w.canon[n]; ok {
			names[i] = c
		}
	}
}

// sweep drops clients orphaned for longer than orphanAfter, at most every
// orphanAfter. It runs on every update and every cancelled watch, so that
// closed streams leave a quiet cache too (with the responses their
// channels hold). The caller holds mu.
func (w *typeCache) sweep() {
	now := w.now()
	if now.Sub(w.lastSweep) < orphanAfter {
		return
	}
	w.lastSweep = now
	for ch, c := range w.clients {
		if !c.orphaned.IsZero() && now.Sub(c.orphaned) > orphanAfter {
			delete(w.clients, ch)
		}
	}
	for key, c := range w.sotw {
		if !c.orphaned.IsZero() && now.Sub(c.orphaned) > orphanAfter {
			delete(w.sotw, key)
		}
	}
}

// reply collects what one delta response tells a client.
type reply struct {
	// names are the resources sent, all present in resources.
	names   []string
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
func (r *reply) tell(w *typeCache, sub cache.Subscription, name string, mayHold bool) {
	if !visible(sub, name) {
		return
	}
	if _, ok := w.resources[name]; ok {
		r.names = append(r.names, name)
	} else if mayHold {
		r.removed = append(r.removed, name)
	}
}

// response wraps the reply, or returns nil when it says nothing (unless
// evenIfEmpty). The caller holds mu.
func (r *reply) response(w *typeCache, req *cache.DeltaRequest, evenIfEmpty bool) cache.DeltaResponse {
	if len(r.names) == 0 && len(r.removed) == 0 && !evenIfEmpty {
		return nil
	}
	return &cache.DeltaPassthroughResponse{
		DeltaRequest: req,
		// go-control-plane keeps this as the stream's known versions: the
		// client is tracked by its batch here instead.
		NextVersionMap:         map[string]string{},
		DeltaDiscoveryResponse: deltaEnvelope(w.typeURL, w.version(), w.deltaBody(r.names), r.removed),
	}
}

// version is the version of the current batch. The caller holds mu.
func (w *typeCache) version() string { return w.prefix + strconv.FormatUint(w.seq, 10) }

// deltaBody returns the encoded resources names (all present), shared
// with every stream of the batch that is sent the same. The caller holds
// mu.
func (w *typeCache) deltaBody(names []string) []byte {
	build := func() []byte {
		size := 0
		for _, n := range names {
			e := w.resources[n]
			size += deltaResourceSize(w.typeURL, n, e.version, e.raw)
		}
		b := make([]byte, 0, size)
		for _, n := range names {
			e := w.resources[n]
			b = appendDeltaResource(b, w.typeURL, n, e.version, e.raw)
		}
		return b
	}
	if len(names) > memoMaxNames {
		return build()
	}
	slices.Sort(names)
	return w.deltaBodies.get(w.seq, strings.Join(names, "\x00"), build)
}

// namesSince returns the names changed after seq, and false when the change
// log no longer reaches back that far.
func (w *typeCache) namesSince(seq uint64) ([]string, bool) {
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

// firstReply diffs a stream's first request against the versions the
// client holds (known). The caller holds mu.
func (w *typeCache) firstReply(sub cache.Subscription, known map[string]string) reply {
	var r reply
	if sub.IsWildcard() {
		for name, e := range w.resources {
			if known[name] != e.version {
				r.names = append(r.names, name)
			}
		}
	} else {
		for name := range sub.SubscribedResources() {
			if e, ok := w.resources[name]; ok && known[name] != e.version {
				r.names = append(r.names, name)
			}
		}
	}
	for name := range known {
		if _, ok := w.resources[name]; !ok || !visible(sub, name) {
			r.removed = append(r.removed, name)
		}
	}
	return r
}

// CreateDeltaWatch answers req with what the client is missing, or parks
// the watch until an update concerns it.
func (w *typeCache) CreateDeltaWatch(req *cache.DeltaRequest, sub cache.Subscription, ch chan cache.DeltaResponse) (func(), error) {
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
		r = w.firstReply(sub, known)
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
		// exists); TestContractDeltaMarksFreshAnswers pins how it marks them.
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
			for name := range w.resources {
				if _, dup := told[name]; !dup {
					r.names = append(r.names, name)
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
func (w *typeCache) canceller(ch chan cache.DeltaResponse) func() {
	return func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		if c := w.clients[ch]; c != nil {
			c.parked = nil
			c.orphaned = w.now()
		}
		w.sweep()
	}
}

// GetResources returns the current resources (raw, sharing their bytes).
func (w *typeCache) GetResources() map[string]types.Resource {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.snapshotLocked()
}

func (w *typeCache) snapshotLocked() map[string]types.Resource {
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
