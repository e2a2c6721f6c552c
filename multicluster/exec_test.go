package multicluster_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// boundToken issues a TokenRequest token of the reader ServiceAccount of
// cluster, bound to a Secret made for it; revoke deletes that Secret,
// which invalidates the token at the API server.
func boundToken(t testing.TB, cluster string) (token string, revoke func()) {
	t.Helper()
	ctx := context.Background()
	c := clusters.Cluster(cluster)
	_ = kubeconfig(t, cluster, "reader") // the reader ServiceAccount and its RBAC
	ns := "isthmus-system"
	sec, err := c.Client.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{GenerateName: "exec-token-binding-"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	ttl := int64(3600)
	tr, err := c.Client.CoreV1().ServiceAccounts(ns).CreateToken(ctx, "isthmus-reader-service-account", &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &ttl,
			BoundObjectRef: &authenticationv1.BoundObjectReference{Kind: "Secret", APIVersion: "v1", Name: sec.Name, UID: sec.UID}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	revoke = func() {
		err := c.Client.CoreV1().Secrets(ns).Delete(ctx, sec.Name, metav1.DeleteOptions{})
		if !apierrors.IsNotFound(err) {
			require.NoError(t, err)
		}
	}
	t.Cleanup(revoke)
	return tr.Status.Token, revoke
}

// writeStatus makes the test plugin in dir answer with this status.
func writeStatus(t testing.TB, dir string, status map[string]any) {
	t.Helper()
	b, err := json.Marshal(status)
	require.NoError(t, err)
	tmp := filepath.Join(dir, "status.json.tmp")
	require.NoError(t, os.WriteFile(tmp, b, 0o600))
	require.NoError(t, os.Rename(tmp, filepath.Join(dir, "status.json")))
}

func pluginRuns(t testing.TB, dir string) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "runs"))
	if errors.Is(err, os.ErrNotExist) {
		return 0
	}
	require.NoError(t, err)
	return strings.Count(string(b), "\n")
}

// tokenWorks tells whether token authenticates to cluster (false on 401).
func tokenWorks(t testing.TB, cluster, token string) bool {
	t.Helper()
	c := clusters.Cluster(cluster)
	kc, err := kubernetes.NewForConfig(&rest.Config{Host: c.Host(), BearerToken: token, TLSClientConfig: rest.TLSClientConfig{CAData: c.CAData()}})
	require.NoError(t, err)
	_, err = kc.CoreV1().Namespaces().List(context.Background(), metav1.ListOptions{Limit: 1})
	if apierrors.IsUnauthorized(err) {
		return false
	}
	require.NoError(t, err)
	return true
}

// statusLog records every status the controller reports for one cluster.
type statusLog struct {
	mu  sync.Mutex
	all []multicluster.Status
}

func (l *statusLog) since(id model.ClusterID, from int) []multicluster.Status {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []multicluster.Status
	for _, s := range l.all[min(from, len(l.all)):] {
		if s.ID == id {
			out = append(out, s)
		}
	}
	return out
}

func (l *statusLog) len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.all)
}

// TestExecCredentialsAuthenticateAndRefresh: a real plugin binary, allowed
// by the allowlist, authenticates remote-1 with a TokenRequest token; its
// pods are discovered; the plugin sees only the allowed variable and the
// request. The credential expires soon; the test puts a new token where
// the plugin reads it, and the plugin is run again before the old one
// expires, with no restart: once the old token is revoked at the API
// server, the cluster is still synced on the same generation, its client
// still lists, a new pod is discovered, and no request was ever answered
// 401. A plugin that breaks and recovers costs a specific status and no
// generation. No token reaches the logs.
func TestExecCredentialsAuthenticateAndRefresh(t *testing.T) {
	plugin := multicluster.BuildTestExecPlugin(t)
	dir := t.TempDir()
	t.Setenv("ISTHMUS_EXEC_TEST_SECRET", "pilot-env-must-not-leak")
	ensurePods(t, "remote-1", "exec", 3)
	tok1, revoke1 := boundToken(t, "remote-1")
	require.True(t, tokenWorks(t, "remote-1", tok1))
	writeStatus(t, dir, map[string]any{"token": tok1, "expirationTimestamp": time.Now().Add(8 * time.Second).UTC().Format(time.RFC3339)})

	reg := prometheus.NewRegistry()
	e := startController(t, "mc-exec", func(cfg *multicluster.Config) {
		cfg.Registerer = reg
		cfg.Exec.Allowlist = []multicluster.ExecRule{{Command: plugin, Args: []string{"serve", dir}, Env: []string{"PLUGIN_PROFILE"}}}
	})
	log := &statusLog{}
	e.ctl.Subscribe(func(s multicluster.Status) { log.mu.Lock(); log.all = append(log.all, s); log.mu.Unlock() })
	c1 := clusters.Cluster("remote-1")
	e.applySecret("exec", map[string][]byte{"exec-remote": execKubeconfig(t, c1.Host(), c1.CAData(), &clientcmdapi.ExecConfig{
		Command: plugin, Args: []string{"serve", dir}, Env: execEnv("PLUGIN_PROFILE", "prod")})})
	synced := e.waitState("exec-remote", multicluster.StateSynced, multicluster.ReasonSynced)
	require.Eventually(t, func() bool { return e.sink.count("exec-remote") >= 3 }, 20*time.Second, 20*time.Millisecond, "pods discovered with the plugin's token")
	envNames, err := os.ReadFile(filepath.Join(dir, "env"))
	require.NoError(t, err)
	require.Equal(t, "KUBERNETES_EXEC_INFO\nPLUGIN_PROFILE", string(envNames), "a clean environment: the allowed variable and the request only")
	runsBefore := pluginRuns(t, dir)
	mark := log.len()

	// Rotate: the plugin now answers with a new token, valid for an hour.
	tok2, _ := boundToken(t, "remote-1")
	writeStatus(t, dir, map[string]any{"token": tok2, "expirationTimestamp": time.Now().Add(time.Hour).UTC().Format(time.RFC3339)})
	require.Eventually(t, func() bool { return pluginRuns(t, dir) > runsBefore }, 30*time.Second, 20*time.Millisecond,
		"the plugin runs again when the credential is due, without a restart")
	revoke1()
	require.Eventually(t, func() bool { return !tokenWorks(t, "remote-1", tok1) }, 30*time.Second, 100*time.Millisecond, "the old token is revoked")

	client, ok := e.ctl.KubeClient("exec-remote")
	require.True(t, ok)
	_, err = client.Kube.CoreV1().Namespaces().List(context.Background(), listLimit(1))
	require.NoError(t, err, "the serving client authenticates with the new token")
	_, err = c1.CreatePod(context.Background(), framework.PodOptions{Namespace: "exec", Name: fmt.Sprintf("after-rotation-%d", time.Now().UnixNano()), Ready: true})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return e.sink.count("exec-remote") >= 4 }, 20*time.Second, 20*time.Millisecond, "discovery goes on")
	now := e.waitState("exec-remote", multicluster.StateSynced, multicluster.ReasonSynced)
	require.Equal(t, synced.Generation, now.Generation, "no new generation for a refreshed token")
	require.Nil(t, now.Pending)
	for _, s := range log.since("exec-remote", mark) {
		require.Equal(t, multicluster.StateSynced, s.State, "never left synced during the rotation (%s: %s)", s.Reason, s.Message)
	}
	require.Zero(t, counter(t, reg, "isthmus_remote_exec_credential_rejected_total"), "no request was answered 401")
	require.GreaterOrEqual(t, counterVec(t, reg, "isthmus_remote_exec_credential_runs_total", "ok"), 2.0)

	logs := e.logs.String()
	for _, tok := range []string{tok1, tok2} {
		require.NotContains(t, logs, tok, "a token reached the logs")
	}
}

// counter returns the value of counter name in reg.
func counter(t testing.TB, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name {
			require.Len(t, mf.GetMetric(), 1)
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatalf("metric %s not registered", name)
	return 0
}

// TestExecPluginFailureRecovers: a plugin that fails gives its cluster the
// ExecCredentialError reason (status and Event), is retried with backoff,
// and once it works the cluster syncs on the same generation; the other
// keys of the Secret are unaffected and no token reaches the logs.
func TestExecPluginFailureRecovers(t *testing.T) {
	plugin := multicluster.BuildTestExecPlugin(t)
	broken, good := t.TempDir(), t.TempDir()
	tok, _ := boundToken(t, "remote-1")
	writeStatus(t, good, map[string]any{"token": tok})
	reg := prometheus.NewRegistry()
	e := startController(t, "mc-exec-fail", func(cfg *multicluster.Config) {
		cfg.Registerer = reg
		cfg.Exec.Allowlist = []multicluster.ExecRule{
			{Command: plugin, Args: []string{"serve", broken}},
			{Command: plugin, Args: []string{"serve", good}},
		}
	})
	c1 := clusters.Cluster("remote-1")
	e.applySecret("exec-fail", map[string][]byte{
		"broken": execKubeconfig(t, c1.Host(), c1.CAData(), &clientcmdapi.ExecConfig{Command: plugin, Args: []string{"serve", broken}}),
		"good":   execKubeconfig(t, c1.Host(), c1.CAData(), &clientcmdapi.ExecConfig{Command: plugin, Args: []string{"serve", good}}),
	})
	failed := e.waitState("broken", multicluster.StateError, multicluster.ReasonExecCredential)
	require.Contains(t, failed.Message, "exit status 1")
	require.Contains(t, failed.Message, "a redacted excerpt is in pilot's log")
	e.waitState("good", multicluster.StateSynced, multicluster.ReasonSynced)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.Contains(c, eventReasons(t, e.ns, "exec-fail"), multicluster.ReasonExecCredential)
	}, 10*time.Second, 20*time.Millisecond)
	require.Positive(t, counterVec(t, reg, "isthmus_remote_exec_credential_runs_total", "failed"))

	writeStatus(t, broken, map[string]any{"token": tok})
	back := e.waitState("broken", multicluster.StateSynced, multicluster.ReasonSynced)
	require.Equal(t, failed.Generation, back.Generation, "recovered without a new generation")
	require.Contains(t, e.logs.String(), "exec credential plugin failed")
	require.NotContains(t, e.logs.String(), tok)
}

// counterVec returns the value of counter name{result} in reg.
func counterVec(t testing.TB, reg *prometheus.Registry, name, result string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "result" && l.GetValue() == result {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	t.Fatalf("metric %s{result=%q} not registered", name, result)
	return 0
}

// TestExecClientCertificate: a plugin may answer with a client certificate
// and key instead of a token; the client presents it.
func TestExecClientCertificate(t *testing.T) {
	plugin := multicluster.BuildTestExecPlugin(t)
	dir := t.TempDir()
	ensurePods(t, "remote-2", "exec-cert", 2)
	c2 := clusters.Cluster("remote-2")
	writeStatus(t, dir, map[string]any{"clientCertificateData": string(c2.Config.CertData), "clientKeyData": string(c2.Config.KeyData)})
	e := startController(t, "mc-exec-cert", func(cfg *multicluster.Config) {
		cfg.Exec.Allowlist = []multicluster.ExecRule{{Command: plugin, Args: []string{"serve", dir}}}
	})
	e.applySecret("exec-cert", map[string][]byte{"exec-cert": execKubeconfig(t, c2.Host(), c2.CAData(), &clientcmdapi.ExecConfig{
		Command: plugin, Args: []string{"serve", dir}})})
	e.waitState("exec-cert", multicluster.StateSynced, multicluster.ReasonSynced)
	require.Eventually(t, func() bool { return e.sink.count("exec-cert") >= 2 }, 20*time.Second, 20*time.Millisecond)
	client, ok := e.ctl.KubeClient("exec-cert")
	require.True(t, ok)
	require.Equal(t, 1, client.OpenConnections(), "one tracked connection, closed with the cluster")
	require.NotContains(t, e.logs.String(), strings.TrimSpace(string(c2.Config.KeyData)))
}

// TestExecNotAllowed: exec users outside the allowlist are refused with
// ReasonExecNotAllowed and a message that says what did not match, on
// every surface (status, /debug/clusterz, Events on the Secret, metrics);
// their plugin never runs, and the Secret's allowed key keeps working.
func TestExecNotAllowed(t *testing.T) {
	plugin := multicluster.BuildTestExecPlugin(t)
	base := t.TempDir()
	dir := func(name string) string {
		d := filepath.Join(base, name)
		require.NoError(t, os.MkdirAll(d, 0o700))
		return d
	}
	ok, otherArg, otherCmd, shell := dir("allowed-1"), dir("other"), dir("copy"), dir("shell")
	tok, _ := boundToken(t, "remote-2")
	for _, d := range []string{ok, otherArg, otherCmd} {
		writeStatus(t, d, map[string]any{"token": tok})
	}
	copyPath := filepath.Join(otherCmd, "plugin")
	bin, err := os.ReadFile(plugin)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(copyPath, bin, 0o700))

	reg := prometheus.NewRegistry()
	e := startController(t, "mc-exec-deny", func(cfg *multicluster.Config) {
		cfg.Registerer = reg
		cfg.Exec.Allowlist = []multicluster.ExecRule{{Command: plugin, Args: []string{"serve", base + "/allowed-*"}, Env: []string{"PLUGIN_PROFILE"}}}
	})
	c2 := clusters.Cluster("remote-2")
	kc := func(ex *clientcmdapi.ExecConfig) []byte { return execKubeconfig(t, c2.Host(), c2.CAData(), ex) }
	e.applySecret("mixed", map[string][]byte{
		"allowed":       kc(&clientcmdapi.ExecConfig{Command: plugin, Args: []string{"serve", ok}, Env: execEnv("PLUGIN_PROFILE", "p")}),
		"other-command": kc(&clientcmdapi.ExecConfig{Command: copyPath, Args: []string{"serve", otherCmd}}),
		"other-arg":     kc(&clientcmdapi.ExecConfig{Command: plugin, Args: []string{"serve", otherArg}}),
		"other-env":     kc(&clientcmdapi.ExecConfig{Command: plugin, Args: []string{"serve", ok}, Env: execEnv("HOME", "/root")}),
		"shell":         kc(&clientcmdapi.ExecConfig{Command: "/bin/sh", Args: []string{"-c", "touch " + shell + "/pwned"}}),
	})
	e.waitState("allowed", multicluster.StateSynced, multicluster.ReasonSynced)
	want := map[model.ClusterID]string{
		"other-command": "exec command " + copyPath + " is not on the allowlist",
		"other-arg":     fmt.Sprintf("argument 1 does not match the allowed pattern %q", base+"/allowed-*"),
		"other-env":     "environment variable HOME is not allowed",
		"shell":         "exec command /bin/sh is not on the allowlist",
	}
	for id, msg := range want {
		s := e.waitState(id, multicluster.StateError, multicluster.ReasonExecNotAllowed)
		require.Contains(t, s.Message, msg)
	}
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		reasons := eventReasons(t, e.ns, "mixed")
		n := 0
		for _, r := range reasons {
			if r == multicluster.ReasonExecNotAllowed {
				n++
			}
		}
		require.GreaterOrEqual(c, n, 1, "Events on the Secret: %v", reasons)
	}, 10*time.Second, 20*time.Millisecond)
	rec := httptest.NewRecorder()
	e.ctl.ClusterzHandler().ServeHTTP(rec, httptest.NewRequest("GET", "/debug/clusterz", nil))
	body, err := io.ReadAll(rec.Body)
	require.NoError(t, err)
	require.Equal(t, 4, strings.Count(string(body), `"reason": "ExecNotAllowed"`))
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP isthmus_remote_clusters Clusters known to the multicluster controller, by state.
# TYPE isthmus_remote_clusters gauge
isthmus_remote_clusters{state="closing"} 0
isthmus_remote_clusters{state="error"} 4
isthmus_remote_clusters{state="pending"} 0
isthmus_remote_clusters{state="synced"} 2
isthmus_remote_clusters{state="syncing"} 0
isthmus_remote_clusters{state="timeout"} 0
isthmus_remote_clusters{state="unreachable"} 0
`), "isthmus_remote_clusters"))

	for _, d := range []string{otherArg, otherCmd} {
		require.Zero(t, pluginRuns(t, d), "a refused plugin never runs")
	}
	_, err = os.Stat(filepath.Join(shell, "pwned"))
	require.ErrorIs(t, err, os.ErrNotExist, "a refused command never runs")
	require.NotContains(t, e.logs.String(), tok)

	// Dropping the refused keys leaves the allowed cluster untouched.
	before, _ := e.ctl.Status("allowed")
	e.applySecret("mixed", map[string][]byte{"allowed": mustGet(t, e, "mixed", "allowed")})
	for id := range want {
		e.waitGone(id)
	}
	after := e.waitState("allowed", multicluster.StateSynced, multicluster.ReasonSynced)
	require.Equal(t, before.Generation, after.Generation)
}
