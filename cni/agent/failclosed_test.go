//go:build linux

package agent_test

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/cni/plugin"
)

// cniError decodes the error a failed plugin run printed.
func cniError(t *testing.T, res cniResult) *types.Error {
	t.Helper()
	require.Error(t, res.err, "the plugin must fail")
	var e types.Error
	require.NoError(t, json.Unmarshal(res.stdout, &e), "the plugin prints a CNI error: %s", res.stdout)
	return &e
}

// TestAddFailsClosed: an ADD of a pod that should be enrolled fails, with
// a clear CNI error and nothing left behind, when ztunnel refuses the pod,
// when the pod cannot be looked up, and when the agent is unreachable; a
// DEL still succeeds without the agent.
func TestAddFailsClosed(t *testing.T) {
	e := newEnv(t)
	a := e.addPod(1, e.mesh, "a")
	e.create(a, nil, false)
	z := e.startZtunnel()
	e.startAgent(e.config())
	require.EventuallyWithT(t, func(ct *assert.CollectT) { assert.True(ct, z.client.Synced()) }, 20*time.Second, 20*time.Millisecond)

	t.Run("ztunnel refuses the pod", func(t *testing.T) {
		z.h.Refuse(string(a.obj.UID))
		ce := cniError(t, e.cni("ADD", a, a.ip))
		require.Equal(t, types.ErrInternal, ce.Code)
		require.Contains(t, ce.Msg, "refused ADD of pod "+e.mesh+"/a")
		require.Contains(t, ce.Details, "ztunnel-refused")
		require.False(t, hasRules(t, a), "a failed ADD leaves no rules")
		require.Empty(t, e.probeSet())
		require.Equal(t, 1.0, metric(t, e.reg, "isthmus_cni_enrolment_failures_total", map[string]string{"reason": "ztunnel-refused"}))
		require.Equal(t, 1.0, metric(t, e.reg, "isthmus_cni_plugin_events_total", map[string]string{"command": "ADD", "result": "error"}))
		require.Equal(t, 0.0, metric(t, e.reg, "isthmus_cni_enrolled_pods", nil))
	})
	t.Run("CHECK reports a pod that should be enrolled and is not", func(t *testing.T) {
		ce := cniError(t, e.cni("CHECK", a, a.ip))
		require.Contains(t, ce.Details, "should be enrolled but is not")
	})
	t.Run("the pod cannot be looked up", func(t *testing.T) {
		ghost := e.addPod(2, e.mesh, "ghost")
		ce := cniError(t, e.cni("ADD", ghost, ghost.ip))
		require.Contains(t, ce.Details, "get pod")
		require.False(t, hasRules(t, ghost))
		require.Equal(t, 1.0, metric(t, e.reg, "isthmus_cni_enrolment_failures_total", map[string]string{"reason": "pod-lookup"}))
	})
	t.Run("the plugin must be chained", func(t *testing.T) {
		ce := cniError(t, e.cni("ADD", a, netip.Addr{}))
		require.Equal(t, types.ErrInvalidNetworkConfig, ce.Code)
		require.Contains(t, ce.Msg, "chained")
	})
	t.Run("without the API server, excluded pods still start and unknown ones fail closed", func(t *testing.T) {
		require.NoError(t, e.c.StopAPIServer())
		t.Cleanup(func() { require.NoError(t, e.c.RestartAPIServer()) })
		sys := e.addPod(3, "kube-system", "sys-"+e.nodeName)
		require.NoError(t, e.cni("ADD", sys, sys.ip).err, "a kube-system pod is answered without the API server")
		require.False(t, hasRules(t, sys))
		unknown := e.addPod(4, e.mesh, "unknown")
		ce := cniError(t, e.cni("ADD", unknown, unknown.ip))
		require.Contains(t, ce.Details, "get pod")
	})
	t.Run("the agent is unreachable", func(t *testing.T) {
		e.stopAgent()
		ce := cniError(t, e.cni("ADD", a, a.ip))
		require.Equal(t, types.ErrTryAgainLater, ce.Code)
		require.Contains(t, ce.Msg, "unreachable")
		require.NoError(t, e.cni("DEL", a, a.ip).err, "DEL does not need the agent")
	})
}

// TestInstallRepairs: the agent puts the binary and its conflist entry
// back when they are removed or changed, and keeps the other plugins.
func TestInstallRepairs(t *testing.T) {
	e := newEnv(t)
	e.startAgent(e.config())
	bin := filepath.Join(e.binDir, plugin.Name)
	conflist := filepath.Join(e.confDir, "10-test.conflist")
	want, err := os.ReadFile(pluginBinary(t))
	require.NoError(t, err)

	require.NoError(t, os.Remove(bin))
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		got, err := os.ReadFile(bin)
		assert.NoError(ct, err)
		assert.Equal(ct, len(want), len(got))
	}, 20*time.Second, 50*time.Millisecond, "a removed binary is reinstalled")

	require.NoError(t, os.WriteFile(bin, []byte("#!/bin/sh\nexit 0\n"), 0o755))
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		got, err := os.ReadFile(bin)
		assert.NoError(ct, err)
		assert.Equal(ct, len(want), len(got))
	}, 20*time.Second, 50*time.Millisecond, "a replaced binary is reinstalled")

	// The network plugin rewrites its conflist without us.
	require.NoError(t, os.WriteFile(conflist,
		[]byte(`{"cniVersion": "1.0.0", "name": "test-net", "plugins": [{"type": "ptp"}, {"type": "portmap", "capabilities": {"portMappings": true}}]}`), 0o644))
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		b, err := os.ReadFile(conflist)
		assert.NoError(ct, err)
		var doc struct {
			Plugins []map[string]any `json:"plugins"`
		}
		assert.NoError(ct, json.Unmarshal(b, &doc))
		var types []string
		for _, p := range doc.Plugins {
			types = append(types, p["type"].(string))
		}
		assert.Equal(ct, []string{"ptp", "portmap", plugin.Name}, types)
	}, 20*time.Second, 50*time.Millisecond)
	entry := string(e.pluginConf(netip.Addr{}, ""))
	require.True(t, strings.Contains(entry, e.pSock), "the entry names the agent's socket: %s", entry)
	// Counted once the write is done: the files can be seen before.
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		assert.GreaterOrEqual(ct, metric(t, e.reg, "isthmus_cni_plugin_installs_total", map[string]string{"what": "binary"}), 3.0)
		assert.GreaterOrEqual(ct, metric(t, e.reg, "isthmus_cni_plugin_installs_total", map[string]string{"what": "conflist"}), 2.0)
	}, 20*time.Second, 50*time.Millisecond)
}

// TestInstallConvertsSingleConf: when the runtime's first network
// configuration is a single-plugin *.conf (which cannot chain a plugin),
// the agent turns it into a conflist of the same name holding that plugin
// and its own entry, and removes the .conf; the conflist is then the first
// file, so pods of that network are enrolled.
func TestInstallConvertsSingleConf(t *testing.T) {
	e := newEnv(t)
	single := filepath.Join(e.confDir, "05-single.conf")
	require.NoError(t, os.WriteFile(single,
		[]byte(`{"cniVersion": "1.0.0", "name": "single-net", "type": "ptp", "ipam": {"type": "host-local"}}`), 0o644))
	e.startAgent(e.config())
	list := filepath.Join(e.confDir, "05-single.conflist")
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		b, err := os.ReadFile(list)
		if !assert.NoError(ct, err) {
			return
		}
		var doc struct {
			CNIVersion string           `json:"cniVersion"`
			Name       string           `json:"name"`
			Plugins    []map[string]any `json:"plugins"`
		}
		assert.NoError(ct, json.Unmarshal(b, &doc))
		assert.Equal(ct, "1.0.0", doc.CNIVersion)
		assert.Equal(ct, "single-net", doc.Name)
		if assert.Len(ct, doc.Plugins, 2) {
			assert.Equal(ct, "ptp", doc.Plugins[0]["type"])
			assert.Equal(ct, map[string]any{"type": "host-local"}, doc.Plugins[0]["ipam"])
			assert.Equal(ct, plugin.Name, doc.Plugins[1]["type"])
		}
	}, 20*time.Second, 50*time.Millisecond)
	_, err := os.Stat(single)
	require.ErrorIs(t, err, os.ErrNotExist, "the .conf is replaced by the conflist")

	// The network plugin writes its .conf again: converted again.
	require.NoError(t, os.WriteFile(single, []byte(`{"cniVersion": "1.0.0", "name": "single-net", "type": "bridge"}`), 0o644))
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		_, err := os.Stat(single)
		assert.ErrorIs(ct, err, os.ErrNotExist)
		b, err := os.ReadFile(list)
		assert.NoError(ct, err)
		assert.Contains(ct, string(b), `"bridge"`)
	}, 20*time.Second, 50*time.Millisecond)

	// A broken first file is reported and left alone.
	broken := filepath.Join(e.confDir, "01-broken.conf")
	require.NoError(t, os.WriteFile(broken, []byte(`{"name": "x"}`), 0o644))
	require.Never(t, func() bool { _, err := os.Stat(broken); return err != nil }, 500*time.Millisecond, 50*time.Millisecond)
}

// TestUninstallReleasesPods: an agent stopping with UninstallOnExit takes
// its plugin out of the conflist and every enrolled pod out of the mesh
// (rules removed, ztunnel told), so that the pods keep their plain
// networking; without it a stop leaves both in place (the restart case).
func TestUninstallReleasesPods(t *testing.T) {
	for _, uninstall := range []bool{false, true} {
		t.Run(fmt.Sprintf("uninstallOnExit=%v", uninstall), func(t *testing.T) {
			e := newEnv(t)
			a := e.addPod(1, e.mesh, "a")
			e.create(a, nil, false)
			z := e.startZtunnel()
			cfg := e.config()
			cfg.UninstallOnExit = uninstall
			e.startAgent(cfg)
			require.NoError(t, e.cni("ADD", a, a.ip).err)
			e.running(a)
			require.True(t, hasRules(t, a))
			require.Equal(t, []string{string(a.obj.UID)}, z.h.Pods())

			e.stopAgent()
			require.Equal(t, !uninstall, hasRules(t, a), "the pod's rules after the agent stopped")
			_, err := os.Stat(filepath.Join(e.binDir, plugin.Name))
			require.Equal(t, uninstall, os.IsNotExist(err), "the plugin binary after the agent stopped: %v", err)
			if uninstall {
				require.Empty(t, e.probeSet(), "the node's probe rules follow the released pods")
			}
		})
	}
}
