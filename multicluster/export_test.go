package multicluster

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
)

// BuildTestExecPlugin compiles internal/testexecplugin into a temporary
// folder of t and returns the binary's absolute path.
func BuildTestExecPlugin(t testing.TB) string {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		goBin = filepath.Join(runtime.GOROOT(), "bin", "go")
	}
	out := filepath.Join(t.TempDir(), "testexecplugin")
	cmd := exec.Command(goBin, "build", "-o", out, "github.com/isthmus-mesh/isthmus/multicluster/internal/testexecplugin")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building the test exec plugin with %s: %v\n%s", goBin, err, b)
	}
	return out
}
