//go:build linux

package demo_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/isthmus-mesh/isthmus/test/framework/meshup"
)

func TestMain(m *testing.M) {
	if program := os.Getenv(probeEnv); program != "" {
		probeUserns(program) // exits
	}
	code := m.Run()
	if bins.dir != "" {
		os.RemoveAll(bins.dir)
	}
	if code == 0 {
		if err := goleak.Find(meshup.LeakOptions()...); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// bins are the demo's binaries, built once per test process into a folder
// every user may read (the rootless test runs them as nobody).
var bins struct {
	once sync.Once
	dir  string
	err  error
}

func binDir(t *testing.T) string {
	t.Helper()
	bins.once.Do(func() {
		bins.dir, bins.err = os.MkdirTemp("", "isthmus-demo-bin-")
		if bins.err != nil {
			return
		}
		if bins.err = os.Chmod(bins.dir, 0o755); bins.err != nil {
			return
		}
		build := exec.Command("go", "build", "-o", bins.dir+"/", "./cmd/pilot", "./cmd/ztunnel", "./cmd/isthmusctl", "./cmd/isthmus-cni", "./test/demo/isthmus-demo")
		build.Dir = filepath.Join("..", "..")
		if out, err := build.CombinedOutput(); err != nil {
			bins.err = fmt.Errorf("go build: %w\n%s", err, out)
		}
	})
	require.NoError(t, bins.err)
	return bins.dir
}
