package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

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

// TestVersionFromLdflags builds the binary with -X main.version and runs
// it: the version is printed, and a failing command exits non-zero with
// its error on stderr.
func TestVersionFromLdflags(t *testing.T) {
	out, _, err := runCtl(t, "version")
	require.NoError(t, err)
	require.Equal(t, "dev\n", out)

	bin := filepath.Join(t.TempDir(), "isthmusctl")
	build := exec.Command("go", "build", "-ldflags=-X main.version=v9.8.7-test", "-o", bin, ".")
	b, err := build.CombinedOutput()
	require.NoError(t, err, string(b))
	b, err = exec.Command(bin, "version").Output()
	require.NoError(t, err)
	require.Equal(t, "v9.8.7-test\n", string(b))

	cmd := exec.Command(bin, "registry", "services", "-o", "xml")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	err = cmd.Run()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit)
	require.Equal(t, 1, exit.ExitCode())
	require.Contains(t, stderr.String(), `unknown output format "xml"`)

	// Commands with their own exit codes: analyze (79 on issues) and
	// manifest diff (1 when different, 2 on error).
	for _, tc := range []struct {
		args   []string
		code   int
		stderr string
	}{
		{[]string{"analyze", "-f", "testdata/analyze"}, exitAnalyzeIssues, "analyze found issues"},
		{[]string{"analyze", "-f", "testdata/analyze", "--failure-threshold", "Error", "--suppress", "ISM0008=*"}, 0, ""},
		{[]string{"manifest", "diff", "testdata/analyze/primary", "testdata/analyze/cluster-2"}, exitDiffers, ""},
		{[]string{"manifest", "diff", "testdata/analyze/primary", "testdata/analyze/primary"}, 0, ""},
		{[]string{"manifest", "diff", "testdata/analyze/primary"}, exitDiffError, "takes two paths"},
	} {
		cmd := exec.Command(bin, tc.args...)
		stderr.Reset()
		cmd.Stderr = &stderr
		err := cmd.Run()
		code := 0
		if errors.As(err, &exit) {
			code = exit.ExitCode()
		} else {
			require.NoError(t, err)
		}
		require.Equal(t, tc.code, code, "%v: %s", tc.args, stderr.String())
		if tc.stderr == "" {
			require.Empty(t, stderr.String(), "%v", tc.args)
		} else {
			require.Contains(t, stderr.String(), tc.stderr, "%v", tc.args)
		}
	}
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
