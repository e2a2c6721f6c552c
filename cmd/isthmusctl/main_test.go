package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/internal/version"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

var clusters *framework.ClusterSet

func TestMain(m *testing.M) {
	code := framework.Main(m, framework.Options{Names: []string{"primary", "remote"}}, &clusters)
	if binDir != "" {
		_ = os.RemoveAll(binDir) // ctlBinary's build
	}
	os.Exit(code)
}

// runCtl runs isthmusctl with args and returns its stdout and stderr.
func runCtl(t *testing.T, args ...string) (string, string, error) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	err := run(context.Background(), args, &stdout, &stderr)
	return stdout.String(), stderr.String(), err
}

// writeKubeconfig writes an admin kubeconfig for cfg with one context named
// name, and returns its path.
func writeKubeconfig(t *testing.T, name string, cfg *rest.Config) string {
	t.Helper()
	kc := clientcmdapi.NewConfig()
	kc.Clusters[name] = &clientcmdapi.Cluster{Server: cfg.Host, CertificateAuthorityData: cfg.CAData}
	kc.AuthInfos[name] = &clientcmdapi.AuthInfo{ClientCertificateData: cfg.CertData, ClientKeyData: cfg.KeyData, Token: cfg.BearerToken}
	kc.Contexts[name] = &clientcmdapi.Context{Cluster: name, AuthInfo: name}
	kc.CurrentContext = name
	path := filepath.Join(t.TempDir(), name+".kubeconfig")
	require.NoError(t, clientcmd.WriteToFile(*kc, path))
	return path
}

// Stamps of the binary ctlBinary builds, as make build stamps.
const (
	binVersion = "9.8.7-test"
	binCommit  = "0123abcd"
)

var (
	buildOnce sync.Once
	binDir    string
	buildErr  error
)

// ctlBinary builds isthmusctl once for the package's tests, stamped with
// binVersion and binCommit, into a directory as <dir>/bin/isthmusctl (the
// README's path), and returns dir. Tests that run a pilot in-process run
// isthmusctl as this separate process, as users do: isthmusctl sets
// client-go's global logger, which an in-process pilot reads.
func ctlBinary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		if binDir, buildErr = os.MkdirTemp("", "isthmusctl-bin-"); buildErr != nil {
			return
		}
		const pkg = "github.com/isthmus-mesh/isthmus/internal/version"
		out, err := exec.Command("go", "build", "-ldflags=-X "+pkg+".version="+binVersion+" -X "+pkg+".commit="+binCommit,
			"-o", filepath.Join(binDir, "bin", "isthmusctl"), ".").CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("go build: %w: %s", err, out)
		}
	})
	require.NoError(t, buildErr)
	return binDir
}

// runBinary runs the built isthmusctl with args in dir and returns its
// stdout, stderr and error.
func runBinary(t *testing.T, dir string, args ...string) (string, string, error) {
	t.Helper()
	cmd := exec.Command(filepath.Join(ctlBinary(t), "bin", "isthmusctl"), args...)
	cmd.Dir = dir
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	return stdout.String(), stderr.String(), err
}

// TestVersionFromLdflags runs the binary stamped as make build stamps it:
// --version and `version --client` print the version and the commit, and
// a failing command exits non-zero with its error on stderr.
func TestVersionFromLdflags(t *testing.T) {
	out, _, err := runCtl(t, "version", "--client")
	require.NoError(t, err)
	require.Equal(t, "client: "+version.String()+"\n", out)

	want := binVersion + " (commit " + binCommit + ", " + runtime.Version() + ")"
	out, _, err = runBinary(t, t.TempDir(), "--version")
	require.NoError(t, err)
	require.Equal(t, "isthmusctl "+want+"\n", out)
	out, _, err = runBinary(t, t.TempDir(), "version", "--client")
	require.NoError(t, err)
	require.Equal(t, "client: "+want+"\n", out)

	_, stderr, err := runBinary(t, t.TempDir(), "registry", "services", "-o", "xml")
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit)
	require.Equal(t, 1, exit.ExitCode())
	require.Contains(t, stderr, `unknown output format "xml"`)

	// Commands with their own exit codes: analyze (79 on issues) and
	// manifest diff (1 when different, 2 on error).
	td, err := filepath.Abs("testdata/analyze")
	require.NoError(t, err)
	for _, tc := range []struct {
		args   []string
		code   int
		stderr string
	}{
		{[]string{"analyze", "-f", td}, exitAnalyzeIssues, "analyze found issues"},
		{[]string{"analyze", "-f", td, "--failure-threshold", "Error", "--suppress", "ISM0008=*"}, 0, ""},
		{[]string{"manifest", "diff", td + "/primary", td + "/cluster-2"}, exitDiffers, ""},
		{[]string{"manifest", "diff", td + "/primary", td + "/primary"}, 0, ""},
		{[]string{"manifest", "diff", td + "/primary"}, exitDiffError, "takes two paths"},
	} {
		_, stderr, err := runBinary(t, t.TempDir(), tc.args...)
		code := 0
		if errors.As(err, &exit) {
			code = exit.ExitCode()
		} else {
			require.NoError(t, err)
		}
		require.Equal(t, tc.code, code, "%v: %s", tc.args, stderr)
		if tc.stderr == "" {
			require.Empty(t, stderr, "%v", tc.args)
		} else {
			require.Contains(t, stderr, tc.stderr, "%v", tc.args)
		}
	}
}

// runPilot runs a real pilot of the primary cluster in namespace ns, with
// its debug server on loopback, until the test ends, and returns its debug
// URL.
func runPilot(t *testing.T, ns, clusterID, network string) string {
	t.Helper()
	primary := clusters.Cluster("primary")
	require.NoError(t, primary.EnsureNamespace(context.Background(), ns, nil))
	p, err := server.New(server.Config{Namespace: ns, ClusterID: model.ClusterID(clusterID), Network: model.Network(network),
		NoLeaderElection: true, DebugAddr: "127.0.0.1:0", MonitoringAddr: defaults.Disabled, GRPCAddr: defaults.Disabled, Logger: slog.New(slog.DiscardHandler)},
		primary.Config, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	require.Eventually(t, func() bool { return p.DebugAddr() != "" }, 20*time.Second, 10*time.Millisecond)
	return "http://" + p.DebugAddr()
}

// TestVersionOfRealPilot runs a real pilot on the primary cluster and asks
// it for its version over its debug server: both lines are printed, and -o
// json carries both builds. With pilot gone, the client line is still
// printed and the command fails naming the server.
func TestVersionOfRealPilot(t *testing.T) {
	want := version.Info{Version: binVersion, Commit: binCommit, GoVersion: runtime.Version()}
	var pilot string
	t.Run("pilot up", func(t *testing.T) {
		pilot = runPilot(t, "isthmus-version", "primary", "")
		out, stderr, err := runBinary(t, t.TempDir(), "version", "--pilot", pilot)
		require.NoError(t, err, stderr)
		require.Equal(t, "client: "+want.String()+"\nserver: "+version.String()+"\n", out)
		out, stderr, err = runBinary(t, t.TempDir(), "version", "--pilot", pilot, "-o", "json")
		require.NoError(t, err, stderr)
		var v struct{ Client, Server version.Info }
		require.NoError(t, json.Unmarshal([]byte(out), &v))
		require.Equal(t, want, v.Client)
		require.Equal(t, version.Get(), v.Server)
	})
	out, stderr, err := runBinary(t, t.TempDir(), "version", "--pilot", pilot)
	require.Error(t, err)
	require.Contains(t, stderr, "server version: GET "+pilot+"/version")
	require.Equal(t, "client: "+want.String()+"\n", out)
}

// TestCompletion checks that cobra's completion command is wired in.
func TestCompletion(t *testing.T) {
	for _, shell := range []string{"bash", "zsh", "fish", "powershell"} {
		out, _, err := runCtl(t, "completion", shell)
		require.NoError(t, err, shell)
		require.Contains(t, out, "isthmusctl", shell)
	}
	out, _, err := runCtl(t, "__complete", "registry", "")
	require.NoError(t, err)
	require.True(t, strings.Contains(out, "services") && strings.Contains(out, "workloads"), out)
}
