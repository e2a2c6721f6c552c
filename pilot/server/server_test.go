package server_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/pilot/registry"
	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

var clusters *framework.ClusterSet

func TestMain(m *testing.M) {
	code := framework.Main(m, framework.Options{Names: []string{"primary", "remote"}}, &clusters)
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

func get(t *testing.T, url string, into any) int {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	if into != nil && resp.StatusCode == http.StatusOK {
		require.NoError(t, json.Unmarshal(body, into), string(body))
	}
	return resp.StatusCode
}

// runPilot builds a pilot for cfg on the primary cluster (warnings logged
// to stderr) and runs it until the test ends.
func runPilot(t *testing.T, cfg server.Config) *server.Server {
	t.Helper()
	p, _ := runPilotCancel(t, cfg)
	return p
}

// runPilotCancel is runPilot that also returns a function stopping the
// pilot (and waiting for it) before the test ends.
func runPilotCancel(t *testing.T, cfg server.Config) (*server.Server, func()) {
	t.Helper()
	cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	p, err := server.New(cfg, clusters.Cluster("primary").Config, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				require.NoError(t, err)
			case <-time.After(30 * time.Second):
				t.Error("pilot did not stop")
			}
		})
	}
	t.Cleanup(stop)
	return p, stop
}

// registerRemote creates in the primary cluster the remote secret of the
// remote cluster, in namespace ns, on network (none: the default).
func registerRemote(t *testing.T, ns string, network string) {
	t.Helper()
	ctx := context.Background()
	kc, err := clusters.Cluster("remote").ReaderKubeconfig(ctx, "remote", remotesecret.ReaderOptions{})
	require.NoError(t, err)
	sec := remotesecret.Secret("remote", ns, kc)
	if network != "" {
		sec.Annotations[remotesecret.NetworkAnnotation] = network
	}
	_, err = clusters.Cluster("primary").Client.CoreV1().Secrets(ns).Create(ctx, sec, metav1.CreateOptions{})
	require.NoError(t, err)
}

// TestPilotWiring runs a whole pilot against two real clusters: it becomes
// ready when the config cluster syncs, registers the remote from its
// Secret, federates its services, publishes the CA root into it, and serves
// the debug, health and metrics endpoints.
func TestPilotWiring(t *testing.T) {
	ctx := context.Background()
	primary, remote := clusters.Cluster("primary"), clusters.Cluster("remote")
	require.NoError(t, primary.EnsureNamespace(ctx, "isthmus-system", nil))
	require.NoError(t, remote.EnsureNamespace(ctx, "demo", nil))
	_, err := remote.CreateService(ctx, "demo", "echo", map[string]string{"app": "echo"}, framework.ServicePort{Name: "http", Port: 80, TargetPort: 8080})
	require.NoError(t, err)

	p := runPilot(t, server.Config{
		ClusterID: "primary", Network: "network-1",
		DebugAddr: "127.0.0.1:0", MonitoringAddr: "127.0.0.1:0", GRPCAddr: "127.0.0.1:0",
	})
	require.Eventually(t, func() bool { return p.MonitoringAddr() != "" && p.DebugAddr() != "" }, 20*time.Second, 10*time.Millisecond)
	mon, dbg := "http://"+p.MonitoringAddr(), "http://"+p.DebugAddr()
	require.Eventually(t, func() bool { return get(t, mon+"/readyz", nil) == http.StatusOK }, 30*time.Second, 20*time.Millisecond)
	require.Equal(t, http.StatusOK, get(t, mon+"/healthz", nil))

	registerRemote(t, "isthmus-system", "")

	require.EventuallyWithT(t, func(c *assert.CollectT) {
		var st []multicluster.Status
		require.Equal(c, http.StatusOK, get(t, dbg+"/debug/clusterz", &st))
		states := map[string]multicluster.State{}
		for _, s := range st {
			states[string(s.ID)] = s.State
		}
		require.Equal(c, map[string]multicluster.State{"primary": multicluster.StateSynced, "remote": multicluster.StateSynced}, states)
	}, 30*time.Second, 20*time.Millisecond)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		var rz struct{ Services []registry.ServiceSummary }
		require.Equal(c, http.StatusOK, get(t, dbg+"/debug/registryz", &rz))
		var hosts []string
		for _, s := range rz.Services {
			hosts = append(hosts, s.Hostname)
		}
		require.Contains(c, hosts, "echo.demo.svc.cluster.local")
	}, 30*time.Second, 20*time.Millisecond)
	// The CA root is published into the remote cluster.
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		cm, err := remote.Client.CoreV1().ConfigMaps("isthmus-system").Get(ctx, "isthmus-ca-root-cert", metav1.GetOptions{})
		require.NoError(c, err)
		require.Contains(c, cm.Data["root-cert.pem"], "BEGIN CERTIFICATE")
	}, 30*time.Second, 20*time.Millisecond)

	resp, err := http.Get(mon + "/metrics")
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Contains(t, string(body), `isthmus_remote_clusters{state="synced"} 2`)
	require.Equal(t, http.StatusBadRequest, get(t, dbg+"/debug/endpointz", nil))
	require.Equal(t, http.StatusNotFound, get(t, dbg+"/debug/endpointz?host=nope", nil))
}
