package proxy

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

func endpoints(uids ...string) []state.Endpoint {
	out := make([]state.Endpoint, len(uids))
	for i, u := range uids {
		out[i] = state.Endpoint{Workload: &state.Workload{UID: u}}
	}
	return out
}

func uids(eps []state.Endpoint) []string {
	out := make([]string, len(eps))
	for i, e := range eps {
		out[i] = e.Workload.UID
	}
	return out
}

func TestEjectionsDemoteInOrderUntilExpiryOrSuccess(t *testing.T) {
	clock := clocktesting.NewFakeClock(time.Now())
	e := newEjections(10*time.Second, clock.Now)
	cands := endpoints("a", "b", "c", "d")
	require.Equal(t, []string{"a", "b", "c", "d"}, uids(e.demote(cands)))

	e.fail("a")
	e.fail("c")
	require.Equal(t, []string{"b", "d", "a", "c"}, uids(e.demote(cands)), "ejected last, each group in its order")
	require.Equal(t, []string{"a", "b", "c", "d"}, uids(cands), "the caller's slice is not reordered")

	e.succeed("c")
	require.Equal(t, []string{"b", "c", "d", "a"}, uids(e.demote(cands)))

	clock.Step(10 * time.Second)
	require.Equal(t, []string{"a", "b", "c", "d"}, uids(e.demote(cands)), "an ejection ends after its time")
}

// TestEjectionsAreBounded: failures of more endpoints than the table holds
// never grow it past maxEjections; expired entries make room.
func TestEjectionsAreBounded(t *testing.T) {
	clock := clocktesting.NewFakeClock(time.Now())
	e := newEjections(time.Second, clock.Now)
	for i := range maxEjections + 100 {
		e.fail(fmt.Sprint("w", i))
	}
	require.Len(t, e.until, maxEjections)
	require.Equal(t, []string{"late", "w0"}, uids(e.demote(endpoints("w0", "late"))), "a failure past the cap is not remembered")

	clock.Step(2 * time.Second)
	e.fail("late")
	require.Len(t, e.until, 1, "expired entries were dropped to make room")
	require.Equal(t, []string{"w0", "late"}, uids(e.demote(endpoints("late", "w0"))))
}

// TestGatewayFailsOverAndEjects: the gateway's preferred local endpoint
// refuses its HBONE port; the gateway connects the tunnel to the next one,
// and later tunnels do not dial the refusing one again until its ejection
// ends.
func TestGatewayFailsOverAndEjects(t *testing.T) {
	clock := clocktesting.NewFakeClock(time.Now())
	m := newMesh(t, func(m *mesh) { m.now = clock.Now })
	dead := nextAddr()
	cands := []state.Endpoint{
		{Workload: pod("c0", dead, "node-gone", "n2", "c2", "echo"), TargetPort: appPort},
		{Workload: pod("c1", m.c1, "node-c", "n2", "c2", "echo"), TargetPort: appPort},
	}
	deadHBONE := netip.AddrPortFrom(dead, 15008).String()
	count := func() int {
		n := 0
		for _, a := range m.gwDialer.dialed() {
			if a == deadHBONE {
				n++
			}
		}
		return n
	}
	for range 3 {
		c, ep, err := m.gw.dial(context.Background(), cands)
		require.NoError(t, err)
		require.Equal(t, "c1", ep.Workload.UID)
		require.NoError(t, c.Close())
	}
	require.Equal(t, 1, count(), "the refusing endpoint was dialled once, then tried last")

	clock.Step(DefaultConfig.EjectionTime)
	c, _, err := m.gw.dial(context.Background(), cands)
	require.NoError(t, err)
	require.NoError(t, c.Close())
	require.Equal(t, 2, count())

	// Every endpoint failing: a specific error naming each attempt.
	_, _, err = m.gw.dial(context.Background(), cands[:1])
	require.ErrorContains(t, err, "dial "+deadHBONE)
}
