package realnode

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"time"

	"github.com/isthmus-mesh/isthmus/internal/imagebuild"
)

// buildImages builds the pause image, CoreDNS's (from the node binaries)
// and the test's images for this machine's platform with internal/imagebuild (static binaries on its
// from-scratch base) into one docker-archive tarball, which every node's
// containerd imports; it fills s.images (name -> reference).
func (s *Set) buildImages() (string, error) {
	t0 := time.Now()
	images := []imagebuild.Image{{Name: pauseImage, Package: "./test/framework/realnode/pause", Description: "real-node test sandbox"}}
	if !s.opts.NoClusterDNS {
		images = append(images, imagebuild.Image{Name: corednsImage, Binary: filepath.Join(s.opts.NodeBinDir, "coredns"), Description: "real-node cluster DNS"})
	}
	images = append(images, s.opts.Images...)
	platform := "linux/" + runtime.GOARCH
	cfg := imagebuild.Config{
		ModuleDir: s.opts.ModuleDir, Images: images, Platforms: []string{platform},
		Version: imageVersion, Commit: "test", Registry: imageRegistry, Repository: imageRepo,
		OutDir: filepath.Join(s.dir, "images"),
	}
	res, err := imagebuild.Build(context.Background(), cfg, imagebuild.Deps{Log: s.log})
	if err != nil {
		return "", fmt.Errorf("build images: %w", err)
	}
	s.images = map[string]string{}
	for _, b := range res.Images {
		s.images[b.Image.Name] = b.Ref
	}
	s.log.Info("images built", "images", len(images), "took", time.Since(t0).Round(time.Millisecond))
	return res.Tarballs[platform], nil
}

// goBuild builds the main package pkg of the module in dir into out,
// static.
func goBuild(dir, pkg, out string) error {
	cmd := exec.Command("go", "build", "-trimpath", "-o", out, pkg)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go build %s: %w: %s", pkg, err, bytes.TrimSpace(stderr.Bytes()))
	}
	return nil
}
