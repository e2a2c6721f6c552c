package imagebuild

import (
	"bytes"
	"encoding/json"
	"fmt"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/partial"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// emptyConfig is the OCI empty descriptor's content.
var emptyConfig = []byte("{}")

// artifact is an OCI 1.1 artifact manifest: artifactType, the empty
// config, one blob and the subject it describes.
type artifact struct {
	blob     v1.Layer
	manifest []byte
}

// newArtifact wraps blob (of mediaType) as an artifact about subject.
func newArtifact(blob []byte, mediaType, title string, subject v1.Descriptor, annotations map[string]string) (v1.Image, error) {
	l := static.NewLayer(blob, types.MediaType(mediaType))
	ld, err := partial.Descriptor(l)
	if err != nil {
		return nil, err
	}
	ld.Annotations = map[string]string{"org.opencontainers.image.title": title}
	ch, _, err := v1.SHA256(bytes.NewReader(emptyConfig))
	if err != nil {
		return nil, err
	}
	m := v1.Manifest{
		SchemaVersion: 2, MediaType: types.OCIManifestSchema1, ArtifactType: mediaType,
		Config:  v1.Descriptor{MediaType: types.OCIEmptyJSON, Size: int64(len(emptyConfig)), Digest: ch, Data: emptyConfig},
		Layers:  []v1.Descriptor{*ld},
		Subject: &subject, Annotations: annotations,
	}
	raw, err := json.Marshal(m)
	if err != nil {
		return nil, err
	}
	return partial.CompressedToImage(&artifact{blob: l, manifest: raw})
}

// RawConfigFile implements partial.CompressedImageCore.
func (a *artifact) RawConfigFile() ([]byte, error) { return emptyConfig, nil }

// MediaType implements partial.CompressedImageCore.
func (a *artifact) MediaType() (types.MediaType, error) { return types.OCIManifestSchema1, nil }

// RawManifest implements partial.CompressedImageCore.
func (a *artifact) RawManifest() ([]byte, error) { return a.manifest, nil }

// LayerByDigest implements partial.CompressedImageCore.
func (a *artifact) LayerByDigest(h v1.Hash) (partial.CompressedLayer, error) {
	if d, err := a.blob.Digest(); err == nil && d == h {
		return a.blob, nil
	}
	ch, _, err := v1.SHA256(bytes.NewReader(emptyConfig))
	if err == nil && ch == h {
		return static.NewLayer(emptyConfig, types.OCIEmptyJSON), nil
	}
	return nil, fmt.Errorf("artifact has no blob %s", h)
}
