package model

import (
	"runtime"
	"sync"
	"weak"
)

// Placement is where a workload runs and as whom. Every workload of one
// identity on one node has the same placement, so workloads share one
// value (see Place) instead of carrying ~130 bytes each: at 100,000
// EndpointSlice addresses that is the largest part of a workload.
type Placement struct {
	Cluster        ClusterID
	Network        Network
	Node           string
	Namespace      string
	ServiceAccount string
	Locality       Locality
}

// places interns placements. Entries are weak: a placement no workload
// holds any more is collected, and its entry removed by its cleanup, so a
// churning fleet of nodes does not grow the table.
var places = struct {
	mu sync.Mutex
	m  map[Placement]weak.Pointer[Placement]
}{m: map[Placement]weak.Pointer[Placement]{}}

// Place returns the shared, immutable placement equal to p. Safe for
// concurrent use.
func Place(p Placement) *Placement {
	places.mu.Lock()
	defer places.mu.Unlock()
	if wp, ok := places.m[p]; ok {
		if shared := wp.Value(); shared != nil {
			return shared
		}
	}
	shared := new(Placement)
	*shared = p
	places.m[p] = weak.Make(shared)
	runtime.AddCleanup(shared, forget, p)
	return shared
}

// forget drops the entry of a collected placement, unless an equal one was
// placed again since.
func forget(p Placement) {
	places.mu.Lock()
	defer places.mu.Unlock()
	if wp, ok := places.m[p]; ok && wp.Value() == nil {
		delete(places.m, p)
	}
}
