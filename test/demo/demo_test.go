//go:build linux

package demo_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/isthmus-mesh/isthmus/test/demo"
)

// TestIsolatedDemo runs the make demo topology with the real binaries (as
// processes) in real network namespaces: sleep in cluster-1 resolves
// echo.demo over DNS and reaches echo, which runs only in cluster-2 on
// network-2, through network-2's east-west gateway, the only way across.
func TestIsolatedDemo(t *testing.T) {
	bin := binDir(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	var narration strings.Builder
	work := t.TempDir()
	defer dumpLogsOnFailure(t, work)
	d, err := demo.Start(ctx, demo.Config{BinDir: bin, Out: &narration, WorkDir: work})
	require.NoError(t, err, narration.String())
	run, ids := d.RunDir(), d.NetnsIDs()
	stopped := false
	defer func() {
		if !stopped {
			d.Stop()
		}
	}()

	rc, err := d.RemoteClusters(ctx)
	require.NoError(t, err, rc)
	require.Regexp(t, `cluster-2\s+synced\s+Synced`, rc)
	requestCrossesGateway(ctx, t, d)

	t.Run("network-2's pods are out of network-1's reach", func(t *testing.T) { isolation(ctx, t, d) })
	t.Run("pilot outage", func(t *testing.T) { pilotOutage(ctx, t, d) })
	t.Run("prefer the local endpoint, fail over when it goes unready", func(t *testing.T) {
		require.NoError(t, d.AddLocalEcho(ctx))
		requireLocal(ctx, t, d)
		failover(ctx, t, d, "the local endpoint went unready", func() error { return d.SetLocalEchoReady(ctx, false) })
	})
	t.Run("fail over when the local endpoint's namespace vanishes while it is ready", func(t *testing.T) {
		require.NoError(t, d.SetLocalEchoReady(ctx, true))
		requireLocal(ctx, t, d)
		// The pod stays Ready and preferred: every connection tries it
		// first, so a reply from echo-0 means the connection failed over
		// within itself (connect failure, then the gateway).
		failover(ctx, t, d, "the local endpoint's namespace vanished (still Ready)", d.LoseLocalEcho)
		for range 2 {
			got, err := d.Request(ctx, "after the loss")
			require.NoError(t, err)
			require.True(t, strings.HasPrefix(got, d.EchoWho()), got)
		}
	})
	t.Run("a tenant posing as network-2's gateway", func(t *testing.T) { tenantGateway(ctx, t, d, true) })

	d.Stop()
	stopped = true
	require.Empty(t, demo.ProcessesWithArg(run), "processes of the run left behind")
	require.Empty(t, demo.ProcessesWithArg(bin), "demo processes left behind")
	require.Empty(t, demo.MountsUnder(run), "mounts left behind")
	require.NoDirExists(t, run)
	require.Eventually(t, func() bool { return len(demo.NetnsInUse(ids)) == 0 }, 10*time.Second, 50*time.Millisecond,
		"namespaces left behind: %v", demo.NetnsInUse(ids))
}

// requestCrossesGateway asserts that a request reaches echo-0, counted by
// the client's ztunnel, network-2's gateway and echo's ztunnel.
func requestCrossesGateway(ctx context.Context, t *testing.T, d *demo.Demo) {
	t.Helper()
	before, err := d.Path(ctx)
	require.NoError(t, err)
	var reply string
	require.Eventually(t, func() bool {
		reply, err = d.Request(ctx, "hello")
		return err == nil
	}, time.Minute, 100*time.Millisecond, "last error: %v", err)
	require.Equal(t, d.EchoWho()+` got "hello"`, reply[:strings.Index(reply, " from ")])
	after, err := d.Path(ctx)
	require.NoError(t, err)
	delta := after.Sub(before)
	require.Positive(t, delta.Gateway, "the network-2 gateway carried the connection")
	require.Positive(t, delta.ClientZtunnel)
	require.Positive(t, delta.ServerZtunnel)
	t.Log("\n" + d.Diagram(&delta))
}

// isolation shows that nothing of network-1 reaches network-2's pod
// addresses except through the gateway: not the node, not ztunnel's own
// (marked) sockets in sleep's namespace, not network-1's gateway, and the
// wan's filter is what refuses them; network-2's gateway is reachable.
func isolation(ctx context.Context, t *testing.T, d *demo.Demo) {
	rejected, err := d.WANRejected()
	require.NoError(t, err)
	app, hbone := netip.AddrPortFrom(d.EchoIP(), 8080), netip.AddrPortFrom(d.EchoIP(), 15008)
	cases := []struct {
		where string
		dst   netip.AddrPort
		mark  uint32
	}{
		{"node-1a", app, 0}, {"node-1a", hbone, 0}, {"sleep-0", hbone, demo.ZtunnelMark}, {"gateway-network-1", hbone, 0},
	}
	for _, c := range cases {
		conn, err := d.DialFrom(ctx, c.where, c.dst, c.mark)
		if err == nil {
			conn.Close()
		}
		require.ErrorIs(t, err, syscall.EHOSTUNREACH, "%s -> %s (mark %#x) must be refused by the wan", c.where, c.dst, c.mark)
	}
	now, err := d.WANRejected()
	require.NoError(t, err)
	require.GreaterOrEqual(t, now-rejected, uint64(len(cases)), "the wan's filter refused them")
	conn, err := d.DialFrom(ctx, "node-1a", netip.AddrPortFrom(d.GatewayIP("network-2"), 15008), 0)
	require.NoError(t, err, "network-2's gateway is reachable from network-1")
	conn.Close()
	hostUntouched(t)
}

// hostUntouched checks that the host's (the test's) namespace has none of
// the demo's links or nftables tables: everything is in its namespaces.
func hostUntouched(t *testing.T) {
	t.Helper()
	links, err := netlink.LinkList()
	require.NoError(t, err)
	ours := map[string]bool{"wan": true, "net1": true, "net2": true, "uplink": true, "gateway": true, "cni0": true,
		"node-1a": true, "node-2a": true, "v-sleep-0": true, "v-echo-0": true, "v-echo-local": true}
	for _, l := range links {
		require.False(t, ours[l.Attrs().Name], "the demo's link %s is in the host's namespace", l.Attrs().Name)
	}
	c, err := nftables.New()
	require.NoError(t, err)
	tables, err := c.ListTables()
	require.NoError(t, err)
	for _, tb := range tables {
		require.NotContains(t, []string{"isthmus-demo-wan", "isthmus-inpod", "isthmus-node"}, tb.Name,
			"the demo's nftables table %s is in the host's namespace", tb.Name)
	}
}

// pilotOutage: an open connection and new ones keep working from the last
// state while pilot is down.
func pilotOutage(ctx context.Context, t *testing.T, d *demo.Demo) {
	conn, err := d.Dial(ctx)
	require.NoError(t, err)
	defer conn.Close()
	_, err = demo.Exchange(conn, "before")
	require.NoError(t, err)
	d.StopPilot()
	got, err := demo.Exchange(conn, "during")
	require.NoError(t, err)
	require.Contains(t, got, `got "during"`)
	got, err = d.Request(ctx, "new connection during the outage")
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(got, d.EchoWho()), got)
	// Pilot back: the ztunnels resync and see changes again (checked by
	// the next subtests, which need a new endpoint to arrive).
	require.NoError(t, d.StartPilot(ctx))
}

// requireLocal waits until requests go to the same-network echo, then
// checks that they keep doing so.
func requireLocal(ctx context.Context, t *testing.T, d *demo.Demo) {
	t.Helper()
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		got, err := d.Request(ctx, "local?")
		assert.NoError(c, err)
		assert.True(c, strings.HasPrefix(got, d.LocalEchoWho()), got)
	}, time.Minute, 100*time.Millisecond, "the same-network endpoint is preferred once known")
	for range 5 {
		got, err := d.Request(ctx, "still local?")
		require.NoError(t, err)
		require.True(t, strings.HasPrefix(got, d.LocalEchoWho()), got)
	}
}

// failover makes the local endpoint fail by cause and logs how long until
// a request crosses the gateway to echo-0, and how many requests it took.
func failover(ctx context.Context, t *testing.T, d *demo.Demo, what string, cause func() error) {
	t.Helper()
	before, err := d.Path(ctx)
	require.NoError(t, err)
	start := time.Now()
	require.NoError(t, cause())
	requests := 0
	var last error
	require.Eventually(t, func() bool {
		requests++
		got, err := d.Request(ctx, "failover?")
		last = err
		return err == nil && strings.HasPrefix(got, d.EchoWho())
	}, time.Minute, 20*time.Millisecond, "last error: %v", last)
	t.Logf("failover to the remote network took %v (%d request(s)) after %s", time.Since(start).Round(time.Millisecond), requests, what)
	next := time.Now()
	got, err := d.Request(ctx, "after failover")
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(got, d.EchoWho()), "the next request stays on the remote network: %q", got)
	t.Logf("the next request took %v", time.Since(next).Round(time.Millisecond))
	after, err := d.Path(ctx)
	require.NoError(t, err)
	require.Greater(t, after.GatewayBytes, before.GatewayBytes, "failover traffic crossed the gateway")
}

// tenantGateway: a tenant of cluster-2 labels a Service of its own
// namespace as network-2's gateway and points it at an address it listens
// on (reachable from sleep's node); pilot reports the candidate as ignored
// and no ztunnel ever dials it.
func tenantGateway(ctx context.Context, t *testing.T, d *demo.Demo, localEcho bool) {
	lure, addr, err := d.TenantLure(ctx)
	require.NoError(t, err)
	defer lure.Close()
	var lured atomic.Int64
	go func() {
		for {
			c, err := lure.Accept()
			if err != nil {
				return
			}
			lured.Add(1)
			c.Close()
		}
	}()
	c2 := d.Cluster("cluster-2")
	require.NoError(t, c2.EnsureNamespace(ctx, "aaa-tenant", nil))
	svc, err := c2.Client.CoreV1().Services("aaa-tenant").Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "eastwest", Namespace: "aaa-tenant", Labels: map[string]string{"topology.istio.io/network": "network-2"}},
		Spec: corev1.ServiceSpec{Type: corev1.ServiceTypeLoadBalancer, Selector: map[string]string{"app": "eastwest-gateway"},
			Ports: []corev1.ServicePort{{Name: "tls-hbone", Port: 15008, TargetPort: intstr.FromInt32(15008)}}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	svc.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{{IP: addr.String()}}
	_, err = c2.Client.CoreV1().Services("aaa-tenant").UpdateStatus(ctx, svc, metav1.UpdateOptions{})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		resp, err := http.Get(demo.PilotURL(15014) + "/metrics")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return strings.Contains(string(body), `isthmus_gateway_candidates{cluster="cluster-2",status="untrusted_namespace"} 1`)
	}, time.Minute, 100*time.Millisecond, "pilot reports the ignored candidate")
	if localEcho {
		require.NoError(t, d.SetLocalEchoReady(ctx, false)) // every request crosses networks
	}
	for range 5 {
		got, err := d.Request(ctx, "through the real gateway")
		require.NoError(t, err)
		require.True(t, strings.HasPrefix(got, d.EchoWho()), got)
	}
	require.Zero(t, lured.Load(), "no ztunnel ever dialled the tenant's address")
	// The lure was reachable: dialling it from sleep's node works.
	if conn, err := d.DialFrom(ctx, "node-1a", netip.AddrPortFrom(addr, 15008), 0); err == nil {
		conn.Close()
		require.Eventually(t, func() bool { return lured.Load() == 1 }, 5*time.Second, 10*time.Millisecond)
	} else {
		require.ErrorIs(t, err, demo.ErrLoopback)
		conn, err := net.Dial("tcp", netip.AddrPortFrom(addr, 15008).String())
		require.NoError(t, err)
		conn.Close()
	}
}

// dumpLogsOnFailure logs the end of every process log in work if the test
// failed.
func dumpLogsOnFailure(t *testing.T, work string) {
	if !t.Failed() {
		return
	}
	logs, _ := filepath.Glob(filepath.Join(work, "*.log"))
	for _, l := range logs {
		b, _ := os.ReadFile(l)
		t.Logf("%s:\n%s", l, tail(string(b), 3000))
	}
}

// TestLoopbackDemo runs the loopback topology (Config.Loopback: no
// namespaces, a SOCKS5 client): the request reaches echo-0 through
// network-2's gateway, a tenant's gateway is ignored, and nothing is left
// behind.
func TestLoopbackDemo(t *testing.T) {
	bin := binDir(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var narration strings.Builder
	d, err := demo.Start(ctx, demo.Config{BinDir: bin, Out: &narration, Loopback: true})
	require.NoError(t, err, narration.String())
	run := d.RunDir()
	stopped := false
	defer func() {
		if !stopped {
			d.Stop()
		}
	}()
	requestCrossesGateway(ctx, t, d)
	_, err = d.WANRejected()
	require.ErrorIs(t, err, demo.ErrLoopback)
	t.Run("a tenant posing as network-2's gateway", func(t *testing.T) { tenantGateway(ctx, t, d, false) })
	d.Stop()
	stopped = true
	require.Empty(t, demo.ProcessesWithArg(run), "processes of the run left behind")
	require.NoDirExists(t, run)
}
