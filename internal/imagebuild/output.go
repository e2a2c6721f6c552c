package imagebuild

import (
	"fmt"
	"path/filepath"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// refAnnotation names an index in the layout's index.json.
const refAnnotation = "org.opencontainers.image.ref.name"

// writeLayout writes a fresh OCI image layout at dir holding every image's
// index, each named by its reference.
func writeLayout(dir string, images []Built) error {
	lp, err := layout.Write(dir, empty.Index)
	if err != nil {
		return fmt.Errorf("layout %s: %w", dir, err)
	}
	for _, b := range images {
		if err := lp.AppendIndex(b.Index, layout.WithAnnotations(map[string]string{refAnnotation: b.Ref})); err != nil {
			return fmt.Errorf("layout %s: %s: %w", dir, b.Ref, err)
		}
	}
	return nil
}

// writeTarballs writes images-<os>-<arch>.tar per platform: every image of
// that platform, tagged with its reference, in the format `docker load`
// reads (docker save's: manifest.json, configs and layers).
func writeTarballs(cfg Config, images []Built) (map[string]string, error) {
	out := map[string]string{}
	for _, ps := range cfg.Platforms {
		refs := map[name.Reference]v1.Image{}
		for _, b := range images {
			tag, err := name.NewTag(b.Ref)
			if err != nil {
				return nil, fmt.Errorf("tag %s: %w", b.Ref, err)
			}
			refs[tag] = b.Platforms[ps]
		}
		path := filepath.Join(cfg.OutDir, "images-"+strings.ReplaceAll(ps, "/", "-")+".tar")
		if err := tarball.MultiRefWriteToFile(path, refs); err != nil {
			return nil, fmt.Errorf("tarball %s: %w", path, err)
		}
		out[ps] = path
	}
	return out, nil
}
