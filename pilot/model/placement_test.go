package model

import (
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestPlaceSharesEqualPlacements(t *testing.T) {
	p := Placement{Cluster: "c1", Network: "n1", Node: "node-a", Namespace: "db", ServiceAccount: "default",
		Locality: Locality{Region: "r1", Zone: "z1"}}
	a := Place(p)
	assert.Same(t, a, Place(p))
	q := p
	q.Locality.Zone = "z2"
	b := Place(q)
	assert.NotSame(t, a, b)
	assert.Equal(t, p, *a)
	assert.Equal(t, q, *b)
	runtime.KeepAlive(a)
	runtime.KeepAlive(b)
}

// TestPlaceForgetsUnusedPlacements: a placement no workload holds leaves the
// table, so node churn does not grow it.
func TestPlaceForgetsUnusedPlacements(t *testing.T) {
	held := Place(Placement{Cluster: "c-held", Node: "kept"})
	for i := range 1000 {
		Place(Placement{Cluster: "c-gone", Node: string(rune('a' + i%26)), Namespace: string(rune('a' + i/26))})
	}
	require.Eventually(t, func() bool {
		runtime.GC()
		return placedIn("c-gone") == 0
	}, 10*time.Second, 10*time.Millisecond, "unused placements are forgotten")
	assert.Equal(t, 1, placedIn("c-held"))
	assert.Same(t, held, Place(Placement{Cluster: "c-held", Node: "kept"}))
}

func TestSliceWorkloadService(t *testing.T) {
	k := ServiceKey{Namespace: "db", Name: "pg"}
	got, ok := SliceWorkloadService(SliceWorkloadPrefix("c1", k) + "10.0.0.1")
	assert.True(t, ok)
	assert.Equal(t, k, got)
	_, ok = SliceWorkloadService("c1/db/pg-0")
	assert.False(t, ok)
}

// placedIn reports how many placements of cluster are interned (for tests).
func placedIn(cluster ClusterID) int {
	places.mu.Lock()
	defer places.mu.Unlock()
	n := 0
	for p := range places.m {
		if p.Cluster == cluster {
			n++
		}
	}
	return n
}
