package proxy

import (
	"net/http"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/ztunnel/hbone"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// TestSourceIP: an address counts as the source only when the state has it
// as a workload (not hostNetwork) running as the verified peer; otherwise
// the source address is unknown.
func TestSourceIP(t *testing.T) {
	store := state.NewStore()
	pod := netip.MustParseAddr("10.0.1.1")
	other := netip.MustParseAddr("10.0.1.2")
	node := netip.MustParseAddr("10.0.0.1")
	store.Update(func(tx *state.Tx) {
		tx.UpsertWorkload(&state.Workload{UID: "c1/front/web", Namespace: "front", ServiceAccount: "web", TrustDomain: trustDomain, Addresses: []netip.Addr{pod}})
		tx.UpsertWorkload(&state.Workload{UID: "c1/back/db", Namespace: "back", ServiceAccount: "db", TrustDomain: trustDomain, Addresses: []netip.Addr{other}})
		tx.UpsertWorkload(&state.Workload{UID: "c1/front/agent", Namespace: "front", ServiceAccount: "web", TrustDomain: trustDomain, Addresses: []netip.Addr{node}, HostNetwork: true})
	})
	web := identity.Identity{TrustDomain: trustDomain, Namespace: "front", ServiceAccount: "web"}
	req := func(remote netip.Addr, fwd string) *hbone.Request {
		h := http.Header{}
		if fwd != "" {
			h.Set(HeaderForwarded, fwd)
		}
		return &hbone.Request{Remote: netip.AddrPortFrom(remote, 40000), Peer: web, Header: h}
	}
	snap := store.Load()
	gw := netip.MustParseAddr("10.9.9.9")
	for _, tc := range []struct {
		name string
		req  *hbone.Request
		want netip.Addr
	}{
		{"forwarded by the source's ztunnel", req(node, forwarded(pod.String(), "x:80")), pod},
		{"the peer itself", req(pod, ""), pod},
		{"another identity's address claimed", req(node, forwarded(other.String(), "x:80")), netip.Addr{}},
		{"a node address is nobody's", req(node, forwarded(node.String(), "x:80")), netip.Addr{}},
		{"through a gateway, from another network", req(gw, forwarded("192.168.7.7", "x:80")), netip.Addr{}},
		{"garbage", req(gw, `for=junk;host=x`), netip.Addr{}},
	} {
		require.Equal(t, tc.want, sourceIP(snap, tc.req), tc.name)
	}
	for in, want := range map[string]string{
		`for="10.0.0.1";host=a`: "10.0.0.1", `for=10.0.0.1`: "10.0.0.1", `For="[2001:db8::1]:4711"`: "2001:db8::1",
		`for="10.0.0.1:80"`: "10.0.0.1", `host=a;for="::ffff:10.0.0.1"`: "10.0.0.1",
	} {
		got, ok := forwardedFor(in)
		require.True(t, ok, in)
		require.Equal(t, want, got.String(), in)
	}
	_, ok := forwardedFor(`host=a`)
	require.False(t, ok)
}
