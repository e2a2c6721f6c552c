//go:build linux

package agent_test

import (
	"context"
	"encoding/json"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/cni/plugin"
	"github.com/isthmus-mesh/isthmus/cni/redirect"
)

func ap(a netip.Addr, port uint16) netip.AddrPort { return netip.AddrPortFrom(a, port) }

func hasRules(t *testing.T, p *pod) bool {
	t.Helper()
	ok, err := redirect.Present(p.ns)
	require.NoError(t, err)
	return ok
}

func (e *env) probeSet() []netip.Addr {
	e.t.Helper()
	got, err := redirect.NodeAddrs(e.node)
	require.NoError(e.t, err)
	return got
}

// TestEnrolment runs a node with pods a and b (namespace labelled ambient),
// c (same namespace, labelled dataplane-mode=none) and d (kube-system), the
// real agent, the real plugin binary run as a runtime runs it, and a ztunnel
// whose handler listens in each pod's namespace; then walks through
// enrolment, capture, probes, label changes, a ztunnel restart and DEL.
func TestEnrolment(t *testing.T) {
	e := newEnv(t)
	a := e.addPod(1, e.mesh, "a")
	b := e.addPod(2, e.mesh, "b")
	c := e.addPod(3, e.mesh, "c")
	d := e.addPod(4, "kube-system", "d-"+e.nodeName)
	// b ran before the agent started: it is found by its cgroup (its
	// process sits in the kubelet's cgroup of the pod).
	e.create(b, nil, true)
	e.podProcess(b.ns, string(b.obj.UID))
	e.create(a, nil, false)
	e.create(c, map[string]string{"istio.io/dataplane-mode": "none"}, false)
	e.create(d, nil, false)

	z := e.startZtunnel()
	e.startAgent(e.config())

	t.Run("the plugin is installed last in the conflist", func(t *testing.T) {
		st, err := os.Stat(filepath.Join(e.binDir, plugin.Name))
		require.NoError(t, err)
		require.NotZero(t, st.Mode()&0o111, "executable")
		e.pluginConf(netip.Addr{}, "") // asserts the entry is last
	})
	t.Run("a pod running before the agent is enrolled", func(t *testing.T) {
		require.True(t, hasRules(t, b))
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			assert.Equal(ct, []string{string(b.obj.UID)}, z.h.Pods())
		}, 20*time.Second, 20*time.Millisecond)
		require.Equal(t, []netip.Addr{b.ip}, e.probeSet())
	})

	t.Run("ADD enrols a pod of an ambient namespace and passes the result through", func(t *testing.T) {
		res := e.cni("ADD", a, a.ip)
		require.NoError(t, res.err)
		var out current.Result
		require.NoError(t, json.Unmarshal(res.stdout, &out))
		require.Len(t, out.IPs, 1)
		require.Equal(t, a.ip.String()+"/24", out.IPs[0].Address.String())
		require.True(t, hasRules(t, a), "rules are in place when ADD returns")
		require.Contains(t, z.h.Pods(), string(a.obj.UID), "ztunnel has the pod when ADD returns")
		require.Equal(t, []netip.Addr{a.ip, b.ip}, e.probeSet())
		e.running(a)
		require.NoError(t, e.cni("CHECK", a, a.ip).err)
	})
	t.Run("ADD of an opted-out or excluded pod succeeds without rules", func(t *testing.T) {
		for _, p := range []*pod{c, d} {
			require.NoError(t, e.cni("ADD", p, p.ip).err)
			require.False(t, hasRules(t, p), p.name)
			e.running(p)
			require.NoError(t, e.cni("CHECK", p, p.ip).err)
		}
		require.Len(t, z.h.Pods(), 2)
	})

	bApp := serve(t, b.ns, "[::]:8080", "b-app")
	aLoop := serve(t, a.ns, "127.0.0.1:9000", "a-loopback")
	nodeSrv := serve(t, e.node, e.nodeIP.String()+":9001", "node")
	aUID, bUID := string(a.obj.UID), string(b.obj.UID)

	t.Run("outbound from a is redirected to a's 15001 with b's address as original destination", func(t *testing.T) {
		require.Equal(t, aUID+" 15001", mustAsk(t, a.ns, ap(b.ip, 8080)))
		got := z.h.Next(t)
		require.Equal(t, ap(b.ip, 8080), got.OrigDst)
		require.Equal(t, a.ip, got.Remote.Addr())
	})
	t.Run("inbound to b lands on b's 15006, HBONE on 15008 as sent", func(t *testing.T) {
		require.Equal(t, bUID+" 15006", mustAsk(t, c.ns, ap(b.ip, 8080)))
		got := z.h.Next(t)
		require.Equal(t, ap(b.ip, 8080), got.OrigDst)
		require.Equal(t, c.ip, got.Remote.Addr())
		require.Equal(t, bUID+" 15008", mustAsk(t, c.ns, ap(b.ip, 15008)))
		require.Equal(t, uint16(15008), z.h.Next(t).Port)
	})
	t.Run("a probe from the node reaches b's app directly", func(t *testing.T) {
		require.Equal(t, "b-app", mustAsk(t, e.node, ap(b.ip, 8080)))
		require.Equal(t, redirect.ProbeAddr4, bApp.next(t).Addr())
	})
	t.Run("a's loopback and its traffic to the node are untouched", func(t *testing.T) {
		require.Equal(t, "a-loopback", mustAsk(t, a.ns, netip.MustParseAddrPort("127.0.0.1:9000")))
		aLoop.next(t)
		require.Equal(t, "node", mustAsk(t, a.ns, ap(e.nodeIP, 9001)))
		require.Equal(t, a.ip, nodeSrv.next(t).Addr())
	})
	t.Run("a pod that is not enrolled is not captured", func(t *testing.T) {
		require.Equal(t, "node", mustAsk(t, c.ns, ap(e.nodeIP, 9001)))
		nodeSrv.next(t)
		require.Equal(t, "node", mustAsk(t, d.ns, ap(e.nodeIP, 9001)))
		nodeSrv.next(t)
		require.True(t, z.h.Idle())
	})

	t.Run("label changes enrol and release a running pod", func(t *testing.T) {
		e.relabel(c, nil)
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			ok, err := redirect.Present(c.ns)
			assert.NoError(ct, err)
			assert.True(ct, ok)
			assert.Contains(ct, z.h.Pods(), string(c.obj.UID))
		}, 20*time.Second, 20*time.Millisecond)
		require.Equal(t, string(c.obj.UID)+" 15001", mustAsk(t, c.ns, ap(b.ip, 9999)), "c is captured now")
		z.h.Next(t)
		require.Equal(t, []netip.Addr{a.ip, b.ip, c.ip}, e.probeSet())

		e.relabel(c, map[string]string{"istio.io/dataplane-mode": "none"})
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			ok, err := redirect.Present(c.ns)
			assert.NoError(ct, err)
			assert.False(ct, ok)
			assert.NotContains(ct, z.h.Pods(), string(c.obj.UID))
		}, 20*time.Second, 20*time.Millisecond)
		require.Equal(t, "node", mustAsk(t, c.ns, ap(e.nodeIP, 9001)))
		nodeSrv.next(t)
	})
	t.Run("the namespace label enrols and releases its pods", func(t *testing.T) {
		ctx := context.Background()
		require.NoError(t, e.c.EnsureNamespace(ctx, e.mesh, nil))
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			assert.Empty(ct, z.h.Pods())
			for _, p := range []*pod{a, b} {
				ok, err := redirect.Present(p.ns)
				assert.NoError(ct, err)
				assert.False(ct, ok)
			}
			// The probe set is synced last in a release, after ztunnel
			// and the pod's rules.
			got, err := redirect.NodeAddrs(e.node)
			assert.NoError(ct, err)
			assert.Empty(ct, got)
		}, 20*time.Second, 20*time.Millisecond)
		require.NoError(t, e.c.EnsureNamespace(ctx, e.mesh, map[string]string{"isthmus.io/dataplane-mode": "ambient"}))
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			assert.Equal(ct, []string{aUID, bUID}, sortedPair(aUID, bUID, z.h.Pods()))
		}, 20*time.Second, 20*time.Millisecond)
		require.True(t, hasRules(t, a))
		require.True(t, hasRules(t, b))
	})

	t.Run("a pod's own label enrols it where its namespace is not enrolled, and opts it out where it is", func(t *testing.T) {
		ctx := context.Background()
		cUID := string(c.obj.UID)
		require.NoError(t, e.c.EnsureNamespace(ctx, e.mesh, nil))
		require.EventuallyWithT(t, func(ct *assert.CollectT) { assert.Empty(ct, z.h.Pods()) }, 20*time.Second, 20*time.Millisecond)
		e.relabel(c, map[string]string{"istio.io/dataplane-mode": "ambient"})
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			ok, err := redirect.Present(c.ns)
			assert.NoError(ct, err)
			assert.True(ct, ok)
			assert.Equal(ct, []string{cUID}, z.h.Pods())
		}, 20*time.Second, 20*time.Millisecond)
		require.Equal(t, cUID+" 15001", mustAsk(t, c.ns, ap(b.ip, 9999)), "c is captured, alone in its namespace")
		z.h.Next(t)
		require.False(t, hasRules(t, a), "a pod's label decides for that pod only")

		// Back: the namespace enrolled, c opted out by its label.
		e.relabel(c, map[string]string{"istio.io/dataplane-mode": "none"})
		require.NoError(t, e.c.EnsureNamespace(ctx, e.mesh, map[string]string{"isthmus.io/dataplane-mode": "ambient"}))
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			assert.Equal(ct, []string{aUID, bUID}, sortedPair(aUID, bUID, z.h.Pods()))
			ok, err := redirect.Present(c.ns)
			assert.NoError(ct, err)
			assert.False(ct, ok)
		}, 20*time.Second, 20*time.Millisecond)
		require.True(t, hasRules(t, a))
	})

	t.Run("while ztunnel is away captured traffic fails closed; a restarted ztunnel gets the full snapshot", func(t *testing.T) {
		z.stop()
		_, err := ask(a.ns, ap(b.ip, 8080))
		require.ErrorIs(t, err, unix.ECONNREFUSED, "a's outbound is not bypassed")
		_, err = ask(c.ns, ap(b.ip, 8080))
		require.ErrorIs(t, err, unix.ECONNREFUSED, "nothing reaches b in plaintext from outside the mesh")
		require.Empty(t, bApp.got)
		require.True(t, hasRules(t, a))

		z2 := e.startZtunnel()
		require.EventuallyWithT(t, func(ct *assert.CollectT) { assert.True(ct, z2.client.Synced()) }, 20*time.Second, 20*time.Millisecond)
		calls := z2.h.Calls()
		require.Len(t, calls, 3)
		require.ElementsMatch(t, []string{"add " + aUID, "add " + bUID}, calls[:2])
		require.Equal(t, "snapshot "+sortedList(aUID, bUID), calls[2])
		require.Equal(t, aUID+" 15001", mustAsk(t, a.ns, ap(b.ip, 8080)))
		z = z2
	})

	t.Run("DEL removes the pod's rules, listeners and probe address", func(t *testing.T) {
		require.NoError(t, e.cni("DEL", a, a.ip).err)
		require.False(t, hasRules(t, a))
		require.Equal(t, []string{bUID}, z.h.Pods())
		require.Equal(t, []netip.Addr{b.ip}, e.probeSet())
		require.Equal(t, bUID+" 15006", mustAsk(t, a.ns, ap(b.ip, 8080)), "a is plain now, b still captured")
		require.NoError(t, e.cni("DEL", a, a.ip).err, "DEL is idempotent")
		// The kubelet tears the sandbox down because the pod is being
		// deleted; without a kubelet here the pod stays terminating, and a
		// terminating pod is not enrolled again.
		require.NoError(t, e.c.Client.CoreV1().Pods(a.namespace).Delete(context.Background(), a.name, metav1.DeleteOptions{}))
		require.Equal(t, 3.0, metric(t, e.reg, "isthmus_cni_plugin_events_total", map[string]string{"command": "ADD", "result": "ok"}))
		require.Equal(t, 3.0, metric(t, e.reg, "isthmus_cni_plugin_events_total", map[string]string{"command": "CHECK", "result": "ok"}))
		require.Equal(t, 2.0, metric(t, e.reg, "isthmus_cni_plugin_events_total", map[string]string{"command": "DEL", "result": "ok"}))
		require.Equal(t, 1.0, metric(t, e.reg, "isthmus_cni_plugin_installs_total", map[string]string{"what": "binary"}))
	})

	t.Run("an agent restart keeps the rules, and the new agent takes the pods back", func(t *testing.T) {
		e.stopAgent()
		require.True(t, hasRules(t, b), "pods stay captured while no agent runs")
		require.Equal(t, []netip.Addr{b.ip}, e.probeSet())
		require.EventuallyWithT(t, func(ct *assert.CollectT) { assert.False(ct, z.client.Synced()) }, 20*time.Second, 20*time.Millisecond)
		require.Equal(t, bUID+" 15006", mustAsk(t, a.ns, ap(b.ip, 8080)), "ztunnel keeps serving")
		z.h.Next(t)

		e.startAgent(e.config())
		require.EventuallyWithT(t, func(ct *assert.CollectT) { assert.True(ct, z.client.Synced()) }, 20*time.Second, 20*time.Millisecond)
		require.Equal(t, []string{bUID}, z.h.Pods())
		require.Equal(t, 1.0, metric(t, e.reg, "isthmus_cni_enrolled_pods", nil))
		require.True(t, hasRules(t, b))
		require.False(t, hasRules(t, a))
		require.Equal(t, "b-app", mustAsk(t, e.node, ap(b.ip, 8080)), "probes still reach b")
		require.Equal(t, redirect.ProbeAddr4, bApp.next(t).Addr())
	})

	t.Run("metrics", func(t *testing.T) {
		// The restarted agent's registry: one pod enrolled, one ztunnel,
		// and the plugin already in place (nothing written), one CHECK.
		require.Equal(t, 1.0, metric(t, e.reg, "isthmus_cni_enrolled_pods", nil))
		require.Equal(t, 1.0, metric(t, e.reg, "isthmus_cni_ztunnel_connections", nil))
		require.Equal(t, 0.0, metric(t, e.reg, "isthmus_cni_plugin_installs_total", map[string]string{"what": "binary"}))
		require.NoError(t, e.cni("CHECK", b, b.ip).err)
		require.Equal(t, 1.0, metric(t, e.reg, "isthmus_cni_plugin_events_total", map[string]string{"command": "CHECK", "result": "ok"}))
		require.Equal(t, 0.0, metric(t, e.reg, "isthmus_cni_enrolment_failures_total", nil))
	})
}

func sortedList(a, b string) string {
	if b < a {
		a, b = b, a
	}
	return "[" + a + " " + b + "]"
}

// sortedPair returns got when it holds exactly a and b, in the order a, b.
func sortedPair(a, b string, got []string) []string {
	if len(got) == 2 && got[0] == b && got[1] == a {
		return []string{a, b}
	}
	return got
}
