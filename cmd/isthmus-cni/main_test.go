//go:build linux

package main

import (
	"bytes"
	"context"
	"log/slog"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/isthmus-mesh/isthmus/cni/agent"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func capture(t *testing.T, args ...string) (agent.Config, string, error) {
	t.Helper()
	var (
		got        agent.Config
		kubeconfig string
	)
	cmd := newCommand(&bytes.Buffer{}, func(_ context.Context, cfg agent.Config, kc string, _ *slog.Logger) error {
		got, kubeconfig = cfg, kc
		return nil
	})
	cmd.SetArgs(args)
	err := cmd.ExecuteContext(context.Background())
	return got, kubeconfig, err
}

// TestFlagsToConfig proves the flags the cni chart passes land in the
// agent.Config fields they name, and unset ones keep the agent's defaults.
func TestFlagsToConfig(t *testing.T) {
	t.Setenv("NODE_NAME", "env-node")
	t.Setenv("POD_NAMESPACE", "mesh-system")
	cfg, kc, err := capture(t, "agent", "--cni-bin-dir=/host/opt/cni/bin", "--cni-conf-dir=/host/etc/cni/net.d",
		"--plugin-socket=/s/plugin.sock", "--ztunnel-socket=/s/ztunnel.sock", "--plugin-timeout=7s",
		"--netns-dir=/var/run/netns", "--netns-dir=/run/docker/netns", "--proc-dir=/host/proc", "--monitoring-addr=:15014",
		"--state-dir=/var/run/isthmus/cni-state", "--pod-cgroup-root=/kubepods,/kubelet.slice/kubelet-kubepods.slice",
		"--excluded-namespaces=kube-system,legacy", "--redirect-dns", "--uninstall-on-exit",
		"--node-addresses=10.0.0.5,fd00::5", "--kubeconfig=/k", "--log-level=debug")
	require.NoError(t, err)
	require.Equal(t, "/k", kc)
	require.Equal(t, agent.Config{
		NodeName: "env-node", SystemNamespace: "mesh-system", ExcludedNamespaces: []string{"kube-system", "legacy"},
		CNIBinDir: "/host/opt/cni/bin", CNIConfDir: "/host/etc/cni/net.d", UninstallOnExit: true,
		InstallCheckInterval: agent.DefaultConfig().InstallCheckInterval,
		PluginSocket:         "/s/plugin.sock", ZtunnelSocket: "/s/ztunnel.sock", PluginTimeout: 7 * time.Second,
		ZtunnelProtocol: agent.ZtunnelProtocolIsthmus,
		AckTimeout:      agent.DefaultConfig().AckTimeout, NetnsDirs: []string{"/var/run/netns", "/run/docker/netns"},
		ProcDir: "/host/proc", StateDir: "/var/run/isthmus/cni-state",
		PodCgroupRoots: []string{"/kubepods", "/kubelet.slice/kubelet-kubepods.slice"}, NodeAddresses: []netip.Addr{netip.MustParseAddr("10.0.0.5"), netip.MustParseAddr("fd00::5")},
		RedirectDNS: true, MonitoringAddr: ":15014", ShutdownTimeout: agent.DefaultConfig().ShutdownTimeout,
	}, cfg)

	cfg, _, err = capture(t, "agent")
	require.NoError(t, err)
	require.Nil(t, cfg.ExcludedNamespaces, "unset: the agent's default list")
	cfg, _, err = capture(t, "agent", "--excluded-namespaces=")
	require.NoError(t, err)
	require.Equal(t, []string{}, cfg.ExcludedNamespaces, "set empty: exclude nothing")

	cfg, _, err = capture(t, "agent", "--ztunnel-uids=1337,2000", "--node-cgroupns=/host/proc/1/ns/cgroup")
	require.NoError(t, err)
	require.Equal(t, []uint32{1337, 2000}, cfg.ZtunnelUIDs)
	require.Equal(t, "/host/proc/1/ns/cgroup", cfg.NodeCgroupNS)
	cfg, _, err = capture(t, "agent", "--ztunnel-protocol=istio", "--ztunnel-mark-only")
	require.NoError(t, err)
	require.Equal(t, agent.ZtunnelProtocolIstio, cfg.ZtunnelProtocol)
	require.True(t, cfg.ZtunnelMarkOnly)
	require.Empty(t, cfg.ZtunnelSocket, "unset: the agent's default for the protocol (Istio's path)")
	_, _, err = capture(t, "agent", "--ztunnel-uids=4294967296")
	require.ErrorContains(t, err, "--ztunnel-uids")

	_, _, err = capture(t, "agent", "--node-addresses=not-an-ip")
	require.ErrorContains(t, err, "--node-addresses")
	_, _, err = capture(t, "agent", "--log-format=xml")
	require.ErrorContains(t, err, "--log-format")
}
