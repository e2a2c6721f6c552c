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
	var pl Placer
	a := pl.Place(p)
	assert.Same(t, a, pl.Place(p))
	q := p
	q.Locality.Zone = "z2"
	b := pl.Place(q)
	assert.NotSame(t, a, b)
	assert.Equal(t, p, *a)
	assert.Equal(t, q, *b)
	runtime.KeepAlive(a)
	runtime.KeepAlive(b)
}

// TestPlaceForgetsUnusedPlacements: a placement no workload holds leaves the
// table, so node churn does not grow it.
func TestPlaceForgetsUnusedPlacements(t *testing.T) {
	var pl Placer
	held := pl.Place(Placement{Cluster: "c-held", Node: "kept"})
	for i := range 1000 {
		pl.Place(Placement{Cluster: "c-gone", Node: string(rune('a' + i%26)), Namespace: string(rune('a' + i/26))})
	}
	require.Eventually(t, func() bool {
		runtime.GC()
		return pl.Len() == 1
	}, 10*time.Second, 10*time.Millisecond, "unused placements are forgotten")
	assert.Same(t, held, pl.Place(Placement{Cluster: "c-held", Node: "kept"}))
	assert.Equal(t, 1, pl.Len())
}

func TestSliceWorkloadService(t *testing.T) {
	k := ServiceKey{Namespace: "db", Name: "pg"}
	got, ok := SliceWorkloadService(SliceWorkloadPrefix("c1", k) + "10.0.0.1")
	assert.True(t, ok)
	assert.Equal(t, k, got)
	_, ok = SliceWorkloadService("c1/db/pg-0")
	assert.False(t, ok)
}

// TestPlacersShareNothing: two clusters' placers hand out their own values.
func TestPlacersShareNothing(t *testing.T) {
	var a, b Placer
	p := Placement{Cluster: "c1", Node: "n"}
	pa, pb := a.Place(p), b.Place(p)
	assert.NotSame(t, pa, pb)
	assert.Equal(t, *pa, *pb)
	assert.Equal(t, 1, a.Len())
	assert.Equal(t, 1, b.Len())
	runtime.KeepAlive(pa)
	runtime.KeepAlive(pb)
}
