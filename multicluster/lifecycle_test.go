package multicluster_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// TestTwoRemotesSwapAndRemove: one Secret with two keys makes both remotes
// synced; a new token for one swaps only that cluster, and the registered
// component never reports zero objects during the swap; removing a key
// stops that cluster.
func TestTwoRemotesSwapAndRemove(t *testing.T) {
	ensurePods(t, "remote-1", "swap", 5)
	ensurePods(t, "remote-2", "swap", 3)
	e := startController(t, "mc-swap", nil)
	e.applySecret("remotes", map[string][]byte{
		"remote-1": kubeconfig(t, "remote-1", "remote-1"),
		"remote-2": kubeconfig(t, "remote-2", "remote-2"),
	})
	s1 := e.waitState("remote-1", multicluster.StateSynced, multicluster.ReasonSynced)
	s2 := e.waitState("remote-2", multicluster.StateSynced, multicluster.ReasonSynced)
	require.GreaterOrEqual(t, e.sink.count("remote-1"), 5)
	require.GreaterOrEqual(t, e.sink.count("remote-2"), 3)
	gen1 := e.sink.generation("remote-1")

	// Sample the serving component of remote-1 as fast as possible during the swap.
	var zeroSeen atomic.Int64
	stop := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if e.sink.count("remote-1") == 0 {
				zeroSeen.Add(1)
			}
			runtime.Gosched()
		}
	}()
	e.applySecret("remotes", map[string][]byte{
		"remote-1": kubeconfig(t, "remote-1", "remote-1"), // a new token
		"remote-2": mustGet(t, e, "remotes", "remote-2"),  // the same bytes
	})
	require.Eventually(t, func() bool { return e.sink.generation("remote-1") > gen1 }, 20*time.Second, 10*time.Millisecond)
	time.Sleep(300 * time.Millisecond) // keep sampling while the old generation closes
	close(stop)
	<-sampled
	require.Zero(t, zeroSeen.Load(), "the component reported zero pods during the swap")
	after1 := e.waitState("remote-1", multicluster.StateSynced, "")
	after2 := e.waitState("remote-2", multicluster.StateSynced, "")
	require.Greater(t, after1.Generation, s1.Generation, "remote-1 swapped")
	require.Equal(t, s2.Generation, after2.Generation, "remote-2 untouched")
	require.Equal(t, 1, e.sink.builds("remote-2"), "remote-2's component built once")
	require.Nil(t, after1.Pending)

	// Removing a key stops that cluster only.
	e.applySecret("remotes", map[string][]byte{"remote-2": mustGet(t, e, "remotes", "remote-2")})
	e.waitGone("remote-1")
	require.Eventually(t, func() bool { return e.sink.count("remote-1") == 0 }, 10*time.Second, 10*time.Millisecond)
	e.waitState("remote-2", multicluster.StateSynced, "")
	require.Equal(t, s2.Generation, e.sink.generation("remote-2"))
}

// TestRemoveStopsGoroutines: a remote's goroutines and informers are all
// gone after its Secret is deleted.
func TestRemoveStopsGoroutines(t *testing.T) {
	e := startController(t, "mc-leak", nil)
	baseline := goleak.IgnoreCurrent()
	e.applySecret("r1", map[string][]byte{"remote-1": kubeconfig(t, "remote-1", "remote-1")})
	e.waitState("remote-1", multicluster.StateSynced, "")
	require.Error(t, goleak.Find(baseline), "a running remote has goroutines (sanity check of the leak check)")
	e.deleteSecret("r1")
	e.waitGone("remote-1")
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.NoError(c, goleak.Find(baseline, goleak.IgnoreAnyFunction("net/http.(*persistConn).readLoop"),
			goleak.IgnoreAnyFunction("net/http.(*persistConn).writeLoop")))
	}, 10*time.Second, 50*time.Millisecond)
}

// TestBadInput: each kind of bad registration gets its own state, reason and
// Event on the Secret, while a good remote keeps working and no credential
// reaches the logs.
func TestBadInput(t *testing.T) {
	e := startController(t, "mc-bad", nil)
	good := kubeconfig(t, "remote-1", "good")
	e.applySecret("good", map[string][]byte{"good": good})
	e.waitState("good", multicluster.StateSynced, "")

	wrongCA := rewrite(t, kubeconfig(t, "remote-2", "wrong-ca"), func(cfg *clientcmdapiConfig) {
		cfg.Clusters["wrong-ca"].CertificateAuthorityData = clusters.Cluster("remote-1").CAData()
	})
	token := tokenOf(t, good)
	cases := []struct {
		name   string
		id     model.ClusterID
		data   []byte
		state  multicluster.State
		reason string
	}{
		{"garbage bytes", "garbage", []byte("\x00\x01 not a kubeconfig {{{"), multicluster.StateError, multicluster.ReasonInvalidKubeconfig},
		{"no current context", "nocontext", []byte("apiVersion: v1\nkind: Config\nclusters: []\n"), multicluster.StateError, multicluster.ReasonNoCurrentContext},
		{"unreachable server", "unreachable", rewrite(t, kubeconfig(t, "remote-2", "unreachable"), func(cfg *clientcmdapiConfig) {
			cfg.Clusters["unreachable"].Server = "https://127.0.0.1:1"
		}), multicluster.StateUnreachable, multicluster.ReasonUnreachable},
		{"wrong CA", "wrong-ca", wrongCA, multicluster.StateError, multicluster.ReasonTLSError},
		{"exec user", "exec", rewrite(t, kubeconfig(t, "remote-2", "exec"), func(cfg *clientcmdapiConfig) {
			cfg.AuthInfos["exec"].Token = ""
			cfg.AuthInfos["exec"].Exec = &clientcmdapiExec{Command: "/bin/sh", Args: []string{"-c", "touch /tmp/pwned"}, APIVersion: "client.authentication.k8s.io/v1",
				InteractiveMode: "Never"}
		}), multicluster.StateError, multicluster.ReasonExecNotAllowed},
		{"tokenFile user", "tokenfile", rewrite(t, kubeconfig(t, "remote-2", "tokenfile"), func(cfg *clientcmdapiConfig) {
			cfg.AuthInfos["tokenfile"].Token = ""
			cfg.AuthInfos["tokenfile"].TokenFile = "/etc/shadow"
		}), multicluster.StateError, multicluster.ReasonForbiddenOption},
		{"config cluster ID", "config", good, multicluster.StateError, multicluster.ReasonConfigClusterID},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := e.with(t)
			secret := "bad-" + strings.ToLower(strings.ReplaceAll(tc.name, " ", "-"))
			e.applySecret(secret, map[string][]byte{string(tc.id): tc.data})
			require.EventuallyWithT(t, func(c *assert.CollectT) {
				var found bool
				for _, s := range e.ctl.Statuses() {
					if s.ID == tc.id && s.Secret == e.ns+"/"+secret {
						found = true
						require.Equal(c, tc.state, s.State, "%s: %s", s.Reason, s.Message)
						require.Equal(c, tc.reason, s.Reason, s.Message)
					}
				}
				require.True(c, found, "no status for %s from %s", tc.id, secret)
				require.Contains(c, eventReasons(t, e.ns, secret), tc.reason)
			}, 30*time.Second, 50*time.Millisecond)
			s, _ := e.ctl.Status("good")
			require.Equal(t, multicluster.StateSynced, s.State, "the good remote keeps working")
		})
	}
	t.Run("duplicate ID", func(t *testing.T) {
		e := e.with(t)
		e.applySecret("dup", map[string][]byte{"good": kubeconfig(t, "remote-2", "good")})
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			var reasons []string
			for _, s := range e.ctl.Statuses() {
				if s.ID == "good" {
					reasons = append(reasons, s.Secret+"="+s.Reason)
				}
			}
			require.ElementsMatch(c, []string{e.ns + "/good=" + multicluster.ReasonSynced, e.ns + "/dup=" + multicluster.ReasonDuplicateCluster}, reasons)
			require.Contains(c, eventReasons(t, e.ns, "dup"), multicluster.ReasonDuplicateCluster)
		}, 30*time.Second, 50*time.Millisecond)
		// The first secret still serves: its client was not replaced.
		require.Equal(t, 1, e.sink.builds("good"))
		// When the first secret goes, the second one takes the ID over.
		e.deleteSecret("good")
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			s, ok := e.ctl.Status("good")
			require.True(c, ok)
			require.Equal(c, e.ns+"/dup", s.Secret)
			require.Equal(c, multicluster.StateSynced, s.State)
		}, 30*time.Second, 20*time.Millisecond)
	})
	require.NotContains(t, e.logs.String(), token, "a token reached the logs")
	_, err := osStat("/tmp/pwned")
	require.Error(t, err, "the exec plugin must never run")

	// The debug endpoint shows every cluster.
	rec := httptest.NewRecorder()
	e.ctl.ClusterzHandler().ServeHTTP(rec, httptest.NewRequest("GET", "/debug/clusterz", nil))
	require.Contains(t, rec.Body.String(), `"reason": "TLSError"`)
	require.NotContains(t, rec.Body.String(), token)
}

// TestAPIServerRestart: a remote whose API server stops goes unreachable,
// keeps its last state, and is synced again when the server is back, with
// no restart of the controller.
func TestAPIServerRestart(t *testing.T) {
	ensurePods(t, "remote-2", "restart", 4)
	e := startController(t, "mc-restart", nil)
	e.applySecret("r2", map[string][]byte{"remote-2": kubeconfig(t, "remote-2", "remote-2")})
	before := e.waitState("remote-2", multicluster.StateSynced, "")
	n := e.sink.count("remote-2")
	require.GreaterOrEqual(t, n, 4)

	c := clusters.Cluster("remote-2")
	require.NoError(t, c.StopAPIServer())
	t.Cleanup(func() {
		if c.APIServerPID() == 0 {
			_ = c.RestartAPIServer()
		}
	})
	e.waitState("remote-2", multicluster.StateUnreachable, multicluster.ReasonUnreachable)
	require.Equal(t, n, e.sink.count("remote-2"), "last known state kept while unreachable")
	require.NoError(t, c.RestartAPIServer())
	after := e.waitState("remote-2", multicluster.StateSynced, multicluster.ReasonSynced)
	require.Equal(t, before.Generation, after.Generation, "recovered without rebuilding the client")
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.Contains(c, eventReasons(t, e.ns, "r2"), multicluster.ReasonUnreachable)
	}, 10*time.Second, 20*time.Millisecond)

	// The cluster works again: a new pod shows up.
	_, err := c.CreatePod(context.Background(), podOpts("restart", fmt.Sprintf("after-restart-%d", time.Now().UnixNano())))
	require.NoError(t, err)
	require.Eventually(t, func() bool { return e.sink.count("remote-2") > n }, 20*time.Second, 20*time.Millisecond)
}

// TestSyncTimeoutNeverBlocksReadiness: a remote whose component never
// syncs is reported timed out after the sync timeout, keeps being retried
// (it goes synced when its component does), and never holds back the
// controller's readiness or the other remotes.
func TestSyncTimeoutNeverBlocksReadiness(t *testing.T) {
	var stuck atomic.Bool
	stuck.Store(true)
	ctx := context.Background()
	cfgCluster := clusters.Cluster("config")
	require.NoError(t, cfgCluster.EnsureNamespace(ctx, "mc-timeout2", nil))
	local, err := multicluster.NewClient(cfgCluster.Config)
	require.NoError(t, err)
	ctl, err := multicluster.New(multicluster.Config{Namespace: "mc-timeout2", ConfigClusterID: "config", SyncTimeout: 500 * time.Millisecond,
		LivenessInterval: 200 * time.Millisecond}, local, nil)
	require.NoError(t, err)
	s := newSink()
	ctl.AddComponent("pods", s.builder)
	ctl.AddComponent("slow", func(ctx context.Context, c *multicluster.Cluster) (multicluster.Component, error) {
		if c.ID == "remote-2" {
			return slowComponent{&stuck}, nil
		}
		return readyComponent{}, nil
	})
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- ctl.Run(rctx) }()
	t.Cleanup(func() { cancel(); <-done })
	require.Eventually(t, ctl.Ready, 20*time.Second, 10*time.Millisecond)
	e2 := &env{t: t, ctl: ctl, sink: s, ns: "mc-timeout2"}
	e2.applySecret("both", map[string][]byte{
		"remote-1": kubeconfig(t, "remote-1", "remote-1"),
		"remote-2": kubeconfig(t, "remote-2", "remote-2"),
	})
	e2.waitState("remote-2", multicluster.StateTimeout, multicluster.ReasonSyncTimeout)
	e2.waitState("remote-1", multicluster.StateSynced, "")
	require.True(t, ctl.Ready(), "a remote that never syncs does not hold back readiness")
	// Events are written asynchronously by the recorder.
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.Contains(c, eventReasons(t, "mc-timeout2", "both"), multicluster.ReasonSyncTimeout)
	}, 10*time.Second, 20*time.Millisecond)
	// Still trying: once its component syncs, it is synced.
	stuck.Store(false)
	e2.waitState("remote-2", multicluster.StateSynced, multicluster.ReasonSynced)
}

type slowComponent struct{ stuck *atomic.Bool }

func (c slowComponent) HasSynced() bool { return !c.stuck.Load() }
func (slowComponent) Close()            {}

type readyComponent struct{}

func (readyComponent) HasSynced() bool { return true }
func (readyComponent) Close()          {}
