package registry

import (
	"context"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// feed merges changes and publishes them with a leading-edge debounce.
type feed struct {
	quiet, maxDelay time.Duration

	mu         sync.Mutex
	pending    map[changeKey]model.Op
	order      []changeKey
	first      time.Time // arrival of the oldest pending change
	last       time.Time // arrival of the newest change
	subs       map[int]func(model.ChangeSet)
	nextSub    int
	version    uint64
	wake       chan struct{}
	publishing sync.Mutex // serializes deliveries
}

type changeKey struct {
	kind model.ChangeKind
	key  string
}

func newFeed(quiet, maxDelay time.Duration) *feed {
	return &feed{quiet: quiet, maxDelay: maxDelay, pending: map[changeKey]model.Op{}, subs: map[int]func(model.ChangeSet){}, wake: make(chan struct{}, 1)}
}

func (f *feed) subscribe(fn func(model.ChangeSet)) func() {
	f.mu.Lock()
	defer f.mu.Unlock()
	id := f.nextSub
	f.nextSub++
	f.subs[id] = fn
	return func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		delete(f.subs, id)
	}
}

// add merges changes into the pending set (net operation per key).
func (f *feed) add(changes []model.Change) {
	if len(changes) == 0 {
		return
	}
	f.mu.Lock()
	now := time.Now()
	if len(f.pending) == 0 {
		f.first = now
	}
	for _, c := range changes {
		k := changeKey{c.Kind, c.Key}
		prev, ok := f.pending[k]
		switch {
		case !ok:
			f.pending[k] = c.Op
			f.order = append(f.order, k)
		case prev == model.Added && c.Op == model.Removed:
			delete(f.pending, k) // never published: nothing to say
		case prev == model.Added:
			// still Added
		case prev == model.Removed && c.Op == model.Added:
			f.pending[k] = model.Updated
		default:
			f.pending[k] = c.Op
		}
	}
	f.mu.Unlock()
	select {
	case f.wake <- struct{}{}:
	default:
	}
}

// run publishes pending changes until ctx ends.
func (f *feed) run(ctx context.Context) {
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	var lastArrival time.Time // the newest change already seen by the loop
	for {
		select {
		case <-ctx.Done():
			timer.Stop()
			return
		case <-f.wake:
			now := time.Now()
			f.mu.Lock()
			quietBefore := lastArrival.IsZero() || now.Sub(lastArrival) >= f.quiet
			lastArrival = now
			f.last = now
			first := f.first
			f.mu.Unlock()
			if quietBefore {
				f.publish() // leading edge
				continue
			}
			// Wait for the quiet period, but never past the maximum delay.
			timer.Reset(max(min(f.quiet, f.maxDelay-now.Sub(first)), 0))
		case <-timer.C:
			now := time.Now()
			f.mu.Lock()
			due := now.Sub(f.last) >= f.quiet || (len(f.pending) > 0 && now.Sub(f.first) >= f.maxDelay)
			wait := min(f.quiet-now.Sub(f.last), f.maxDelay-now.Sub(f.first))
			f.mu.Unlock()
			if due {
				f.publish()
			} else {
				timer.Reset(max(wait, time.Millisecond))
			}
		}
	}
}

// publish delivers the pending set as one ChangeSet.
func (f *feed) publish() {
	f.publishing.Lock()
	defer f.publishing.Unlock()
	f.mu.Lock()
	if len(f.pending) == 0 {
		f.mu.Unlock()
		return
	}
	cs := model.ChangeSet{Changes: make([]model.Change, 0, len(f.pending))}
	for _, k := range f.order {
		if op, ok := f.pending[k]; ok {
			cs.Changes = append(cs.Changes, model.Change{Kind: k.kind, Op: op, Key: k.key})
			delete(f.pending, k) // a key appears once even if ordered twice
		}
	}
	f.pending = map[changeKey]model.Op{}
	if cap(f.order) > 4096 {
		f.order = nil // a burst's (a cluster's initial sync) keys are not kept for ever
	} else {
		f.order = f.order[:0]
	}
	f.version++
	cs.Version = f.version
	subs := make([]func(model.ChangeSet), 0, len(f.subs))
	for _, id := range sortedKeys(f.subs) {
		subs = append(subs, f.subs[id])
	}
	f.mu.Unlock()
	slices.SortStableFunc(cs.Changes, func(a, b model.Change) int {
		if a.Kind != b.Kind {
			return int(a.Kind) - int(b.Kind)
		}
		return strings.Compare(a.Key, b.Key)
	})
	for _, fn := range subs {
		fn(cs)
	}
}

func sortedKeys(m map[int]func(model.ChangeSet)) []int {
	out := make([]int, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// Run publishes the registry's changes to subscribers until ctx ends.
func (r *Registry) Run(ctx context.Context) error {
	r.feed.run(ctx)
	return nil
}
