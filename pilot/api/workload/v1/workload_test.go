package workloadv1_test

import (
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
)

// TestTypeURL proves TypeURL names the generated Address message, so an Any
// built by the protobuf runtime carries exactly the URL pilot serves.
func TestTypeURL(t *testing.T) {
	a, err := anypb.New(&workloadv1.Address{})
	require.NoError(t, err)
	require.Equal(t, workloadv1.TypeURL, a.GetTypeUrl())
}

// TestRoundTrip proves a split-horizon workload survives the wire: no
// address, a gateway, a capacity and its service port mappings.
func TestRoundTrip(t *testing.T) {
	gw := netip.MustParseAddr("10.0.0.1").AsSlice()
	in := &workloadv1.Address{Type: &workloadv1.Address_Workload{Workload: &workloadv1.Workload{
		Uid:        workloadv1.SplitHorizonUIDPrefix + "net2/ns/echo.ns.svc.cluster.local",
		Network:    "net2",
		Capacity:   3,
		Identities: []string{"spiffe://cluster.local/ns/ns/sa/echo"},
		NetworkGateways: []*workloadv1.GatewayAddress{{
			Destination:   &workloadv1.GatewayAddress_Address{Address: gw},
			HboneMtlsPort: 15008,
			Identities:    []string{"spiffe://cluster.local/ns/isthmus-system/sa/eastwest"},
			Capacity:      2,
		}},
		Services: map[string]*workloadv1.PortList{
			"ns/echo.ns.svc.cluster.local": {Ports: []*workloadv1.Port{{ServicePort: 80, TargetPort: 8080}}},
		},
	}}}
	b, err := proto.Marshal(in)
	require.NoError(t, err)
	out := &workloadv1.Address{}
	require.NoError(t, proto.Unmarshal(b, out))
	require.True(t, proto.Equal(in, out))
	require.Empty(t, out.GetWorkload().GetAddresses())
	require.Equal(t, uint32(3), out.GetWorkload().GetCapacity())
	require.Equal(t, gw, out.GetWorkload().GetNetworkGateways()[0].GetAddress())
}
