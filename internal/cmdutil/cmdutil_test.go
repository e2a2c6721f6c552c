package cmdutil_test

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/spf13/pflag"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/internal/cmdutil"
)

func TestLoggerFollowsTheFlags(t *testing.T) {
	l := cmdutil.Log{Format: "text", Level: "info"}
	f := pflag.NewFlagSet("x", pflag.ContinueOnError)
	l.AddFlags(f)
	require.NoError(t, f.Parse([]string{"--log-format=json", "--log-level=warn"}))
	var buf bytes.Buffer
	log, err := l.Logger(&buf)
	require.NoError(t, err)
	log.Info("hidden")
	log.Warn("shown", "k", "v")
	var rec map[string]any
	require.NoError(t, json.Unmarshal(buf.Bytes(), &rec), buf.String())
	require.Equal(t, "shown", rec["msg"])
	require.Equal(t, "v", rec["k"])
}

func TestLoggerRejectsBadFlags(t *testing.T) {
	_, err := cmdutil.Log{Format: "xml", Level: "info"}.Logger(&bytes.Buffer{})
	require.ErrorContains(t, err, "--log-format")
	_, err = cmdutil.Log{Format: "json", Level: "loud"}.Logger(&bytes.Buffer{})
	require.ErrorContains(t, err, "--log-level")
}

func TestRestConfigReadsTheNamedContext(t *testing.T) {
	path := filepath.Join(t.TempDir(), "kubeconfig")
	require.NoError(t, os.WriteFile(path, []byte(`apiVersion: v1
kind: Config
clusters:
- name: a
  cluster: {server: "https://127.0.0.1:1"}
- name: b
  cluster: {server: "https://127.0.0.2:2"}
users:
- name: u
  user: {token: t}
contexts:
- name: a
  context: {cluster: a, user: u}
- name: b
  context: {cluster: b, user: u}
current-context: a
`), 0o600))
	cfg, err := cmdutil.RestConfig(path, "")
	require.NoError(t, err)
	require.Equal(t, "https://127.0.0.1:1", cfg.Host)
	cfg, err = cmdutil.RestConfig(path, "b")
	require.NoError(t, err)
	require.Equal(t, "https://127.0.0.2:2", cfg.Host)
	_, err = cmdutil.RestConfig(path, "c")
	require.ErrorContains(t, err, path)
	_, err = cmdutil.RestConfig(filepath.Join(t.TempDir(), "missing"), "")
	require.ErrorContains(t, err, "missing")
}

func TestFlagDefaultsFromTheEnvironment(t *testing.T) {
	t.Setenv("ISTHMUS_TEST_SET", "a")
	t.Setenv("ISTHMUS_TEST_EMPTY", "")
	require.Equal(t, "a", cmdutil.EnvOr("ISTHMUS_TEST_SET", "d"))
	require.Equal(t, "d", cmdutil.EnvOr("ISTHMUS_TEST_EMPTY", "d"))
	t.Setenv("ISTHMUS_TEST_LIST", "10.0.0.1,fd00::1")
	require.Equal(t, []string{"10.0.0.1", "fd00::1"}, cmdutil.SplitEnv("ISTHMUS_TEST_LIST"))
	require.Nil(t, cmdutil.SplitEnv("ISTHMUS_TEST_EMPTY"))
}
