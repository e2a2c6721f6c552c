package model_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// TestLoadBalancingFor: a client cluster gets its own cluster's
// definition's preference (even none), else the oldest definition's.
func TestLoadBalancingFor(t *testing.T) {
	strict := &model.LoadBalancing{Preference: []model.RoutingScope{model.RouteCluster}, Strict: true}
	s := &model.Service{Definitions: []*model.ClusterService{
		{Cluster: "old", LoadBalancing: model.PreferSameZone()},
		{Cluster: "strict", LoadBalancing: strict},
		{Cluster: "plain"},
	}}
	require.Equal(t, model.PreferSameZone(), s.LoadBalancingFor("old"))
	require.Same(t, strict, s.LoadBalancingFor("strict"))
	require.Nil(t, s.LoadBalancingFor("plain"), "its own cluster's: none")
	require.Equal(t, model.PreferSameZone(), s.LoadBalancingFor("elsewhere"), "the oldest definition's")
	require.Nil(t, (&model.Service{}).LoadBalancingFor("any"))

	require.Equal(t, "STRICT:CLUSTER", strict.String())
	require.Equal(t, "FAILOVER:NETWORK,CLUSTER,REGION,ZONE,SUBZONE,NODE", model.PreferSameNode().String())
	require.Equal(t, "FAILOVER:", (&model.LoadBalancing{}).String())
	require.Empty(t, (*model.LoadBalancing)(nil).String())
	require.True(t, (*model.LoadBalancing)(nil).Equal(nil))
	require.False(t, strict.Equal(nil))
	require.False(t, strict.Equal(&model.LoadBalancing{Preference: []model.RoutingScope{model.RouteCluster}}))

	for _, in := range []string{"zone", " ZONE ", "Zone"} {
		sc, ok := model.ParseRoutingScope(in)
		require.True(t, ok, in)
		require.Equal(t, model.RouteZone, sc)
	}
	for _, in := range []string{"", "UNKNOWN", "planet"} {
		_, ok := model.ParseRoutingScope(in)
		require.False(t, ok, in)
	}
	require.Equal(t, "UNKNOWN", model.RoutingScope(0).String())
	require.Equal(t, "UNKNOWN", model.RoutingScope(99).String())
}
