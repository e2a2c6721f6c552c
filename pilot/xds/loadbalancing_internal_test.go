package xds

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"istio.io/istio/pkg/workloadapi"

	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// TestIstioLoadBalancing proves Istio's workload API gets the same routing
// preference, scope by scope, as Isthmus's: Istio's ztunnel ranks by it.
func TestIstioLoadBalancing(t *testing.T) {
	for _, tc := range []struct {
		lb   *model.LoadBalancing
		want *workloadapi.LoadBalancing
	}{
		{nil, nil},
		{model.PreferSameNode(), &workloadapi.LoadBalancing{Mode: workloadapi.LoadBalancing_FAILOVER, RoutingPreference: []workloadapi.LoadBalancing_Scope{
			workloadapi.LoadBalancing_NETWORK, workloadapi.LoadBalancing_CLUSTER, workloadapi.LoadBalancing_REGION,
			workloadapi.LoadBalancing_ZONE, workloadapi.LoadBalancing_SUBZONE, workloadapi.LoadBalancing_NODE}}},
		{&model.LoadBalancing{Preference: []model.RoutingScope{model.RouteCluster}, Strict: true},
			&workloadapi.LoadBalancing{Mode: workloadapi.LoadBalancing_STRICT, RoutingPreference: []workloadapi.LoadBalancing_Scope{workloadapi.LoadBalancing_CLUSTER}}},
		{&model.LoadBalancing{Preference: []model.RoutingScope{}}, &workloadapi.LoadBalancing{Mode: workloadapi.LoadBalancing_FAILOVER}},
	} {
		got := istioService(&workloadv1.Service{Name: "s", Namespace: "ns", LoadBalancing: loadBalancing(tc.lb)}).GetLoadBalancing()
		require.True(t, proto.Equal(tc.want, got), "%s: want %v, got %v", tc.lb, tc.want, got)
	}
}
