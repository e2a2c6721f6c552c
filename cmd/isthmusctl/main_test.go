package main

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/isthmus-mesh/isthmus/internal/version"
	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

var clusters *framework.ClusterSet

func TestMain(m *testing.M) {
	os.Exit(framework.Main(m, framework.Options{Names: []string{"primary", "remote"}}, &clusters))
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

// TestVersionFromLdflags builds the binary stamped as make build stamps it
// and runs it: --version and `version --client` print the version and the
// commit, and a failing command exits non-zero with its error on stderr.
func TestVersionFromLdflags(t *testing.T) {
	out, _, err := runCtl(t, "version", "--client")
	require.NoError(t, err)
	require.Equal(t, "client: "+version.String()+"\n", out)

	bin := filepath.Join(t.TempDir(), "isthmusctl")
	const pkg = "github.com/isthmus-mesh/isthmus/internal/version"
	build := exec.Command("go", "build", "-ldflags=-X "+pkg+".version=9.8.7-test -X "+pkg+".commit=0123abcd", "-o", bin, ".")
	b, err := build.CombinedOutput()
	require.NoError(t, err, string(b))
	want := "9.8.7-test (commit 0123abcd, " + runtime.Version() + ")"
	b, err = exec.Command(bin, "--version").Output()
	require.NoError(t, err)
	require.Equal(t, "isthmusctl "+want+"\n", string(b))
	b, err = exec.Command(bin, "version", "--client").Output()
	require.NoError(t, err)
	require.Equal(t, "client: "+want+"\n", string(b))

	cmd := exec.Command(bin, "registry", "services", "-o", "xml")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	err = cmd.Run()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit)
	require.Equal(t, 1, exit.ExitCode())
	require.Contains(t, stderr.String(), `unknown output format "xml"`)
}

// TestVersionOfRealPilot runs a real pilot on the primary cluster and asks
// it for its version over its debug server: both lines are printed, and -o
// json carries both builds. With pilot gone, the client line is still
// printed and the command fails naming the server.
func TestVersionOfRealPilot(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	require.NoError(t, clusters.Cluster("primary").EnsureNamespace(ctx, "isthmus-version", nil))
	p, err := server.New(server.Config{Namespace: "isthmus-version", NoLeaderElection: true,
		DebugAddr: "127.0.0.1:0", MonitoringAddr: "-", GRPCAddr: "-", Logger: slog.New(slog.DiscardHandler)},
		clusters.Cluster("primary").Config, nil)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	require.Eventually(t, func() bool { return p.DebugAddr() != "" }, 20*time.Second, 10*time.Millisecond)
	pilot := "http://" + p.DebugAddr()

	out, _, err := runCtl(t, "version", "--pilot", pilot)
	require.NoError(t, err)
	require.Equal(t, "client: "+version.String()+"\nserver: "+version.String()+"\n", out)
	out, _, err = runCtl(t, "version", "--pilot", pilot, "-o", "json")
	require.NoError(t, err)
	var v struct{ Client, Server version.Info }
	require.NoError(t, json.Unmarshal([]byte(out), &v))
	require.Equal(t, version.Get(), v.Client)
	require.Equal(t, version.Get(), v.Server)

	cancel()
	require.NoError(t, <-done)
	out, _, err = runCtl(t, "version", "--pilot", pilot)
	require.ErrorContains(t, err, "server version: GET "+pilot+"/version")
	require.Equal(t, "client: "+version.String()+"\n", out)
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
