package multicluster

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"log/slog"
	"math/big"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// testPlugin prepares an execPlugin running the test plugin in mode with
// its own folder, and returns both.
func testPlugin(t *testing.T, bin, mode string, env ...clientcmdapi.ExecEnvVar) (*execPlugin, string) {
	t.Helper()
	dir := t.TempDir()
	ex := &clientcmdapi.ExecConfig{Command: bin, Args: []string{mode, dir}, Env: env, APIVersion: execAPIv1, ProvideClusterInfo: true}
	p, err := newExecPlugin(ex, &clientcmdapi.Cluster{Server: "https://remote.example:6443", CertificateAuthorityData: []byte("ca")}, 2*time.Second)
	require.NoError(t, err)
	return p, dir
}

func writeFile(t testing.TB, path, content string) {
	t.Helper()
	tmp := path + ".tmp"
	require.NoError(t, os.WriteFile(tmp, []byte(content), 0o600))
	require.NoError(t, os.Rename(tmp, path)) // the plugin never reads half a file
}

func statusJSON(t testing.TB, token string, expiry time.Time) string {
	t.Helper()
	st := map[string]any{"token": token}
	if !expiry.IsZero() {
		st["expirationTimestamp"] = expiry.UTC().Format(time.RFC3339)
	}
	b, err := json.Marshal(st)
	require.NoError(t, err)
	return string(b)
}

func selfSignedPEM(t testing.TB) (certPEM, keyPEM string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "exec-test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	kder, err := x509.MarshalECPrivateKey(key)
	require.NoError(t, err)
	return string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})),
		string(pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}))
}

func runs(t testing.TB, dir string) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "runs"))
	if errors.Is(err, os.ErrNotExist) {
		return 0
	}
	require.NoError(t, err)
	return strings.Count(string(b), "\n")
}

// TestExecPluginRun runs the real test plugin: what it gets (a clean
// environment and the ExecCredential request) and how each kind of bad
// output or behaviour is refused, without quoting the output.
func TestExecPluginRun(t *testing.T) {
	bin := BuildTestExecPlugin(t)
	t.Setenv("ISTHMUS_EXEC_TEST_SECRET", "pilot-env-must-not-leak")
	now := time.Now()
	const secret = "SECRETVALUE0123456789abcdef"

	t.Run("token with expiry, clean environment", func(t *testing.T) {
		p, dir := testPlugin(t, bin, "serve", clientcmdapi.ExecEnvVar{Name: "PLUGIN_PROFILE", Value: "prod"})
		writeFile(t, filepath.Join(dir, "status.json"), statusJSON(t, secret, now.Add(100*time.Second)))
		cred, _, err := p.run(t.Context(), time.Now)
		require.NoError(t, err)
		require.Equal(t, secret, cred.token)
		require.Nil(t, cred.cert)
		require.True(t, cred.expiry.Equal(now.Add(100*time.Second).Truncate(time.Second)))
		require.Equal(t, cred.expiry.Add(-refreshMargin(cred.expiry.Sub(cred.obtained))), cred.refreshAt)
		require.True(t, cred.refreshAt.Before(cred.expiry))
		env, err := os.ReadFile(filepath.Join(dir, "env"))
		require.NoError(t, err)
		require.Equal(t, "KUBERNETES_EXEC_INFO\nPLUGIN_PROFILE", string(env), "only the allowed variables and the request")
		info, err := os.ReadFile(filepath.Join(dir, "info"))
		require.NoError(t, err)
		require.JSONEq(t, `{"kind":"ExecCredential","apiVersion":"client.authentication.k8s.io/v1","spec":{"interactive":false,
			"cluster":{"server":"https://remote.example:6443","certificate-authority-data":"Y2E=","config":null}}}`, string(info))
	})
	t.Run("client certificate", func(t *testing.T) {
		p, dir := testPlugin(t, bin, "serve")
		certPEM, keyPEM := selfSignedPEM(t)
		st, err := json.Marshal(map[string]string{"clientCertificateData": certPEM, "clientKeyData": keyPEM})
		require.NoError(t, err)
		writeFile(t, filepath.Join(dir, "status.json"), string(st))
		cred, _, err := p.run(t.Context(), time.Now)
		require.NoError(t, err)
		require.NotNil(t, cred.cert)
		require.Empty(t, cred.token)
		require.True(t, cred.expiry.IsZero(), "no expiry: valid until rejected")
	})

	certPEM, _ := selfSignedPEM(t)
	invalid := []struct{ name, out, want string }{
		{"not JSON", "token: " + secret, "not JSON"},
		{"two values", `{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential","status":{"token":"a"}} {}`, "more than one JSON value"},
		{"wrong kind", `{"apiVersion":"client.authentication.k8s.io/v1","kind":"` + secret + `","status":{"token":"a"}}`, "kind is not ExecCredential"},
		{"wrong apiVersion", `{"apiVersion":"client.authentication.k8s.io/v1beta1","kind":"ExecCredential","status":{"token":"` + secret + `"}}`, "apiVersion is not"},
		{"no status", `{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential"}`, "no status"},
		{"empty status", `{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential","status":{}}`, "neither a token nor"},
		{"token with a newline", `{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential","status":{"token":"` + secret + `\nX-Injected: 1"}}`, "characters a bearer token may not"},
		{"certificate without key", `{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential","status":{"clientCertificateData":` + strconv.Quote(certPEM) + `}}`, "without its key"},
		{"bad key pair", `{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential","status":{"clientCertificateData":` + strconv.Quote(certPEM) + `,"clientKeyData":"` + secret + `"}}`, "not a valid pair"},
		{"expired", `{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential","status":{"token":"` + secret + `","expirationTimestamp":"2001-01-01T00:00:00Z"}}`, "not in the future"},
		{"wrong type", `{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential","status":{"token":12345}}`, "not an ExecCredential"},
	}
	for _, tc := range invalid {
		t.Run(tc.name, func(t *testing.T) {
			p, dir := testPlugin(t, bin, "raw")
			writeFile(t, filepath.Join(dir, "out"), tc.out)
			_, _, err := p.run(t.Context(), time.Now)
			ee, ok := errors.AsType[*ExecError](err)
			require.True(t, ok, "an ExecError: %v", err)
			require.Equal(t, "invalid", ee.result)
			require.Contains(t, err.Error(), tc.want)
			require.NotContains(t, err.Error(), secret, "the output is never quoted")
		})
	}

	t.Run("failure: stderr redacted", func(t *testing.T) {
		p, dir := testPlugin(t, bin, "fail")
		jwt := "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW0ifQ.c2lnbmF0dXJlLXNpZ25hdHVyZQ"
		writeFile(t, filepath.Join(dir, "stderr"), "error: the server rejected "+jwt+"\npassword=hunter2 \x1b[31mred\x1b[0m\n"+strings.Repeat("more ", 200))
		_, excerpt, err := p.run(t.Context(), time.Now)
		ee, ok := errors.AsType[*ExecError](err)
		require.True(t, ok, "an ExecError: %v", err)
		require.Equal(t, "failed", ee.result)
		require.Contains(t, err.Error(), "exit status 3")
		for _, s := range []string{jwt, "hunter2", "\x1b"} {
			require.NotContains(t, err.Error(), s)
			require.NotContains(t, excerpt, s)
		}
		require.Contains(t, excerpt, "error: the server rejected [redacted] password=[redacted]")
		require.LessOrEqual(t, len([]rune(excerpt)), execStderrExcerpt+1)
	})
	t.Run("flood", func(t *testing.T) {
		p, _ := testPlugin(t, bin, "flood")
		_, _, err := p.run(t.Context(), time.Now)
		ee, ok := errors.AsType[*ExecError](err)
		require.True(t, ok, "an ExecError: %v", err)
		require.Equal(t, "invalid", ee.result)
		require.Contains(t, err.Error(), "wrote 1048576 bytes")
	})
	t.Run("missing command", func(t *testing.T) {
		p, _ := testPlugin(t, filepath.Join(t.TempDir(), "absent"), "serve")
		_, _, err := p.run(t.Context(), time.Now)
		require.ErrorContains(t, err, "cannot run")
	})
	t.Run("timeout kills the process group", func(t *testing.T) {
		p, dir := testPlugin(t, bin, "sleep")
		p.timeout = 500 * time.Millisecond
		_, _, err := p.run(t.Context(), time.Now)
		ee, ok := errors.AsType[*ExecError](err)
		require.True(t, ok, "an ExecError: %v", err)
		require.Equal(t, "timeout", ee.result)
		b, err := os.ReadFile(filepath.Join(dir, "pids"))
		require.NoError(t, err)
		pids := strings.Fields(string(b))
		require.Len(t, pids, 2, "the plugin and its child")
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			for _, pid := range pids {
				require.True(c, processGone(pid), "process %s still runs", pid)
			}
		}, 10*time.Second, 20*time.Millisecond)
	})
}

// processGone reports whether pid has exited (gone, or a zombie nobody
// reaped yet).
func processGone(pid string) bool {
	b, err := os.ReadFile("/proc/" + pid + "/stat")
	if err != nil {
		return true
	}
	_, rest, ok := strings.Cut(string(b), ") ")
	return ok && strings.HasPrefix(rest, "Z")
}

// fakeClock is a clock tests move by hand.
type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time { return c.t }

// TestExecAuthRefresh drives one execAuth with a fake clock and the real
// plugin: a credential is reused until it is due, refreshed in the
// background before it expires (callers keep the current one meanwhile),
// kept while a refresh fails and it is still valid, dropped on a 401, and
// a failing plugin is not run more often than its backoff allows.
func TestExecAuthRefresh(t *testing.T) {
	bin := BuildTestExecPlugin(t)
	p, dir := testPlugin(t, bin, "serve")
	status := filepath.Join(dir, "status.json")
	clock := &fakeClock{t: time.Now().Truncate(time.Second)} // expirationTimestamp has whole seconds
	t0 := clock.t
	m := newMetrics(nil)
	a := newExecAuth(p, slog.New(slog.DiscardHandler), m)
	a.now = clock.now
	defer a.close()
	ctx := t.Context()
	get := func() *execCredential {
		t.Helper()
		c, err := a.credential(ctx)
		require.NoError(t, err)
		return c
	}
	waitIdle := func() {
		t.Helper()
		require.Eventually(t, func() bool { a.mu.Lock(); defer a.mu.Unlock(); return a.inflight == nil }, 10*time.Second, 5*time.Millisecond)
	}

	// Lifetime 100 s: refreshed from 80 s on.
	writeFile(t, status, statusJSON(t, "token-a", t0.Add(100*time.Second)))
	require.Equal(t, "token-a", get().token)
	require.Equal(t, 1, runs(t, dir))
	writeFile(t, status, statusJSON(t, "token-b", t0.Add(1000*time.Second)))
	clock.t = t0.Add(50 * time.Second)
	require.Equal(t, "token-a", get().token, "not due yet: cached")
	require.Equal(t, 1, runs(t, dir))

	clock.t = t0.Add(85 * time.Second)
	require.Equal(t, "token-a", get().token, "due but valid: served while the refresh runs")
	waitIdle()
	require.Equal(t, "token-b", get().token, "refreshed before token-a expired")
	require.Equal(t, 2, runs(t, dir))

	// A refresh that fails keeps the valid credential, and backs off.
	require.NoError(t, os.Remove(status))
	clock.t = t0.Add(999*time.Second + 500*time.Millisecond) // token-b due, valid until 1000 s
	require.Equal(t, "token-b", get().token, "the failing refresh runs in the background")
	waitIdle()
	require.Equal(t, 3, runs(t, dir))
	require.Equal(t, "token-b", get().token, "a failed refresh keeps the valid credential")
	waitIdle()
	require.Equal(t, 3, runs(t, dir), "no run within the backoff")
	clock.t = t0.Add(1000*time.Second + 200*time.Millisecond) // token-b expired, still within the backoff
	_, err := a.credential(ctx)
	_, isExec := errors.AsType[*ExecError](err)
	require.True(t, isExec, "the last failure is returned: %v", err)
	require.Equal(t, 3, runs(t, dir), "no run within the backoff")
	require.InDelta(t, 1, testutil.ToFloat64(m.execRuns.WithLabelValues("failed")), 0)

	writeFile(t, status, statusJSON(t, "token-c", t0.Add(5000*time.Second)))
	clock.t = clock.t.Add(execMaxBackoff)
	require.Equal(t, "token-c", get().token, "after the backoff the plugin runs again")
	require.Equal(t, 4, runs(t, dir))

	// A 401 drops the credential (once it is old enough to not spin).
	c := get()
	a.reject(c)
	require.Same(t, c, get(), "a fresh credential is not dropped")
	clock.t = clock.t.Add(2 * execMinAgeToReject)
	a.reject(c)
	require.NotSame(t, c, get(), "a rejected credential is replaced")
	require.Equal(t, 5, runs(t, dir))
	require.InDelta(t, 1, testutil.ToFloat64(m.execRejected), 0)

	a.close()
	clock.t = clock.t.Add(time.Hour)
	_, err = a.credential(ctx)
	require.ErrorIs(t, err, errExecAuthClosed)
}
