package proxy

import (
	"sync"
	"time"

	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// maxEjections bounds the endpoints remembered as failing; past it, expired
// entries are dropped and, if none has expired, a new failure is not
// remembered (it is still failed over within its own connection).
const maxEjections = 4096

// ejections remembers the endpoints that recently failed to connect, so
// that new connections try them last for a while instead of paying the
// same dial timeout each: a pod whose sandbox vanished stays ready in the
// registry until its node reports it. An ejected endpoint is still tried
// when every better one fails, and a success ends its ejection. Safe for
// concurrent use.
type ejections struct {
	ttl time.Duration
	now func() time.Time

	mu    sync.Mutex
	until map[string]time.Time // workload UID -> end of its ejection
}

func newEjections(ttl time.Duration, now func() time.Time) *ejections {
	return &ejections{ttl: ttl, now: now, until: map[string]time.Time{}}
}

// fail records that connecting to uid failed now.
func (e *ejections) fail(uid string) {
	now := e.now()
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, ok := e.until[uid]; !ok && len(e.until) >= maxEjections {
		for k, t := range e.until {
			if !now.Before(t) {
				delete(e.until, k)
			}
		}
		if len(e.until) >= maxEjections {
			return
		}
	}
	e.until[uid] = now.Add(e.ttl)
}

// succeed ends uid's ejection.
func (e *ejections) succeed(uid string) {
	e.mu.Lock()
	delete(e.until, uid)
	e.mu.Unlock()
}

// demote returns cands with the ejected endpoints moved to the end, each
// group keeping its order. It returns cands itself when none is ejected.
func (e *ejections) demote(cands []state.Endpoint) []state.Endpoint {
	now := e.now()
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.until) == 0 {
		return cands
	}
	var kept, ejected []state.Endpoint
	for i, c := range cands {
		t, ok := e.until[c.Workload.UID]
		if ok && now.Before(t) {
			if ejected == nil {
				kept = append(make([]state.Endpoint, 0, len(cands)), cands[:i]...)
			}
			ejected = append(ejected, c)
			continue
		}
		if ejected != nil {
			kept = append(kept, c)
		}
	}
	if ejected == nil {
		return cands
	}
	return append(kept, ejected...)
}
