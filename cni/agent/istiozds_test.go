//go:build linux

package agent_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/cni/agent"
	"github.com/isthmus-mesh/isthmus/ztunnel/inpod"
	"github.com/isthmus-mesh/isthmus/ztunnel/inpod/inpodtest"
)

// startIstioZtunnel runs a ztunnel speaking Istio's ZDS on the agent's
// socket (the Isthmus ztunnel's client with inpod.ProtocolIstio).
func (e *env) startIstioZtunnel() (*inpod.Client, *inpodtest.Handler, func()) {
	e.t.Helper()
	h := inpodtest.New(e.t)
	c, err := inpod.New(inpod.Config{SocketPath: e.zSock, Protocol: inpod.ProtocolIstio,
		InitialBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond}, inpod.Deps{Handler: h})
	require.NoError(e.t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			cancel()
			require.NoError(e.t, <-done)
			h.Close()
		}
	}
	e.t.Cleanup(stop)
	return c, h, stop
}

// TestIstioZDS: with ZtunnelProtocol "istio" the agent serves Istio's ZDS
// on its socket, and a ztunnel speaking it gets the pods the plugin's ADD
// enrols and loses them at DEL. This test process sees the node's whole
// cgroup hierarchy, so the kernel's record of it names no cgroup of its
// own: refused and counted by default, the pods' rules exempting nothing;
// accepted with the mark-only exemption under ZtunnelMarkOnly.
func TestIstioZDS(t *testing.T) {
	e := newEnv(t)
	cfg := e.config()
	cfg.ZtunnelProtocol = agent.ZtunnelProtocolIstio
	cfg.NodeCgroupNS = "/proc/self/ns/cgroup"
	e.startAgent(cfg)
	a := e.addPod(1, e.mesh, "a")
	e.create(a, nil, false)
	require.NoError(t, e.cni("ADD", a, a.ip).err, "enrolled with no ztunnel there")

	c, h, stop := e.startIstioZtunnel()
	refused := map[string]string{"reason": "peer-cgroup-unknown"}
	require.Eventually(t, func() bool { return metric(t, e.reg, "isthmus_cni_ztunnel_refused_total", refused) >= 1 },
		20*time.Second, 20*time.Millisecond)
	require.False(t, c.Synced())
	require.Empty(t, h.Pods())
	require.Equal(t, exemption{}, exemptionOf(t, a), "a refused ztunnel exempts nothing")
	stop()
	e.running(a) // the restarted agent takes it back
	e.stopAgent()

	cfg.ZtunnelMarkOnly = true
	e.startAgent(cfg)
	c, h, _ = e.startIstioZtunnel()
	uid := string(a.obj.UID)
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		assert.True(ct, c.Synced())
		assert.Equal(ct, []string{uid}, h.Pods())
	}, 20*time.Second, 20*time.Millisecond)
	require.Equal(t, exemption{markOnly: true}, exemptionOf(t, a))
	require.Equal(t, 1.0, metric(t, e.reg, "isthmus_cni_capture_mark_only", nil))
	require.Equal(t, 1.0, metric(t, e.reg, "isthmus_cni_ztunnel_connections", nil))

	b := e.addPod(2, e.mesh, "b")
	e.create(b, nil, false)
	require.NoError(t, e.cni("ADD", b, b.ip).err)
	require.Contains(t, h.Pods(), string(b.obj.UID), "the ztunnel has the pod when ADD returns")
	require.NoError(t, e.cni("DEL", a, a.ip).err)
	require.Equal(t, []string{string(b.obj.UID)}, h.Pods())
}
