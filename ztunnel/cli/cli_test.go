package cli

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/isthmus-mesh/isthmus/internal/version"
	"github.com/isthmus-mesh/isthmus/ztunnel/node"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// capture runs the command with args and returns the config it would run.
func capture(t *testing.T, args ...string) (node.Config, node.Deps, error) {
	t.Helper()
	var (
		got  node.Config
		deps node.Deps
	)
	cmd := NewCommand(&bytes.Buffer{}, func(_ context.Context, cfg node.Config, d node.Deps) error {
		got, deps = cfg, d
		return nil
	})
	cmd.SetArgs(args)
	err := cmd.ExecuteContext(context.Background())
	return got, deps, err
}

// TestFlagsToConfig proves the flags the Helm charts pass land in the
// node.Config fields they name, and that unset flags keep node's defaults.
func TestFlagsToConfig(t *testing.T) {
	t.Setenv("NODE_NAME", "env-node")
	t.Setenv("POD_NAMESPACE", "mesh")
	cfg, deps, err := capture(t,
		"--mode=gateway", "--cluster-id=c1", "--network=n1", "--trust-domain=example.org",
		"--xds-address=isthmusd.mesh.svc:15012", "--ca-address=isthmusd.mesh.svc:15012",
		"--ca-token=/tok", "--root-cert=/root.pem", "--trust-bundle=/bundle.json", "--root-cert-reload=30s", "--hbone-port=15009",
		"--outbound-addr=:15001", "--socks5-addr=:15080", "--inpod-socket=/var/run/isthmus/cni/ztunnel.sock", "--inpod-protocol=istio",
		"--dns-addr=10.0.0.1:53", "--dns-upstream=10.96.0.10", "--pod-dns=false",
		"--readiness-addr=:15021", "--metrics-addr=:15020", "--admin-addr=127.0.0.1:15000",
		"--cert-ttl=1h", "--log-level=debug", "--log-format=text", "--handoff-wait=3s", "--drain-grace=45s", "--inpod-sync-wait=4s",
		"--access-log=false", "--access-log-rate=50", "--access-log-burst=10",
	)
	require.NoError(t, err)
	require.NotNil(t, deps.Log)
	require.Equal(t, node.Config{
		NodeName: "env-node", ClusterID: "c1", Network: "n1", Mode: node.ModeGateway, TrustDomain: "example.org",
		Namespace: "mesh", ServiceAccount: "ztunnel",
		XDSAddress: "isthmusd.mesh.svc:15012", CAAddress: "isthmusd.mesh.svc:15012",
		TokenFile: "/tok", RootCertFile: "/root.pem", TrustBundleFile: "/bundle.json", RootsReloadInterval: 30 * time.Second, CertTTL: time.Hour, HBONEPort: 15009,
		OutboundListen: ":15001", SOCKS5Listen: ":15080", AdminListen: "127.0.0.1:15000",
		ReadinessListen: ":15021", MetricsListen: ":15020", ShutdownTimeout: node.DefaultConfig().ShutdownTimeout,
		HandoffWait: 3 * time.Second, DrainGrace: 45 * time.Second, InPodSyncWait: 4 * time.Second,
		InPodSocket: "/var/run/isthmus/cni/ztunnel.sock", InPodProtocol: "istio", DNSListen: "10.0.0.1:53", DNSUpstreams: []string{"10.96.0.10"}, DisablePodDNS: true,
		NoAccessLog: true, AccessLogRate: 50, AccessLogBurst: 10,
	}, cfg)
}

// TestAccessLogFlagDefaults: the access log is on by default, at the
// documented rate.
func TestAccessLogFlagDefaults(t *testing.T) {
	cfg, _, err := capture(t)
	require.NoError(t, err)
	require.False(t, cfg.NoAccessLog)
	require.Equal(t, 100.0, cfg.AccessLogRate)
	require.Equal(t, 200, cfg.AccessLogBurst)
}

// TestBadFlags proves invalid log settings and positional arguments are
// refused before anything runs, and that the run error is returned.
func TestBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--log-level=loud"},
		{"--log-format=xml"},
		{"extra"},
	} {
		_, _, err := capture(t, args...)
		require.Error(t, err, "%v", args)
	}
	boom := errors.New("boom")
	cmd := NewCommand(&bytes.Buffer{}, func(context.Context, node.Config, node.Deps) error { return boom })
	cmd.SetArgs(nil)
	require.ErrorIs(t, cmd.ExecuteContext(context.Background()), boom)
}

// TestRunNodeRejectsBadConfig proves the real run path reports an invalid
// configuration (missing node, unknown mode) instead of starting.
func TestRunNodeRejectsBadConfig(t *testing.T) {
	err := RunNode(context.Background(), node.Config{Mode: "sidecar", XDSAddress: "127.0.0.1:1", CAAddress: "127.0.0.1:1"}, node.Deps{})
	require.ErrorContains(t, err, "NodeName is required")
	require.ErrorContains(t, err, `mode "sidecar"`)
}

// TestVersionFlag proves --version prints the stamped version and commit
// and runs nothing.
func TestVersionFlag(t *testing.T) {
	var out bytes.Buffer
	cmd := NewCommand(&bytes.Buffer{}, func(context.Context, node.Config, node.Deps) error {
		return errors.New("must not run")
	})
	cmd.SetOut(&out)
	cmd.SetArgs([]string{"--version"})
	require.NoError(t, cmd.ExecuteContext(context.Background()))
	require.Equal(t, "ztunnel "+version.String()+"\n", out.String())
}

// TestPodName: the pod comes from $POD_NAME (the charts set it) or
// --pod-name; node.Config names a gateway replica's xDS node by it.
func TestPodName(t *testing.T) {
	t.Setenv("POD_NAME", "eastwest-7d9f-abcde")
	cfg, _, err := capture(t, "--mode=gateway", "--network=net1")
	require.NoError(t, err)
	require.Equal(t, "eastwest-7d9f-abcde", cfg.PodName)
	cfg, _, err = capture(t, "--mode=gateway", "--network=net1", "--pod-name=other")
	require.NoError(t, err)
	require.Equal(t, "other", cfg.PodName)
}
