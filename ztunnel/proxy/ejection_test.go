package proxy

import (
	"context"
	"crypto/tls"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
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
		c, ep, err := m.gw.dial(context.Background(), cands, m.gw.dialHBONE)
		require.NoError(t, err)
		require.Equal(t, "c1", ep.Workload.UID)
		require.NoError(t, c.Close())
	}
	require.Equal(t, 1, count(), "the refusing endpoint was dialled once, then tried last")

	clock.Step(DefaultConfig().EjectionTime)
	c, _, err := m.gw.dial(context.Background(), cands, m.gw.dialHBONE)
	require.NoError(t, err)
	require.NoError(t, c.Close())
	require.Equal(t, 2, count())

	// Every endpoint failing: a specific error naming each attempt.
	_, _, err = m.gw.dial(context.Background(), cands[:1], m.gw.dialHBONE)
	require.ErrorContains(t, err, "dial "+deadHBONE)
}

// TestSilentEndpointIsOvertaken: an endpoint whose node is gone without a
// trace (its SYNs go unanswered, unlike a refused port) holds neither a
// client connection nor a gateway tunnel for the dial timeout (an hour
// here; the client gives up after 10 s): after AttemptDelay the next
// endpoint is dialled too and wins. The gateway's silent dial is
// cancelled, not timed out; nothing is counted as a refusal, and later
// connections and tunnels try the silent endpoint last.
func TestSilentEndpointIsOvertaken(t *testing.T) {
	silent := nextAddr()
	m := newMesh(t, func(m *mesh) {
		m.dialTimeout = time.Hour
		m.dialer.silence(silent)
		m.gwDialer.silence(silent)
	})
	m.n1.Update(func(tx *state.Tx) {
		tx.UpsertWorkload(pod("b0", silent, "node-gone", "n1", "c1", "echo"))
		// b1 moves to another cluster of the same network: b0 (same
		// cluster as the client) is preferred.
		tx.UpsertWorkload(pod("b1", m.b1, "node-b", "n1", "c9", "echo"))
	})
	silentDialled := func(d *recordingDialer) int {
		n := 0
		for _, a := range d.dialed() {
			if ap, err := netip.ParseAddrPort(a); err == nil && ap.Addr() == silent {
				n++
			}
		}
		return n
	}
	m.echoVia(t, echoHost)
	require.Equal(t, 1, silentDialled(m.dialer))
	// (The HBONE pool's own dial to b0 goes on for the pool's timeout:
	// other waiters may share it.)
	m.echoVia(t, echoHost)
	require.Equal(t, 1, silentDialled(m.dialer), "tried last by the next connection")
	require.Zero(t, m.mOut.RefusedCount(metrics.ReporterSource, ReasonUpstreamUnavailble))

	cands := []state.Endpoint{
		{Workload: pod("c0", silent, "node-gone", "n2", "c2", "echo"), TargetPort: appPort},
		{Workload: pod("c1", m.c1, "node-c", "n2", "c2", "echo"), TargetPort: appPort},
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	c, ep, err := m.gw.dial(ctx, cands, m.gw.dialHBONE)
	require.NoError(t, err, "the gateway waited for the silent endpoint")
	require.Equal(t, "c1", ep.Workload.UID)
	require.NoError(t, c.Close())
	require.Eventually(t, func() bool { return len(m.gwDialer.silentDials()) == 1 }, 10*time.Second, 10*time.Millisecond)
	require.ErrorIs(t, m.gwDialer.silentDials()[0], context.Canceled, "cancelled once c1 connected")
	c, _, err = m.gw.dial(ctx, cands, m.gw.dialHBONE)
	require.NoError(t, err)
	require.NoError(t, c.Close())
	require.Equal(t, 1, silentDialled(m.gwDialer), "tried last by the next tunnel")
}

// gatedCerts holds every certificate request until open is closed.
type gatedCerts struct {
	identity.CertSource
	open chan struct{}
}

func (g *gatedCerts) Certificate(ctx context.Context, id identity.Identity) (*tls.Certificate, error) {
	select {
	case <-g.open:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return g.CertSource.Certificate(ctx, id)
}

// TestSlowCertificateOvertakesNothing: a source waiting for its first
// certificate for longer than AttemptDelay does not set off attempts to
// the next endpoints (nor eject the first): the attempt delay measures the
// endpoints, not the source.
func TestSlowCertificateOvertakesNothing(t *testing.T) {
	gate := make(chan struct{})
	const delay = time.Second // well over a loopback connection's setup, even under -race
	m := newMesh(t, func(m *mesh) {
		m.attemptDelay = delay
		m.outCerts = &gatedCerts{CertSource: m.certs, open: gate}
	})
	second := nextAddr()
	m.n1.Update(func(tx *state.Tx) {
		// b1 (same cluster as the client) is preferred; b2 is next.
		tx.UpsertWorkload(pod("b2", second, "node-b2", "n1", "c9", "echo"))
	})
	time.AfterFunc(3*delay, func() { close(gate) })
	m.echoVia(t, echoHost)
	require.False(t, m.dialer.dialedHost(second), "no attempt was made to the next endpoint")
	require.True(t, m.dialer.dialedHost(m.b1))
}
