// Package imagebuild builds Isthmus's container images without a container
// daemon: static Go binaries on a base assembled here (CA certificates, a
// non-root user, no shell), for several platforms, reproducibly, into an OCI
// image layout with an SPDX SBOM per image, plus tarballs that `docker load`
// accepts; Push copies the layout's images to a registry. It is the library
// behind `make images` and `make push` (hack/images).
package imagebuild

import (
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"regexp"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
)

// Image is one image: a Go main package and the name it is published as.
type Image struct {
	// Name is the last path element of the repository (pilot ->
	// <Registry>/isthmus/pilot) and of the binary (/usr/local/bin/pilot).
	Name string
	// Package is the main package, relative to Config.ModuleDir (./cmd/pilot).
	Package string
	// Binary, when set, is the path of a static binary built elsewhere
	// (a test's CoreDNS) packed instead of building Package; it is for one
	// platform, so Config.Platforms must then name only that one.
	Binary string
	// Description becomes the org.opencontainers.image.description label.
	Description string
}

// Images lists the images of Isthmus. Adding a binary is one line here.
func Images() []Image {
	return []Image{
		{Name: "pilot", Package: "./cmd/pilot", Description: "Isthmus control plane: multicluster federation, xDS and the mesh CA"},
		{Name: "ztunnel", Package: "./cmd/ztunnel", Description: "Isthmus node proxy and east-west gateway (HBONE)"},
		{Name: "isthmusctl", Package: "./cmd/isthmusctl", Description: "Isthmus command-line tool"},
		{Name: "isthmus-cni", Package: "./cmd/isthmus-cni", Description: "Isthmus CNI node agent and chained CNI plugin (pod enrolment)"},
	}
}

// Config says what to build and how to stamp it.
type Config struct {
	// ModuleDir is the root of the Go module (default ".").
	ModuleDir string
	// Images to build (default Images()).
	Images []Image
	// Platforms as os/arch (default linux/amd64 and linux/arm64).
	Platforms []string
	// Version and Commit are stamped into every binary (internal/version)
	// and into the images' labels; both required.
	Version, Commit string
	// SourceDateEpoch (seconds, usually the commit time) is the time of
	// every file, layer, config and SBOM: the same inputs give the same
	// digests.
	SourceDateEpoch int64
	// Registry and Repository name the images:
	// <Registry>/<Repository>/<Image.Name>:<Version>
	// (default docker.io and isthmus, as the charts' image values).
	Registry, Repository string
	// Source is the org.opencontainers.image.source label.
	Source string
	// OutDir receives oci/ (the layout), the tarballs and sbom/ (default
	// out/images).
	OutDir string
	// GoCmd is the go command (default "go").
	GoCmd string
}

// Deps are the optional collaborators of Build.
type Deps struct {
	// Log reports progress (default: discard).
	Log *slog.Logger
	// CACertificates is the PEM bundle put in the base (default:
	// MozillaRoots, pinned by go.sum).
	CACertificates []byte
}

const (
	defaultRegistry   = "docker.io"
	defaultRepository = "isthmus"
	defaultSource     = "https://github.com/isthmus-mesh/isthmus"
)

func (c Config) withDefaults() Config {
	if c.ModuleDir == "" {
		c.ModuleDir = "."
	}
	if c.Images == nil {
		c.Images = Images()
	}
	if len(c.Platforms) == 0 {
		c.Platforms = []string{"linux/amd64", "linux/arm64"}
	}
	if c.Registry == "" {
		c.Registry = defaultRegistry
	}
	if c.Repository == "" {
		c.Repository = defaultRepository
	}
	if c.Source == "" {
		c.Source = defaultSource
	}
	if c.OutDir == "" {
		c.OutDir = filepath.Join("out", "images")
	}
	if c.GoCmd == "" {
		c.GoCmd = "go"
	}
	return c
}

var (
	imageName = regexp.MustCompile(`^[a-z0-9]+([._-][a-z0-9]+)*$`)
	// versionText is what may go into a tag and an -X flag.
	versionText = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}$`)
)

func (c Config) validate() error {
	var errs []error
	if !versionText.MatchString(c.Version) {
		errs = append(errs, fmt.Errorf("version %q: want a tag-like string ([A-Za-z0-9_.+-], at most 128)", c.Version))
	}
	if !versionText.MatchString(c.Commit) {
		errs = append(errs, fmt.Errorf("commit %q: want a tag-like string", c.Commit))
	}
	if c.SourceDateEpoch < 0 {
		errs = append(errs, fmt.Errorf("source date epoch %d is negative", c.SourceDateEpoch))
	}
	if len(c.Images) == 0 {
		errs = append(errs, errors.New("no images"))
	}
	seen := map[string]bool{}
	for _, im := range c.Images {
		if !imageName.MatchString(im.Name) || seen[im.Name] {
			errs = append(errs, fmt.Errorf("image name %q: want a unique lower-case repository name", im.Name))
		}
		seen[im.Name] = true
		if im.Binary != "" {
			if len(c.Platforms) != 1 {
				errs = append(errs, fmt.Errorf("image %s: a prebuilt binary is for one platform, not %d", im.Name, len(c.Platforms)))
			}
		} else if !strings.HasPrefix(im.Package, "./") {
			errs = append(errs, fmt.Errorf("image %s: package %q must be relative to the module (./...)", im.Name, im.Package))
		}
	}
	for _, p := range c.Platforms {
		if _, err := parsePlatform(p); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// parsePlatform parses os/arch; arm64 gets variant v8, as registries list it.
func parsePlatform(s string) (v1.Platform, error) {
	osName, arch, ok := strings.Cut(s, "/")
	if !ok || osName != "linux" || (arch != "amd64" && arch != "arm64") {
		return v1.Platform{}, fmt.Errorf("platform %q: want linux/amd64 or linux/arm64", s)
	}
	p := v1.Platform{OS: osName, Architecture: arch}
	if arch == "arm64" {
		p.Variant = "v8"
	}
	return p, nil
}

// Ref is the reference an image is tagged with in the layout (its
// org.opencontainers.image.ref.name) and in the tarballs:
// <Registry>/<Repository>/<name>:<Version>, with the default registry and
// repository where c has none.
func (c Config) Ref(im Image) string {
	c = c.withDefaults()
	return c.Registry + "/" + c.Repository + "/" + im.Name + ":" + c.Version
}
