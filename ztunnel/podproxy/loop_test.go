//go:build linux

package podproxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/ztunnel/hbone"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
	"github.com/isthmus-mesh/isthmus/ztunnel/proxy"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// Slack allowed on ztunnel's descriptors and goroutines after one refused
// connection: a pooled HBONE connection and its goroutines may stay. A
// self-loop leaves thousands.
const (
	fdSlack        = 16
	goroutineSlack = 40
)

// fds counts the test process's (ztunnel's) open descriptors.
func fds(t testing.TB) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(ents)
}

// loopSvcVIP is the VIP of the tenant service "loop" (port 80), whose
// target port each test chooses.
var loopSvcVIP = netip.MustParseAddr("10.96.0.60")

// withLoopService makes B back the service loop.app:80 with target port
// port (a tenant may create such a Service: targetPort is theirs to set).
func (e *env) withLoopService(port uint16) {
	b, ok := e.store.Load().Workload("c1/app/b")
	if !ok {
		panic("no workload b")
	}
	nb := *b
	nb.Services = map[string]state.PortMap{svcKey: {svcPort: appPort}, "app/loop.app.svc.cluster.local": {svcPort: port}}
	e.store.Update(func(tx *state.Tx) {
		tx.UpsertService(&state.Service{Name: "loop", Namespace: "app", VIPs: []netip.Addr{loopSvcVIP}, Ports: []uint16{svcPort}})
		tx.UpsertWorkload(&nb)
	})
}

// requireFlat runs attack, which must return the attacker's connection
// still open (a loop lives as long as it does), and requires that the
// connection is closed by ztunnel, that refused counts one more refusal
// with reason self_destination, and that ztunnel's descriptors and
// goroutines come back to what they were before.
func (e *env) requireFlat(t *testing.T, reporter string, attack func() (net.Conn, error)) {
	t.Helper()
	want := map[string]string{"reporter": reporter, "reason": proxy.ReasonSelfDestination}
	refused := counter(t, e.reg, "isthmus_hbone_refused_total", want)
	fd0, g0 := fds(t), runtime.NumGoroutine()
	c, err := attack()
	require.NoError(t, err, "the attacker connects")
	if c != nil {
		defer c.Close()
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, rerr := c.Read(make([]byte, 1))
		require.Error(t, rerr, "the connection is closed, not proxied")
		require.False(t, errors.Is(rerr, os.ErrDeadlineExceeded), "closed by ztunnel, not left hanging: %v", rerr)
	}
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		assert.Equal(ct, refused+1, counter(t, e.reg, "isthmus_hbone_refused_total", want), "refused as a self destination")
		assert.LessOrEqual(ct, fds(t), fd0+fdSlack, "descriptors (before: %d)", fd0)
		assert.LessOrEqual(ct, runtime.NumGoroutine(), g0+goroutineSlack, "goroutines (before: %d)", g0)
	}, 5*time.Second, 20*time.Millisecond)
}

// TestPlaintextToZtunnelPortsIsRefused: from outside the pod, one plaintext
// connection to a PERMISSIVE pod's 15006 (or 15001, 15053: all redirected
// to 15006 with that original destination) would have ztunnel dial that
// port from inside the pod, reaching its own listener, again and again
// (4,097 connections, stopped only by the per-source cap). It is refused,
// and nothing is left behind.
func TestPlaintextToZtunnelPortsIsRefused(t *testing.T) {
	e := newEnv(t)
	e.permissive.Store(true)
	e.start(t)
	_, err := request(e.node, netip.AddrPortFrom(b4, appPort), "warm up")
	require.NoError(t, err, "PERMISSIVE plaintext to the app works")
	for _, port := range []uint16{defaults.InboundPlaintextPort, defaults.OutboundPort, defaults.DNSPort} {
		t.Run(fmt.Sprint(port), func(t *testing.T) {
			e.requireFlat(t, "destination", func() (net.Conn, error) {
				return dialFrom(e.node, netip.AddrPortFrom(b4, port))
			})
		})
	}
}

// TestServiceTargetingZtunnelIsRefused: a tenant Service whose targetPort
// is ztunnel's 15001 (or 15006, 15008) on an enrolled pod. A client in
// another pod connecting to it reaches the pod's HBONE inbound with CONNECT
// <pod>:15001, which would dial the pod's own 15001, whose outbound would
// tunnel to the pod's 15008 again, and so on; it is refused there (403). The
// pod itself connecting to the service is refused by its own outbound. A
// pod connecting to its own address at 15001 is refused too.
func TestServiceTargetingZtunnelIsRefused(t *testing.T) {
	e := newEnv(t)
	e.permissive.Store(true) // 15006 would loop only when plaintext is allowed
	e.start(t)
	_, err := request(e.a, netip.AddrPortFrom(vip, svcPort), "warm up")
	require.NoError(t, err)
	for _, port := range []uint16{defaults.OutboundPort, defaults.InboundPlaintextPort, defaults.HBONEPort} {
		t.Run(fmt.Sprint(port), func(t *testing.T) {
			e.withLoopService(port)
			t.Run("from another pod", func(t *testing.T) {
				e.requireFlat(t, "destination", func() (net.Conn, error) {
					return dialFrom(e.a, netip.AddrPortFrom(loopSvcVIP, svcPort))
				})
			})
			t.Run("from the pod itself", func(t *testing.T) {
				e.requireFlat(t, "source", func() (net.Conn, error) {
					return dialFrom(e.b, netip.AddrPortFrom(loopSvcVIP, svcPort))
				})
			})
		})
	}
	t.Run("own address", func(t *testing.T) {
		e.requireFlat(t, "source", func() (net.Conn, error) {
			return dialFrom(e.a, netip.AddrPortFrom(a4, defaults.OutboundPort))
		})
	})
}

// TestHBONEConnectToZtunnelIsRefused: a mesh client opens HBONE to a pod's
// 15008 and asks CONNECT for the pod's own 15008, 15006 or 15001 (which a
// tenant Service lists as a target port). The pod's inbound answers 403,
// counts the refusal, and dials nothing.
func TestHBONEConnectToZtunnelIsRefused(t *testing.T) {
	e := newEnv(t)
	e.permissive.Store(true)
	e.start(t)
	client, err := hbone.NewClient(hbone.ClientConfig{}, hbone.ClientDeps{Certs: e.certs, Dialer: &netns.Dialer{NetNS: e.node, Timeout: 5 * time.Second}})
	require.NoError(t, err)
	t.Cleanup(func() { client.Close() })
	serverID := identity.Identity{TrustDomain: td, Namespace: "app", ServiceAccount: "server"}
	connect := func(port uint16) (net.Conn, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		return client.Dial(ctx, hbone.DialRequest{Source: clientID, Peers: []identity.Identity{serverID},
			Addr: netip.AddrPortFrom(b4, defaults.HBONEPort), Authority: netip.AddrPortFrom(b4, port).String()})
	}
	s, err := connect(appPort)
	require.NoError(t, err, "CONNECT to the app works")
	s.Close()
	for _, port := range []uint16{defaults.HBONEPort, defaults.InboundPlaintextPort, defaults.OutboundPort} {
		t.Run(fmt.Sprint(port), func(t *testing.T) {
			e.withLoopService(port)
			e.requireFlat(t, "destination", func() (net.Conn, error) {
				s, err := connect(port)
				var se *hbone.StatusError
				require.ErrorAs(t, err, &se, "CONNECT %d refused", port)
				require.Equal(t, 403, se.Code)
				require.Nil(t, s)
				return nil, nil
			})
		})
	}
}
