package xds

import (
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"
	"istio.io/istio/pkg/workloadapi"

	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
)

// TestIstioServiceListsClusterSetIP: Istio's Service has no field for
// allocated addresses; an exported service's ServiceImport IP reaches an
// Istio ztunnel among its addresses, on the client's network, beside the
// local VIP, so that it is captured and resolved there too.
func TestIstioServiceListsClusterSetIP(t *testing.T) {
	local, clusterSet := netip.MustParseAddr("10.96.0.10").AsSlice(), netip.MustParseAddr("240.240.0.9").AsSlice()
	in := &workloadv1.Service{Name: "echo", Namespace: "default", Hostname: "echo.default.svc.cluster.local", Exported: true,
		Addresses:          []*workloadv1.NetworkAddress{{Network: "net1", Address: local}, {Network: "net1", Address: clusterSet}},
		AllocatedAddresses: [][]byte{clusterSet}}
	require.Equal(t, []*workloadapi.NetworkAddress{{Network: "net1", Address: local}, {Network: "net1", Address: clusterSet}},
		istioService(in).GetAddresses())
}
