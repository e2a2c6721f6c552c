package vip_test

import (
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/vip"
)

// TestNeeds proves which services get an allocated address: those missing
// a VIP in a network with clients (remote-only and headless ones), not
// cluster-local ones, plus the exported ones the caller names.
func TestNeeds(t *testing.T) {
	vip1 := []netip.Addr{netip.MustParseAddr("10.96.0.1")}
	both := &model.Service{Hostname: "both", VIPs: map[model.ClusterID][]netip.Addr{"c1": vip1, "c2": vip1},
		VIPNetworks: map[model.ClusterID]model.Network{"c1": "n1", "c2": "n2"}}
	remote := &model.Service{Hostname: "remote", VIPs: map[model.ClusterID][]netip.Addr{"c2": vip1},
		VIPNetworks: map[model.ClusterID]model.Network{"c2": "n2"}}
	headless := &model.Service{Hostname: "headless", Headless: true}
	local := &model.Service{Hostname: "local", Scope: model.ScopeClusterLocal}
	exported := &model.Service{Hostname: "exported", VIPs: both.VIPs, VIPNetworks: both.VIPNetworks}
	nets := []model.Network{"n1", "n2"}

	require.False(t, vip.Needs(both, nets))
	require.True(t, vip.Needs(remote, nets), "no VIP in n1")
	require.False(t, vip.Needs(remote, []model.Network{"n2"}), "n1 has no clients")
	require.True(t, vip.Needs(headless, nets))
	require.False(t, vip.Needs(local, nets))
	got := vip.Hostnames([]*model.Service{remote, both, headless, local, exported}, nets,
		func(s *model.Service) bool { return s == exported })
	require.Equal(t, []string{"exported", "headless", "remote"}, got)
}
