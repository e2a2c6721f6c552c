package imagebuild

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

	v1 "github.com/google/go-containerregistry/pkg/v1"
)

// versionPackage receives the -X stamps (see internal/version).
const versionPackage = "github.com/isthmus-mesh/isthmus/internal/version"

// LDFlags are the linker flags of a release binary: no symbol table or
// DWARF (stack traces keep their names), the version and the commit.
func LDFlags(version, commit string) string {
	return fmt.Sprintf("-s -w -X %[1]s.version=%[2]s -X %[1]s.commit=%[3]s", versionPackage, version, commit)
}

// goBuild builds im for p into dir and returns the binary's path. The
// binary is static (CGO_ENABLED=0) and reproducible: -trimpath drops local
// paths, -buildvcs=false keeps the VCS state out (the commit is stamped
// instead), and the environment that selects code generation is fixed.
func goBuild(ctx context.Context, cfg Config, im Image, p v1.Platform, dir string) (string, error) {
	out := filepath.Join(dir, fmt.Sprintf("%s-%s-%s", im.Name, p.OS, p.Architecture))
	cmd := exec.CommandContext(ctx, cfg.GoCmd, "build", "-trimpath", "-buildvcs=false", "-mod=readonly",
		"-ldflags="+LDFlags(cfg.Version, cfg.Commit), "-o", out, im.Package)
	cmd.Dir = cfg.ModuleDir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS="+p.OS, "GOARCH="+p.Architecture,
		"GOAMD64=v1", "GOARM64=v8.0", "GOFLAGS=", "GOEXPERIMENT=")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("go build %s for %s/%s: %w: %s", im.Package, p.OS, p.Architecture, err, bytes.TrimSpace(stderr.Bytes()))
	}
	return out, nil
}
