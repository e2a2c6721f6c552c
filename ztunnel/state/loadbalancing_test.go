package state

import (
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestRankByLoadBalancing checks the tiers Rank produces under each kind
// of routing preference, and that Select picks from the first tier.
func TestRankByLoadBalancing(t *testing.T) {
	src := Source{Network: "n1", Cluster: "c1", Node: "node1", Locality: Locality{Region: "r1", Zone: "z1", Subzone: "s1"}}
	at := func(uid, addr, cluster, node string, loc Locality) *Workload {
		w := pod(uid, addr, "n1", cluster, loc)
		w.Node = node
		return w
	}
	remote := &Workload{
		UID: "remote", Name: "foo", Namespace: "default", Network: "n2", Status: StatusReady,
		Gateways: []*NetworkGateway{{Network: "n2", Address: netip.MustParseAddr("10.2.0.100"), HBONEPort: 15008}},
		Services: map[string]PortMap{fooKey: {80: 80}},
	}
	all := func() []*Workload {
		return []*Workload{
			at("node", "10.1.0.1", "c1", "node1", Locality{Region: "r1", Zone: "z1", Subzone: "s1"}),
			at("subzone", "10.1.0.2", "c1", "node2", Locality{Region: "r1", Zone: "z1", Subzone: "s1"}),
			at("zone", "10.1.0.3", "c1", "node3", Locality{Region: "r1", Zone: "z1", Subzone: "s2"}),
			at("region", "10.1.0.4", "c1", "node4", Locality{Region: "r1", Zone: "z2"}),
			at("cluster", "10.1.0.5", "c1", "node5", Locality{Region: "r2", Zone: "z9"}),
			at("network", "10.1.0.6", "c2", "node6", Locality{Region: "r1", Zone: "z1", Subzone: "s1"}),
			remote,
		}
	}
	sameZone := &LoadBalancing{Preference: []Scope{ScopeNetwork, ScopeCluster, ScopeRegion, ScopeZone}}
	tests := []struct {
		name   string
		lb     *LoadBalancing
		src    Source
		modify func(map[string]*Workload)
		want   [][]string // tiers, best first
	}{
		{
			name: "default order (no preference set) is unchanged",
			want: [][]string{{"node", "subzone"}, {"zone"}, {"region"}, {"cluster"}, {"network"}, {"remote"}},
		},
		{
			name: "PreferSameNode: node, subzone, zone, region, cluster, network, any",
			lb:   &LoadBalancing{Preference: []Scope{ScopeNetwork, ScopeCluster, ScopeRegion, ScopeZone, ScopeSubzone, ScopeNode}},
			want: [][]string{{"node"}, {"subzone"}, {"zone"}, {"region"}, {"cluster"}, {"network"}, {"remote"}},
		},
		{
			name: "PreferSameZone: zone, region, cluster, network, any",
			lb:   sameZone,
			want: [][]string{{"node", "subzone", "zone"}, {"region"}, {"cluster"}, {"network"}, {"remote"}},
		},
		{
			name: "PreferSameZone fails over to the region when the zone has no ready endpoint",
			lb:   sameZone,
			modify: func(w map[string]*Workload) {
				w["node"].Status, w["subzone"].Status, w["zone"].Status = StatusNotReady, StatusTerminating, StatusNotReady
			},
			want: [][]string{{"region"}, {"cluster"}, {"network"}, {"remote"}},
		},
		{
			name: "PreferSameZone reaches another network only when the cluster and network have none",
			lb:   sameZone,
			modify: func(w map[string]*Workload) {
				for _, uid := range []string{"node", "subzone", "zone", "region", "cluster", "network"} {
					w[uid].Status = StatusNotReady
				}
			},
			want: [][]string{{"remote"}},
		},
		{
			name: "Istio's PreferSameZone (no cluster scope) takes another cluster's zone first",
			lb:   &LoadBalancing{Preference: []Scope{ScopeNetwork, ScopeRegion, ScopeZone}},
			want: [][]string{{"node", "subzone", "zone", "network"}, {"region"}, {"cluster"}, {"remote"}},
		},
		{
			name: "a client without a zone matches no zone",
			lb:   sameZone,
			src:  Source{Network: "n1", Cluster: "c1", Locality: Locality{Region: "r1"}},
			want: [][]string{{"node", "subzone", "zone", "region"}, {"cluster"}, {"network"}, {"remote"}},
		},
		{
			name: "stay in the cluster unless it has none",
			lb:   &LoadBalancing{Preference: []Scope{ScopeCluster}},
			want: [][]string{{"node", "subzone", "zone", "region", "cluster"}, {"network", "remote"}},
		},
		{
			name: "STRICT cluster leaves the other clusters out",
			lb:   &LoadBalancing{Preference: []Scope{ScopeCluster}, Strict: true},
			want: [][]string{{"node", "subzone", "zone", "region", "cluster"}},
		},
		{
			name: "STRICT is the client's: a relay ranks it as FAILOVER",
			lb:   &LoadBalancing{Preference: []Scope{ScopeNetwork, ScopeCluster}, Strict: true},
			src:  Source{Network: "n1", Cluster: "c2", Relay: true},
			want: [][]string{{"network"}, {"node", "subzone", "zone", "region", "cluster"}, {"remote"}},
		},
		{
			name: "spread evenly: no preference is one tier",
			lb:   &LoadBalancing{Preference: []Scope{}},
			want: [][]string{{"node", "subzone", "zone", "region", "cluster", "network", "remote"}},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ws := all()
			byUID := map[string]*Workload{}
			for _, w := range ws {
				byUID[w.UID] = w
			}
			if tc.modify != nil {
				tc.modify(byUID)
			}
			s := tc.src
			if s == (Source{}) {
				s = src
			}
			svc := svcFoo()
			svc.LoadBalancing = tc.lb
			snap := NewStore().Update(func(tx *Tx) {
				tx.UpsertService(svc)
				for _, w := range ws {
					tx.UpsertWorkload(w)
				}
			})
			stored, ok := snap.ServiceByHostname("foo.default.svc.cluster.local")
			require.True(t, ok)
			for range 10 { // the order within a tier is random
				got, err := Selector{}.Rank(snap, stored, 80, s, nil)
				require.NoError(t, err)
				var uids []string
				for _, ep := range got {
					uids = append(uids, ep.Workload.UID)
				}
				for i, tier := range tc.want {
					require.GreaterOrEqual(t, len(uids), len(tier), "tier %d of %v", i, uids)
					require.ElementsMatch(t, tier, uids[:len(tier)], "tier %d of %v", i, uids)
					uids = uids[len(tier):]
				}
				require.Empty(t, uids, "more endpoints than tiers")
				ep, err := Selector{}.Select(snap, stored, 80, s)
				require.NoError(t, err)
				require.Contains(t, tc.want[0], ep.Workload.UID)
			}
		})
	}
}

// TestStrictWithoutMatchHasNoEndpoint: a STRICT preference nothing matches
// leaves no endpoint rather than sending traffic elsewhere.
func TestStrictWithoutMatchHasNoEndpoint(t *testing.T) {
	svc := svcFoo()
	svc.LoadBalancing = &LoadBalancing{Preference: []Scope{ScopeCluster}, Strict: true}
	snap := NewStore().Update(func(tx *Tx) {
		tx.UpsertService(svc)
		tx.UpsertWorkload(pod("other", "10.1.0.1", "n1", "c2", Locality{}))
	})
	stored, _ := snap.ServiceByHostname("foo.default.svc.cluster.local")
	_, err := Selector{}.Rank(snap, stored, 80, Source{Network: "n1", Cluster: "c1"}, nil)
	require.ErrorIs(t, err, ErrNoEndpoint)
	_, err = Selector{}.Select(snap, stored, 80, Source{Network: "n1", Cluster: "c1"})
	require.ErrorIs(t, err, ErrNoEndpoint)
}

func TestScopeText(t *testing.T) {
	for sc := ScopeNetwork; sc <= ScopeNode; sc++ {
		b, err := sc.MarshalText()
		require.NoError(t, err)
		var back Scope
		require.NoError(t, back.UnmarshalText(b))
		require.Equal(t, sc, back)
	}
	var bad Scope
	require.NoError(t, bad.UnmarshalText([]byte("GALAXY")))
	require.Equal(t, Scope(0), bad)
	require.Equal(t, "UNKNOWN", bad.String())
}
