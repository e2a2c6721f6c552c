package bench_test

import (
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// startServer starts cmd (a server under benchmark) with its output in
// <its folder>/<name>.log, stops it when the benchmark ends (SIGTERM, then
// SIGKILL after 15 s), and waits up to two minutes for readyURL to answer
// 200; it returns the log's path.
func startServer(b *testing.B, name string, cmd *exec.Cmd, readyURL string) string {
	b.Helper()
	logPath := filepath.Join(b.TempDir(), name+".log")
	logf, err := os.Create(logPath)
	require.NoError(b, err)
	cmd.Stdout, cmd.Stderr = logf, logf
	require.NoError(b, cmd.Start())
	b.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		logf.Close()
	})
	// Each poll is bounded: a server that accepts and never answers must
	// not hold the benchmark past the two minutes.
	poll := &http.Client{Timeout: 2 * time.Second}
	if !waitFor(2*time.Minute, func() bool {
		resp, err := poll.Get(readyURL)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}) {
		log, _ := os.ReadFile(logPath)
		b.Fatalf("%s not ready within two minutes (%s); its log:\n%s", name, readyURL, log)
	}
	return logPath
}

// repoRoot returns the top folder of this repository's work tree.
func repoRoot(b *testing.B) string {
	b.Helper()
	top, err := exec.Command("git", "rev-parse", "--show-toplevel").Output()
	require.NoError(b, err)
	return strings.TrimSpace(string(top))
}

// waitFor polls ok every 100 ms until it holds or d passed.
func waitFor(d time.Duration, ok func() bool) bool {
	for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		if ok() {
			return true
		}
	}
	return false
}
