package xds

import (
	"hash/maphash"
	"slices"
	"sync"
)

// SotW subscriptions are shared between streams. Envoys of one deployment
// subscribe to the same clusters: at 1,000 Envoys and 100 clusters, a list
// of names and a set of them per stream was ~6 KB of an idle client's
// ~27 KB of heap. A stream that subscribes to names some stream already
// subscribes to, in the same order, uses that stream's list and set; the
// last stream to leave them drops them. The decoder hands the shared list
// back for every ACK that repeats it (request.go), so an ACK neither
// decodes nor looks up its names.

// sharedNames is a list of resource names subscribed to, with its set, as
// many streams share it. It is never modified.
type sharedNames struct {
	names    []string
	set      map[string]struct{}
	wildcard bool
	hash     uint64
	refs     int
}

func newSharedNames(names []string) *sharedNames {
	s := &sharedNames{names: names, set: make(map[string]struct{}, len(names))}
	for _, n := range names {
		if n == "*" {
			s.wildcard = true
		} else {
			s.set[n] = struct{}{}
		}
	}
	return s
}

// subscriptions is the table of the subscriptions in use. A nil table
// shares nothing.
type subscriptions struct {
	seed   maphash.Seed
	mu     sync.Mutex
	byHash map[uint64][]*sharedNames
}

func newSubscriptions() *subscriptions {
	return &subscriptions{seed: maphash.MakeSeed(), byHash: map[uint64][]*sharedNames{}}
}

// acquire returns the shared subscription to names, made from names when
// none is in use; the caller releases it.
func (t *subscriptions) acquire(names []string) *sharedNames {
	if t == nil {
		return newSharedNames(names)
	}
	var h maphash.Hash
	h.SetSeed(t.seed)
	for _, n := range names {
		h.WriteString(n)
		h.WriteByte(0)
	}
	sum := h.Sum64()
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, s := range t.byHash[sum] {
		if slices.Equal(s.names, names) {
			s.refs++
			return s
		}
	}
	s := newSharedNames(names)
	s.hash, s.refs = sum, 1
	t.byHash[sum] = append(t.byHash[sum], s)
	return s
}

// release gives back a subscription acquire returned (s may be nil).
func (t *subscriptions) release(s *sharedNames) {
	if t == nil || s == nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if s.refs--; s.refs > 0 {
		return
	}
	bucket := slices.DeleteFunc(t.byHash[s.hash], func(o *sharedNames) bool { return o == s })
	if len(bucket) == 0 {
		delete(t.byHash, s.hash)
	} else {
		t.byHash[s.hash] = bucket
	}
}

// len returns the number of subscriptions in use.
func (t *subscriptions) len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, b := range t.byHash {
		n += len(b)
	}
	return n
}
