package state

import (
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestSharedVIPAndHostnameSurviveRemoval: two services with one VIP (two
// clusters of a network with overlapping service CIDRs) or one hostname
// (two namespaces): removing either, in either order of writes, leaves the
// other indexed under it (found by FuzzDecodeApply in ztunnel/xdsclient).
func TestSharedVIPAndHostnameSurviveRemoval(t *testing.T) {
	vip := netip.MustParseAddr("10.96.0.10")
	a := &Service{Name: "echo", Namespace: "a", Hostname: "echo.example", VIPs: []netip.Addr{vip}, Ports: []uint16{80}}
	b := &Service{Name: "echo", Namespace: "b", Hostname: "echo.example", VIPs: []netip.Addr{vip}, Ports: []uint16{80}}
	for _, order := range [][2]*Service{{a, b}, {b, a}} {
		for _, gone := range []*Service{a, b} {
			st := NewStore()
			for _, s := range order {
				st.Update(func(tx *Tx) { tx.UpsertService(s) })
			}
			snap := st.Update(func(tx *Tx) { tx.RemoveService(gone.Key()) })
			left := a
			if gone == a {
				left = b
			}
			got, ok := snap.ServiceByVIP(vip)
			require.True(t, ok, "order %s, %s, removed %s", order[0].Key(), order[1].Key(), gone.Key())
			require.Equal(t, left.Key(), got.Key())
			got, ok = snap.ServiceByHostname("echo.example")
			require.True(t, ok)
			require.Equal(t, left.Key(), got.Key())

			snap = st.Update(func(tx *Tx) { tx.RemoveService(left.Key()) })
			_, ok = snap.ServiceByVIP(vip)
			require.False(t, ok)
			_, ok = snap.ServiceByHostname("echo.example")
			require.False(t, ok)
		}
	}
}

// TestAddressListedTwiceIsOneClaim: a workload that lists an address twice
// does not contest the address with itself (found by FuzzDecodeApply).
func TestAddressListedTwiceIsOneClaim(t *testing.T) {
	w := pod("a", "10.1.0.7", "n1", "c1", Locality{})
	w.Addresses = append(w.Addresses, w.Addresses[0])
	st := NewStore()
	snap := st.Update(func(tx *Tx) { tx.UpsertWorkload(w) })
	require.Empty(t, snap.Contested())
	snap = st.Update(func(tx *Tx) { tx.UpsertWorkload(pod("b", "10.1.0.7", "n1", "c1", Locality{})) })
	require.Equal(t, map[netip.Addr][]string{w.Addresses[0]: {"a", "b"}}, snap.Contested())
	snap = st.Update(func(tx *Tx) { tx.RemoveWorkload("b") })
	require.Empty(t, snap.Contested())
	got, ok := snap.WorkloadByAddr(w.Addresses[0])
	require.True(t, ok)
	require.Equal(t, "a", got.UID)
}
