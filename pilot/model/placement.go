package model

import (
	"runtime"
	"sync"
	"weak"
)

// Placement is where a workload runs and as whom. Every workload of one
// identity on one node has the same placement, so workloads share one
// value (see Placer) instead of carrying ~130 bytes each: at 100,000
// EndpointSlice addresses that is the largest part of a workload.
type Placement struct {
	Cluster        ClusterID `json:"cluster"`
	Network        Network   `json:"network"`
	Node           string    `json:"node"`
	Namespace      string    `json:"namespace"`
	ServiceAccount string    `json:"serviceAccount"`
	Locality       Locality  `json:"locality,omitzero"`
}

// Placer interns placements: Place returns one shared, immutable value
// for equal placements. Entries are weak: a placement no workload holds any
// more is collected, and its entry removed by its cleanup, so a churning
// fleet of nodes does not grow the table. Each cluster's discovery owns
// one, so clusters share no state. The zero value is ready; safe for
// concurrent use.
type Placer struct {
	mu sync.Mutex
	m  map[Placement]weak.Pointer[Placement]
}

// Place returns the shared, immutable placement equal to p.
func (pl *Placer) Place(p Placement) *Placement {
	pl.mu.Lock()
	defer pl.mu.Unlock()
	if wp, ok := pl.m[p]; ok {
		if shared := wp.Value(); shared != nil {
			return shared
		}
	}
	if pl.m == nil {
		pl.m = map[Placement]weak.Pointer[Placement]{}
	}
	shared := new(Placement)
	*shared = p
	pl.m[p] = weak.Make(shared)
	runtime.AddCleanup(shared, pl.forget, p)
	return shared
}

// Len returns the number of placements held.
func (pl *Placer) Len() int {
	pl.mu.Lock()
	defer pl.mu.Unlock()
	return len(pl.m)
}

// forget drops the entry of a collected placement, unless an equal one was
// placed again since.
func (pl *Placer) forget(p Placement) {
	pl.mu.Lock()
	defer pl.mu.Unlock()
	if wp, ok := pl.m[p]; ok && wp.Value() == nil {
		delete(pl.m, p)
	}
}
