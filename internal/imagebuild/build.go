package imagebuild

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/partial"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// Built is one image: its multi-platform index, and per platform (os/arch)
// the image and its SBOM.
type Built struct {
	Image Image
	// Ref is the image's reference (Config.Ref).
	Ref string
	// Index holds the platform images and, for each, its SBOM artifact.
	Index  v1.ImageIndex
	Digest v1.Hash
	// Platforms and SBOMs are keyed by os/arch.
	Platforms map[string]v1.Image
	SBOMs     map[string][]byte
}

// Result is what Build made and wrote.
type Result struct {
	// Layout is the OCI image layout directory (<OutDir>/oci).
	Layout string
	// Tarballs maps a platform (os/arch) to a tarball of that platform's
	// images for `docker load`.
	Tarballs map[string]string
	// Images in Config.Images order.
	Images []Built
}

// Build builds every image for every platform and writes them under
// cfg.OutDir (replacing what was there): the OCI layout, one docker-load
// tarball per platform, sbom/<name>_<os>_<arch>.spdx.json, and
// digests.txt (<ref>@<index digest>, one line per image).
func Build(ctx context.Context, cfg Config, deps Deps) (*Result, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("imagebuild: %w", err)
	}
	if deps.Log == nil {
		deps.Log = slog.New(slog.DiscardHandler)
	}
	if deps.CACertificates == nil {
		deps.CACertificates = MozillaRoots()
	}
	mtime := time.Unix(cfg.SourceDateEpoch, 0).UTC()
	base, err := layer(baseEntries(deps.CACertificates), mtime)
	if err != nil {
		return nil, err
	}
	tmp, err := os.MkdirTemp("", "isthmus-images-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	res := &Result{}
	for _, im := range cfg.Images {
		b, err := buildImage(ctx, cfg, im, base, tmp, mtime, deps.Log)
		if err != nil {
			return nil, err
		}
		res.Images = append(res.Images, *b)
	}
	if err := write(cfg, res); err != nil {
		return nil, err
	}
	return res, nil
}

// buildImage builds im for every platform and assembles its index.
func buildImage(ctx context.Context, cfg Config, im Image, base v1.Layer, tmp string, mtime time.Time, log *slog.Logger) (*Built, error) {
	b := &Built{Image: im, Ref: cfg.Ref(im), Platforms: map[string]v1.Image{}, SBOMs: map[string][]byte{}}
	var images, sboms []mutate.IndexAddendum
	for _, ps := range cfg.Platforms {
		p, _ := parsePlatform(ps) // validated
		start := time.Now()
		path := im.Binary
		if path == "" {
			var err error
			if path, err = goBuild(ctx, cfg, im, p, tmp); err != nil {
				return nil, err
			}
		}
		bin, err := os.ReadFile(path)
		if err != nil {
			return nil, err
		}
		sbom, err := SBOM(path, im.Name+"_"+p.OS+"_"+p.Architecture, cfg.Version, bin, mtime)
		if err != nil {
			return nil, err
		}
		img, err := platformImage(cfg, im, p, base, bin, mtime)
		if err != nil {
			return nil, fmt.Errorf("image %s %s: %w", im.Name, ps, err)
		}
		subject, err := partial.Descriptor(img)
		if err != nil {
			return nil, err
		}
		art, err := newArtifact(sbom, SBOMMediaType, sbomFile(im, p), v1.Descriptor{MediaType: subject.MediaType, Size: subject.Size, Digest: subject.Digest},
			map[string]string{"org.opencontainers.image.created": mtime.Format(time.RFC3339)})
		if err != nil {
			return nil, err
		}
		images = append(images, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{Platform: &p}})
		sboms = append(sboms, mutate.IndexAddendum{Add: art, Descriptor: v1.Descriptor{
			ArtifactType: SBOMMediaType, Platform: &v1.Platform{OS: "unknown", Architecture: "unknown"},
			Annotations: map[string]string{"dev.isthmus.sbom.subject": subject.Digest.String(), "dev.isthmus.sbom.platform": ps},
		}})
		b.Platforms[ps], b.SBOMs[ps] = img, sbom
		log.Info("built", "image", im.Name, "platform", ps, "binary_bytes", len(bin), "took", time.Since(start).Round(time.Millisecond))
	}
	idx := mutate.IndexMediaType(mutate.AppendManifests(empty.Index, append(images, sboms...)...), types.OCIImageIndex)
	b.Index = mutate.Annotations(idx, labels(cfg, im, mtime)).(v1.ImageIndex)
	var err error
	if b.Digest, err = b.Index.Digest(); err != nil {
		return nil, err
	}
	return b, nil
}

func sbomFile(im Image, p v1.Platform) string {
	return fmt.Sprintf("%s_%s_%s.spdx.json", im.Name, p.OS, p.Architecture)
}

// labels are the OCI labels of an image's config, and the annotations of
// its manifests and index.
func labels(cfg Config, im Image, created time.Time) map[string]string {
	return map[string]string{
		"org.opencontainers.image.title":       im.Name,
		"org.opencontainers.image.description": im.Description,
		"org.opencontainers.image.source":      cfg.Source,
		"org.opencontainers.image.url":         cfg.Source,
		"org.opencontainers.image.revision":    cfg.Commit,
		"org.opencontainers.image.version":     cfg.Version,
		"org.opencontainers.image.created":     created.Format(time.RFC3339),
		"org.opencontainers.image.licenses":    "Apache-2.0",
		"org.opencontainers.image.vendor":      "Isthmus",
	}
}

// platformImage is the base layer plus the binary's layer, run as
// nonroot with no shell.
func platformImage(cfg Config, im Image, p v1.Platform, base v1.Layer, bin []byte, mtime time.Time) (v1.Image, error) {
	binLayer, err := layer(binaryEntries(im.Name, bin), mtime)
	if err != nil {
		return nil, err
	}
	cf := &v1.ConfigFile{
		Architecture: p.Architecture, Variant: p.Variant, OS: p.OS, Created: v1.Time{Time: mtime},
		Config: v1.Config{
			Entrypoint: []string{"/" + binDir + "/" + im.Name},
			User:       fmt.Sprintf("%d:%d", nonRootID, nonRootID),
			WorkingDir: "/home/" + nonRootName,
			Env:        []string{"PATH=/" + binDir, "SSL_CERT_FILE=/" + caBundle},
			Labels:     labels(cfg, im, mtime),
		},
		RootFS: v1.RootFS{Type: "layers"},
	}
	img, err := mutate.ConfigFile(empty.Image, cf)
	if err != nil {
		return nil, err
	}
	img = mutate.ConfigMediaType(mutate.MediaType(img, types.OCIManifestSchema1), types.OCIConfigJSON)
	when := v1.Time{Time: mtime}
	img, err = mutate.Append(img,
		mutate.Addendum{Layer: base, History: v1.History{Created: when, CreatedBy: "isthmus imagebuild: base (passwd, group, nsswitch.conf, CA certificates)"}},
		mutate.Addendum{Layer: binLayer, History: v1.History{Created: when, CreatedBy: "isthmus imagebuild: /" + binDir + "/" + im.Name}})
	if err != nil {
		return nil, err
	}
	return mutate.Annotations(img, labels(cfg, im, mtime)).(v1.Image), nil
}

// write replaces cfg.OutDir's layout, tarballs, SBOMs and digests.txt.
func write(cfg Config, res *Result) error {
	res.Layout = filepath.Join(cfg.OutDir, "oci")
	if err := os.RemoveAll(cfg.OutDir); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(cfg.OutDir, "sbom"), 0o755); err != nil {
		return err
	}
	if err := writeLayout(res.Layout, res.Images); err != nil {
		return err
	}
	var err error
	if res.Tarballs, err = writeTarballs(cfg, res.Images); err != nil {
		return err
	}
	var digests []byte
	for _, b := range res.Images {
		digests = fmt.Appendf(digests, "%s@%s\n", b.Ref, b.Digest)
		for ps, sbom := range b.SBOMs {
			p, _ := parsePlatform(ps)
			if err := os.WriteFile(filepath.Join(cfg.OutDir, "sbom", sbomFile(b.Image, p)), sbom, 0o644); err != nil {
				return err
			}
		}
	}
	return os.WriteFile(filepath.Join(cfg.OutDir, "digests.txt"), digests, 0o644)
}
