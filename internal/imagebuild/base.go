package imagebuild

import (
	"archive/tar"
	"bytes"
	"encoding/pem"
	"fmt"
	"io"
	"slices"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"golang.org/x/crypto/x509roots/fallback/bundle"
)

// The non-root user every image runs as (distroless's "nonroot").
const (
	nonRootID   = 65532
	nonRootName = "nonroot"
	binDir      = "usr/local/bin"
	caBundle    = "etc/ssl/certs/ca-certificates.crt"
)

// MozillaRoots returns the roots of Mozilla's NSS trust store shipped by
// golang.org/x/crypto/x509roots/fallback as one PEM bundle. The module is
// pinned by go.sum, so one commit gives the same bundle on every machine
// (the build machine's /etc/ssl/certs would make the base depend on its
// ca-certificates package). Roots with a distrust-after constraint are
// left out: a PEM bundle cannot carry the constraint.
func MozillaRoots() []byte {
	var b bytes.Buffer
	for r := range bundle.Roots() {
		if r.Constraint != nil {
			continue
		}
		_ = pem.Encode(&b, &pem.Block{Type: "CERTIFICATE", Bytes: r.Certificate})
	}
	return b.Bytes()
}

// entry is one file or directory of a layer.
type entry struct {
	path     string // relative, no leading slash
	dir      bool
	mode     int64
	uid, gid int
	body     []byte
}

// layer writes entries as one reproducible tar layer: sorted by path, every
// time set to mtime, fixed owners and modes, no user or group names, PAX
// headers only where a field needs them. It is gzip-compressed by
// go-containerregistry, which writes no name or time in the gzip header.
func layer(entries []entry, mtime time.Time) (v1.Layer, error) {
	entries = slices.Clone(entries)
	slices.SortFunc(entries, func(a, b entry) int {
		switch {
		case a.path < b.path:
			return -1
		case a.path > b.path:
			return 1
		}
		return 0
	})
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for i, e := range entries {
		if i > 0 && entries[i-1].path == e.path {
			return nil, fmt.Errorf("layer: %s twice", e.path)
		}
		h := &tar.Header{Name: e.path, Mode: e.mode, Uid: e.uid, Gid: e.gid, ModTime: mtime, Format: tar.FormatPAX}
		if e.dir {
			h.Typeflag, h.Name = tar.TypeDir, e.path+"/"
		} else {
			h.Typeflag, h.Size = tar.TypeReg, int64(len(e.body))
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, fmt.Errorf("layer: %s: %w", e.path, err)
		}
		if _, err := tw.Write(e.body); err != nil {
			return nil, fmt.Errorf("layer: %s: %w", e.path, err)
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	b := buf.Bytes()
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil },
		tarball.WithMediaType(types.OCILayer), tarball.WithCompressedCaching)
}

// baseEntries are the files of the base layer: root and nonroot in
// /etc/passwd and /etc/group (no login shell: there is none), the CA
// bundle, a hosts-then-DNS nsswitch.conf, nonroot's home and /tmp.
func baseEntries(caPEM []byte) []entry {
	dir := func(p string, mode int64, id int) entry {
		return entry{path: p, dir: true, mode: mode, uid: id, gid: id}
	}
	file := func(p string, body string) entry { return entry{path: p, mode: 0o644, body: []byte(body)} }
	return []entry{
		dir("etc", 0o755, 0), dir("etc/ssl", 0o755, 0), dir("etc/ssl/certs", 0o755, 0),
		file("etc/passwd", "root:x:0:0:root:/root:/sbin/nologin\n"+
			fmt.Sprintf("%[2]s:x:%[1]d:%[1]d:%[2]s:/home/%[2]s:/sbin/nologin\n", nonRootID, nonRootName)),
		file("etc/group", fmt.Sprintf("root:x:0:\n%[2]s:x:%[1]d:\n", nonRootID, nonRootName)),
		file("etc/nsswitch.conf", "hosts: files dns\n"),
		{path: caBundle, mode: 0o644, body: caPEM},
		dir("home", 0o755, 0), dir("home/"+nonRootName, 0o700, nonRootID),
		dir("root", 0o700, 0),
		dir("tmp", 0o1777, 0),
	}
}

// binaryEntries put one executable at /usr/local/bin/<name>.
func binaryEntries(name string, bin []byte) []entry {
	return []entry{
		{path: "usr", dir: true, mode: 0o755}, {path: "usr/local", dir: true, mode: 0o755},
		{path: binDir, dir: true, mode: 0o755},
		{path: binDir + "/" + name, mode: 0o755, body: bin},
	}
}
