package imagebuild

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// PushConfig says what to push where.
type PushConfig struct {
	// Layout is the OCI layout Build wrote (<OutDir>/oci).
	Layout string
	// Registry replaces the registry of every image's reference:
	// docker.io/isthmus/pilot:0.1.0 goes to <Registry>/isthmus/pilot:0.1.0.
	// It is a host[:port], optionally with a path (ghcr.io/acme).
	Registry string
	// Insecure allows plain HTTP (loopback and localhost always may).
	Insecure bool
}

// PushDeps are the optional collaborators of Push.
type PushDeps struct {
	// Log reports each image pushed (default: discard).
	Log *slog.Logger
	// Keychain authenticates to the registry (default: docker's config,
	// as `docker login` writes it).
	Keychain authn.Keychain
}

// Pushed is one image pushed: its tag and its reference by digest.
type Pushed struct {
	Tag, Digest string
}

// Push pushes every image of the layout (its whole index: every platform
// and every SBOM) to cfg.Registry under its tag, and returns what it
// pushed in layout order.
func Push(ctx context.Context, cfg PushConfig, deps PushDeps) ([]Pushed, error) {
	if cfg.Registry == "" || strings.Contains(cfg.Registry, "://") {
		return nil, fmt.Errorf("push: registry %q: want host[:port][/path]", cfg.Registry)
	}
	if deps.Log == nil {
		deps.Log = slog.New(slog.DiscardHandler)
	}
	if deps.Keychain == nil {
		deps.Keychain = authn.DefaultKeychain
	}
	lp, err := layout.FromPath(cfg.Layout)
	if err != nil {
		return nil, fmt.Errorf("push: layout %s: %w", cfg.Layout, err)
	}
	root, err := lp.ImageIndex()
	if err != nil {
		return nil, fmt.Errorf("push: layout %s: %w", cfg.Layout, err)
	}
	im, err := root.IndexManifest()
	if err != nil {
		return nil, err
	}
	var opts []name.Option
	if cfg.Insecure {
		opts = append(opts, name.Insecure)
	}
	var out []Pushed
	for _, d := range im.Manifests {
		src, err := name.NewTag(d.Annotations[refAnnotation])
		if err != nil {
			return nil, fmt.Errorf("push: layout entry %s has no image reference: %w", d.Digest, err)
		}
		dst, err := name.NewTag(cfg.Registry+"/"+src.RepositoryStr()+":"+src.TagStr(), opts...)
		if err != nil {
			return nil, fmt.Errorf("push: %w", err)
		}
		idx, err := root.ImageIndex(d.Digest)
		if err != nil {
			return nil, fmt.Errorf("push: %s: %w", src, err)
		}
		if err := remote.WriteIndex(dst, idx, remote.WithContext(ctx), remote.WithAuthFromKeychain(deps.Keychain)); err != nil {
			return nil, fmt.Errorf("push %s: %w", dst, err)
		}
		out = append(out, Pushed{Tag: dst.String(), Digest: dst.Context().Digest(d.Digest.String()).String()})
		deps.Log.Info("pushed", "image", dst.String(), "digest", d.Digest.String())
	}
	if len(out) == 0 {
		return nil, errors.New("push: the layout holds no image")
	}
	return out, nil
}
