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

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"

	"github.com/isthmus-mesh/isthmus/cni/redirect"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns/netnstest"
)

// impostor gives the tenant's namespace the victim's address twice, as a
// tenant pod with NET_ADMIN in its own namespace can: on its loopback and on
// an interface of its own that is not a loopback (a veth pair inside its
// namespace; this kernel has no dummy links).
func (e *env) impostor(tenant *pod, victim netip.Addr) {
	e.t.Helper()
	h := netnstest.Handle(e.t, tenant.ns)
	lo, err := h.LinkByName("lo")
	require.NoError(e.t, err)
	netnstest.AddAddr(e.t, h, lo, netip.PrefixFrom(victim, 32))
	own := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "imp0"}, PeerName: "imp1"}
	require.NoError(e.t, h.LinkAdd(own))
	link, err := h.LinkByName("imp0")
	require.NoError(e.t, err)
	require.NoError(e.t, h.LinkSetUp(link))
	netnstest.AddAddr(e.t, h, link, netip.PrefixFrom(victim, 32))
}

// tenantNamespace is a namespace that is not in the mesh.
func (e *env) tenantNamespace() string {
	e.t.Helper()
	ns := "tenant-" + e.nodeName
	require.NoError(e.t, e.c.EnsureNamespace(context.Background(), ns, nil))
	return ns
}

// capturedOnlyInOwnSandbox checks that the victim is enrolled through its
// own namespace and the impostor not at all: rules only in the victim's
// namespace, ztunnel told of the victim only, the victim's outbound lands on
// the listener ztunnel opened in the namespace it was handed, and the
// impostor's traffic is not captured.
func (e *env) capturedOnlyInOwnSandbox(t *testing.T, z *ztunnel, victim, tenant *pod, nodeSrv *server) {
	t.Helper()
	vUID, tUID := string(victim.obj.UID), string(tenant.obj.UID)
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		assert.Equal(ct, []string{vUID}, z.h.Pods())
		ok, err := redirect.Present(victim.ns)
		assert.NoError(ct, err)
		assert.True(ct, ok, "the victim's own namespace has the rules")
	}, 20*time.Second, 20*time.Millisecond)
	require.False(t, hasRules(t, tenant), "the impostor's namespace never gets the victim's rules")
	for _, c := range z.h.Calls() {
		require.NotEqual(t, "add "+tUID, c)
	}
	require.Equal(t, vUID+" 15001", mustAsk(t, victim.ns, ap(tenant.ip, 8080)), "the victim stays captured, into the namespace ztunnel was handed")
	require.Equal(t, ap(tenant.ip, 8080), z.h.Next(t).OrigDst)
	require.Equal(t, "node", mustAsk(t, tenant.ns, ap(e.nodeIP, 9001)), "the impostor is not captured")
	nodeSrv.next(t)
	require.Equal(t, []netip.Addr{victim.ip}, e.probeSet())
}

func (e *env) eventually(t *testing.T, p *pod, reasons ...string) {
	t.Helper()
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		got := e.events(ct, p)
		for _, r := range reasons {
			assert.Contains(ct, got, r)
		}
	}, 20*time.Second, 50*time.Millisecond, "Events %v on pod %s", reasons, p.name)
}

// TestImpostorAfterAgentRestart: a victim pod running before the agent
// (enrolled from the API, as every pod is after an agent restart) and a
// tenant pod, not in the mesh, that put the victim's address on its
// loopback and on a veth of its own namespace (which sorts
// first among the runtime's namespaces). The victim is enrolled through its
// own sandbox, found by the kubelet's cgroup of its process; the tenant
// gets no rules and no handoff, and DuplicateAddress is reported on the
// victim. The same after another agent restart.
func TestImpostorAfterAgentRestart(t *testing.T) {
	e := newEnv(t)
	tenant := e.addPod(1, e.tenantNamespace(), "a-tenant")
	victim := e.addPod(2, e.mesh, "victim")
	e.create(tenant, nil, true)
	e.create(victim, nil, true)
	e.podProcess(tenant.ns, string(tenant.obj.UID))
	e.podProcess(victim.ns, string(victim.obj.UID))
	e.impostor(tenant, victim.ip)
	nodeSrv := serve(t, e.node, e.nodeIP.String()+":9001", "node")

	z := e.startZtunnel()
	e.startAgent(e.config())
	e.capturedOnlyInOwnSandbox(t, z, victim, tenant, nodeSrv)
	e.eventually(t, victim, "DuplicateAddress")
	require.Equal(t, 1.0, metric(t, e.reg, "isthmus_cni_sandbox_problems_total", map[string]string{"reason": "DuplicateAddress"}))
	require.Equal(t, 0.0, metric(t, e.reg, "isthmus_cni_sandbox_problems_total", map[string]string{"reason": "SandboxNotFound"}))

	e.stopAgent()
	e.startAgent(e.config())
	require.EventuallyWithT(t, func(ct *assert.CollectT) { assert.True(ct, z.client.Synced()) }, 20*time.Second, 20*time.Millisecond)
	e.capturedOnlyInOwnSandbox(t, z, victim, tenant, nodeSrv)
}

// TestImpostorWhenNamespaceLabelledLater: the same impostor, the victim's
// namespace labelled ambient while the agent runs.
func TestImpostorWhenNamespaceLabelledLater(t *testing.T) {
	e := newEnv(t)
	late := "late-" + e.nodeName
	ctx := context.Background()
	require.NoError(t, e.c.EnsureNamespace(ctx, late, nil))
	tenant := e.addPod(1, e.tenantNamespace(), "a-tenant")
	victim := e.addPod(2, late, "victim")
	e.create(tenant, nil, true)
	e.create(victim, nil, true)
	e.podProcess(tenant.ns, string(tenant.obj.UID))
	e.podProcess(victim.ns, string(victim.obj.UID))
	e.impostor(tenant, victim.ip)
	nodeSrv := serve(t, e.node, e.nodeIP.String()+":9001", "node")

	z := e.startZtunnel()
	e.startAgent(e.config())
	require.False(t, hasRules(t, victim), "not in the mesh yet")
	require.NoError(t, e.c.EnsureNamespace(ctx, late, map[string]string{"istio.io/dataplane-mode": "ambient"}))
	e.capturedOnlyInOwnSandbox(t, z, victim, tenant, nodeSrv)
	e.eventually(t, victim, "DuplicateAddress")
}

// TestSandboxNotTrusted: a running pod whose namespace carries its address
// but that has neither a record nor a process in its cgroup is not enrolled
// (an address proves nothing), nor is one whose process's namespace does not
// carry its address, nor one whose namespace has it on lo only (any process
// may put any address there); each gets its Event and its count, once.
func TestSandboxNotTrusted(t *testing.T) {
	e := newEnv(t)
	ghost := e.addPod(1, e.mesh, "ghost")
	moved := e.addPod(2, e.mesh, "moved")
	moved.ip = netip.MustParseAddr("10.250.99.2") // the API's address, on no interface of its sandbox
	onLo := e.addPod(3, e.mesh, "on-lo")
	onLo.ip = netip.MustParseAddr("10.250.98.2") // the API's address, on its sandbox's lo only
	h := netnstest.Handle(t, onLo.ns)
	lo, err := h.LinkByName("lo")
	require.NoError(t, err)
	netnstest.AddAddr(t, h, lo, netip.PrefixFrom(onLo.ip, 32))
	e.create(ghost, nil, true)
	e.create(moved, nil, true)
	e.create(onLo, nil, true)
	e.podProcess(moved.ns, string(moved.obj.UID))
	e.podProcess(onLo.ns, string(onLo.obj.UID))
	z := e.startZtunnel()
	e.startAgent(e.config())
	require.EventuallyWithT(t, func(ct *assert.CollectT) { assert.True(ct, z.client.Synced()) }, 20*time.Second, 20*time.Millisecond)

	e.eventually(t, ghost, "SandboxNotFound")
	e.eventually(t, moved, "SandboxAddressMismatch")
	e.eventually(t, onLo, "SandboxAddressMismatch")
	require.False(t, hasRules(t, ghost))
	require.False(t, hasRules(t, moved))
	require.False(t, hasRules(t, onLo), "an address on lo proves nothing")
	require.Empty(t, z.h.Pods())
	require.Empty(t, e.probeSet())
	// Retries (the work queue's backoff) report nothing new.
	require.Never(t, func() bool {
		return metric(t, e.reg, "isthmus_cni_sandbox_problems_total", map[string]string{"reason": "SandboxNotFound"}) != 1 ||
			metric(t, e.reg, "isthmus_cni_sandbox_problems_total", map[string]string{"reason": "SandboxAddressMismatch"}) != 2
	}, time.Second, 50*time.Millisecond)
	require.Equal(t, 0.0, metric(t, e.reg, "isthmus_cni_enrolled_pods", nil))
}

// record reads the agent's record of sandbox ctr-<name>.
func (e *env) record(p *pod) (map[string]any, string) {
	e.t.Helper()
	path := filepath.Join(e.stateDir, "ctr-"+p.name+".json")
	b, err := os.ReadFile(path)
	require.NoError(e.t, err)
	var rec map[string]any
	require.NoError(e.t, json.Unmarshal(b, &rec))
	return rec, path
}

// TestSandboxRecord: the agent records the sandbox of every ADD (0600 files
// in a 0700 directory) and forgets it on DEL; after a restart it enrols the
// pod through the recorded namespace (the pod has no process in a cgroup:
// only the record can name it); a record whose path was changed to another
// namespace (the tenant's, carrying the pod's address) is refused.
func TestSandboxRecord(t *testing.T) {
	e := newEnv(t)
	r := e.addPod(1, e.mesh, "rec")
	d := e.addPod(2, e.mesh, "del")
	tenant := e.addPod(3, e.tenantNamespace(), "a-tenant")
	e.create(r, nil, false)
	e.create(d, nil, false)
	e.create(tenant, nil, true)
	e.impostor(tenant, r.ip)
	z := e.startZtunnel()
	e.startAgent(e.config())

	require.NoError(t, e.cni("ADD", r, r.ip).err)
	e.running(r)
	rec, path := e.record(r)
	require.Equal(t, string(r.obj.UID), rec["podUID"])
	require.Equal(t, r.netnsPath, rec["netns"])
	st, err := os.Stat(path)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm())
	st, err = os.Stat(e.stateDir)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), st.Mode().Perm())

	require.NoError(t, e.cni("ADD", d, d.ip).err)
	_, dPath := e.record(d)
	require.NoError(t, e.cni("DEL", d, d.ip).err)
	_, err = os.Stat(dPath)
	require.ErrorIs(t, err, os.ErrNotExist, "DEL removes the record")

	t.Run("after a restart the recorded sandbox is enrolled", func(t *testing.T) {
		e.stopAgent()
		e.startAgent(e.config())
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			assert.True(ct, z.client.Synced())
			assert.Equal(ct, []string{string(r.obj.UID)}, z.h.Pods())
		}, 20*time.Second, 20*time.Millisecond)
		require.Equal(t, 1.0, metric(t, e.reg, "isthmus_cni_enrolled_pods", nil))
		require.True(t, hasRules(t, r))
		require.False(t, hasRules(t, tenant))
		require.Equal(t, string(r.obj.UID)+" 15001", mustAsk(t, r.ns, ap(tenant.ip, 8080)))
		z.h.Next(t)
		require.NoError(t, e.cni("CHECK", r, r.ip).err)
		// The record keeps its sandbox ID: a DEL by sandbox still finds it.
		require.NotContains(t, e.events(t, r), "SandboxNotFound")
	})

	t.Run("a record pointing at another namespace is refused", func(t *testing.T) {
		e.stopAgent()
		rec, path := e.record(r)
		rec["netns"] = tenant.netnsPath
		b, err := json.Marshal(rec)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(path, b, 0o600))
		e.startAgent(e.config())
		e.eventually(t, r, "SandboxRecordMismatch", "SandboxNotFound")
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			assert.True(ct, z.client.Synced())
			assert.Empty(ct, z.h.Pods())
		}, 20*time.Second, 20*time.Millisecond)
		require.False(t, hasRules(t, tenant), "the impostor never gets the pod's rules")
		require.Equal(t, 0.0, metric(t, e.reg, "isthmus_cni_enrolled_pods", nil))
		require.Equal(t, 1.0, metric(t, e.reg, "isthmus_cni_sandbox_problems_total", map[string]string{"reason": "SandboxRecordMismatch"}))
		_, err = os.Stat(path)
		require.ErrorIs(t, err, os.ErrNotExist, "the refused record is dropped")
	})
}
