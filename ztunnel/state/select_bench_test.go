package state

import (
	"fmt"
	"net/netip"
	"testing"
)

// BenchmarkRank measures ranking a service's 100 endpoints (5 zones of 2
// regions, 2 clusters) for one connection, with the default order and
// with a routing preference (PreferSameNode's scopes, the longest).
func BenchmarkRank(b *testing.B) {
	svc := svcFoo()
	snap := NewStore().Update(func(tx *Tx) {
		tx.UpsertService(svc)
		for i := range 100 {
			w := pod(fmt.Sprintf("p%d", i), netip.AddrFrom4([4]byte{10, 1, byte(i / 250), byte(i%250 + 1)}).String(), "n1",
				fmt.Sprintf("c%d", i%2), Locality{Region: fmt.Sprintf("r%d", i%2), Zone: fmt.Sprintf("z%d", i%5)})
			w.Node = fmt.Sprintf("node%d", i%20)
			tx.UpsertWorkload(w)
		}
	})
	stored, _ := snap.ServiceByHostname("foo.default.svc.cluster.local")
	src := Source{Network: "n1", Cluster: "c0", Node: "node0", Locality: Locality{Region: "r0", Zone: "z0"}}
	for _, tc := range []struct {
		name string
		lb   *LoadBalancing
	}{
		{"default", nil},
		{"preference", &LoadBalancing{Preference: []Scope{ScopeNetwork, ScopeCluster, ScopeRegion, ScopeZone, ScopeSubzone, ScopeNode}}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			s := *stored
			s.LoadBalancing = tc.lb
			b.ReportAllocs()
			for b.Loop() {
				if _, err := (Selector{}).Rank(snap, &s, 80, src, nil); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
