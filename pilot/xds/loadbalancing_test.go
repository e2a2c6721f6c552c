package xds_test

import (
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"

	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/xds/xdstest"
)

// TestServiceLoadBalancing proves the workload API carries a service's
// routing preference per client cluster (the client cluster's own
// definition's, else the oldest's), none for a service without one, and a
// preference change as an update of the Service resource.
func TestServiceLoadBalancing(t *testing.T) {
	reg := xdstest.New()
	svc, ws := xdstest.Backing("echo", ns, tcp80, map[model.ClusterID][]netip.Addr{"c1": {ip("10.96.0.10")}, "c2": {ip("10.97.0.10")}},
		xdstest.Pod("c1", "net1", ns, "a", ip("10.0.0.1")), xdstest.Pod("c2", "net1", ns, "b", ip("10.0.0.2")))
	zone := *model.PreferSameZone()
	strict := model.LoadBalancing{Preference: []model.RoutingScope{model.RouteCluster}, Strict: true}
	svc.Definitions = []*model.ClusterService{
		{Cluster: "c2", Name: "echo", Namespace: ns, LoadBalancing: &zone}, // oldest
		{Cluster: "c1", Name: "echo", Namespace: ns, LoadBalancing: &strict},
	}
	publish(reg, svc, ws)
	e := start(t, reg)
	lbOf := func(cluster model.ClusterID) *workloadv1.LoadBalancing {
		c := openDelta(t, dial(t, e.addr), wildcard(node("zt-"+string(cluster), "net1", cluster)))
		defer c.close()
		c.apply(c.next())
		s := c.resources[echoName].GetService()
		require.NotNil(t, s)
		return s.GetLoadBalancing()
	}
	sameZone := &workloadv1.LoadBalancing{Mode: workloadv1.LoadBalancing_FAILOVER, RoutingPreference: []workloadv1.LoadBalancing_Scope{
		workloadv1.LoadBalancing_NETWORK, workloadv1.LoadBalancing_CLUSTER, workloadv1.LoadBalancing_REGION, workloadv1.LoadBalancing_ZONE}}
	equalProto(t, sameZone, lbOf("c2"))
	equalProto(t, &workloadv1.LoadBalancing{Mode: workloadv1.LoadBalancing_STRICT,
		RoutingPreference: []workloadv1.LoadBalancing_Scope{workloadv1.LoadBalancing_CLUSTER}}, lbOf("c1"))
	equalProto(t, sameZone, lbOf("c3"))

	// A change reaches a connected client as an update of the Service.
	c := openDelta(t, dial(t, e.addr), wildcard(node("zt-c3", "net1", "c3")))
	c.apply(c.next())
	even := model.LoadBalancing{Preference: []model.RoutingScope{}}
	next := *svc
	next.Definitions = []*model.ClusterService{{Cluster: "c2", Name: "echo", Namespace: ns, LoadBalancing: &even}, svc.Definitions[1]}
	publish(reg, &next, nil)
	r := c.next()
	require.Equal(t, []string{echoName}, names(r))
	c.apply(r)
	got := c.resources[echoName].GetService().GetLoadBalancing()
	require.NotNil(t, got, "no preference is sent as an empty preference, not as none")
	equalProto(t, &workloadv1.LoadBalancing{Mode: workloadv1.LoadBalancing_FAILOVER}, got)

	// Without any preference the field is absent (the client's default order).
	last := *svc // published values are never modified: a new one
	last.Definitions = []*model.ClusterService{{Cluster: "c2", Name: "echo", Namespace: ns}}
	publish(reg, &last, nil)
	r = c.next()
	c.apply(r)
	require.Nil(t, c.resources[echoName].GetService().GetLoadBalancing())
}
