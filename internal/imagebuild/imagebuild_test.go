package imagebuild_test

import (
	"archive/tar"
	"context"
	"crypto/x509"
	"debug/buildinfo"
	"debug/elf"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/internal/imagebuild"
)

// The stamps of the test builds, and the time of every file.
const (
	testVersion = "0.0.0-test.1"
	testCommit  = "0123456789abcdef0123456789abcdef01234567"
	testEpoch   = 1767225600 // 2026-01-01T00:00:00Z
)

// platforms are the host's (whose binaries the tests run) and, with
// ISTHMUS_IMAGE_TEST_ALL_PLATFORMS=1 (make images-check), one other: on a
// fresh machine the other architecture's first build compiles every
// dependency again, which `make test` leaves to `make images`.
func platforms() []string {
	host := "linux/" + runtime.GOARCH
	if os.Getenv("ISTHMUS_IMAGE_TEST_ALL_PLATFORMS") != "1" {
		return []string{host}
	}
	if runtime.GOARCH == "amd64" {
		return []string{host, "linux/arm64"}
	}
	return []string{host, "linux/amd64"}
}

var (
	buildOnce sync.Once
	built     *imagebuild.Result
	buildErr  error
)

// build builds every image once for the package's tests (into a directory
// removed when the process exits: see TestMain).
func build(t *testing.T) *imagebuild.Result {
	t.Helper()
	buildOnce.Do(func() {
		built, buildErr = buildInto(filepath.Join(outRoot, "a"))
	})
	require.NoError(t, buildErr)
	return built
}

func buildInto(dir string) (*imagebuild.Result, error) {
	return imagebuild.Build(context.Background(), imagebuild.Config{
		ModuleDir: "../..", Platforms: platforms(), Version: testVersion, Commit: testCommit,
		SourceDateEpoch: testEpoch, OutDir: dir,
	}, imagebuild.Deps{})
}

var outRoot string

func TestMain(m *testing.M) {
	var err error
	if outRoot, err = os.MkdirTemp("", "imagebuild-test-"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	_ = os.RemoveAll(outRoot)
	os.Exit(code)
}

// TestReproducible builds everything twice into two directories: every
// index, platform image and SBOM has the same digest, and the two OCI
// layouts' index.json are byte-identical.
func TestReproducible(t *testing.T) {
	a := build(t)
	b, err := buildInto(filepath.Join(outRoot, "b"))
	require.NoError(t, err)
	require.Len(t, b.Images, len(imagebuild.Images()))
	for i := range a.Images {
		require.Equal(t, a.Images[i].Ref, b.Images[i].Ref)
		require.Equal(t, a.Images[i].Digest, b.Images[i].Digest, "index of %s", a.Images[i].Ref)
		t.Logf("%s@%s", a.Images[i].Ref, a.Images[i].Digest)
		for _, p := range platforms() {
			da, err := a.Images[i].Platforms[p].Digest()
			require.NoError(t, err)
			db, err := b.Images[i].Platforms[p].Digest()
			require.NoError(t, err)
			require.Equal(t, da, db, "%s %s", a.Images[i].Ref, p)
			require.Equal(t, a.Images[i].SBOMs[p], b.Images[i].SBOMs[p])
		}
	}
	ia, err := os.ReadFile(filepath.Join(a.Layout, "index.json"))
	require.NoError(t, err)
	ib, err := os.ReadFile(filepath.Join(b.Layout, "index.json"))
	require.NoError(t, err)
	require.Equal(t, string(ia), string(ib))
	da, err := os.ReadFile(filepath.Join(a.Layout, "..", "digests.txt"))
	require.NoError(t, err)
	require.Equal(t, len(a.Images), strings.Count(string(da), "\n"))
}

// files reads every layer of img: path -> header and content.
func files(t *testing.T, img v1.Image) (map[string]*tar.Header, map[string][]byte, [][]string) {
	t.Helper()
	layers, err := img.Layers()
	require.NoError(t, err)
	hdrs, bodies := map[string]*tar.Header{}, map[string][]byte{}
	var order [][]string
	for _, l := range layers {
		rc, err := l.Uncompressed()
		require.NoError(t, err)
		tr := tar.NewReader(rc)
		var names []string
		for {
			h, err := tr.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			require.NoError(t, err)
			b, err := io.ReadAll(tr)
			require.NoError(t, err)
			p := strings.TrimSuffix(h.Name, "/")
			hdrs[p], bodies[p] = h, b
			names = append(names, p)
		}
		require.NoError(t, rc.Close())
		order = append(order, names)
	}
	return hdrs, bodies, order
}

// TestImageConfig checks every image of every platform: its config
// (platform, entrypoint, user 65532, OCI labels, created time) and its
// files: root and nonroot users, no shell, a CA bundle, the binary, tar
// entries sorted with fixed times and owners.
func TestImageConfig(t *testing.T) {
	res := build(t)
	created := time.Unix(testEpoch, 0).UTC()
	for _, b := range res.Images {
		for _, p := range platforms() {
			t.Run(b.Image.Name+" "+p, func(t *testing.T) {
				img := b.Platforms[p]
				cf, err := img.ConfigFile()
				require.NoError(t, err)
				require.Equal(t, "linux/"+cf.Architecture, p)
				require.Equal(t, []string{"/usr/local/bin/" + b.Image.Name}, cf.Config.Entrypoint)
				require.Empty(t, cf.Config.Cmd)
				require.Equal(t, "65532:65532", cf.Config.User)
				require.True(t, cf.Created.Time.Equal(created))
				require.Equal(t, map[string]string{
					"org.opencontainers.image.title": b.Image.Name, "org.opencontainers.image.description": b.Image.Description,
					"org.opencontainers.image.source": "https://github.com/isthmus-mesh/isthmus", "org.opencontainers.image.url": "https://github.com/isthmus-mesh/isthmus",
					"org.opencontainers.image.revision": testCommit, "org.opencontainers.image.version": testVersion,
					"org.opencontainers.image.created": "2026-01-01T00:00:00Z", "org.opencontainers.image.licenses": "Apache-2.0",
					"org.opencontainers.image.vendor": "Isthmus",
				}, cf.Config.Labels)

				hdrs, bodies, order := files(t, img)
				for _, names := range order {
					require.IsNonDecreasing(t, names, "tar entries are sorted")
				}
				for p, h := range hdrs {
					require.True(t, h.ModTime.Equal(created), "%s mtime %s", p, h.ModTime)
					require.Empty(t, h.Uname+h.Gname, p)
					if p != "home/nonroot" {
						require.Equal(t, [2]int{0, 0}, [2]int{h.Uid, h.Gid}, "%s is root's", p)
					}
				}
				require.Equal(t, [2]int{65532, 65532}, [2]int{hdrs["home/nonroot"].Uid, hdrs["home/nonroot"].Gid})
				require.Equal(t, int64(0o1777), hdrs["tmp"].Mode&0o7777)
				require.Equal(t, int64(0o755), hdrs["usr/local/bin/"+b.Image.Name].Mode)
				require.Contains(t, string(bodies["etc/passwd"]), "nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n")
				require.Contains(t, string(bodies["etc/group"]), "nonroot:x:65532:\n")
				for _, sh := range []string{"bin/sh", "bin/bash", "bin/busybox", "usr/bin/sh", "sbin/nologin"} {
					require.NotContains(t, hdrs, sh, "no shell")
				}
				pool := x509.NewCertPool()
				require.True(t, pool.AppendCertsFromPEM(bodies["etc/ssl/certs/ca-certificates.crt"]))
				require.Greater(t, strings.Count(string(bodies["etc/ssl/certs/ca-certificates.crt"]), "BEGIN CERTIFICATE"), 100)
			})
		}
	}
}

// TestBinaryFromLayerRuns takes each host-platform binary out of its image
// layer and runs it with --version: it prints the stamped version and
// commit (which the build info does not record: -ldflags are left out
// with -trimpath). The binary is static and was built with -trimpath and
// cgo off.
func TestBinaryFromLayerRuns(t *testing.T) {
	res := build(t)
	host := platforms()[0]
	for _, b := range res.Images {
		t.Run(b.Image.Name, func(t *testing.T) {
			_, bodies, _ := files(t, b.Platforms[host])
			bin := filepath.Join(t.TempDir(), b.Image.Name)
			require.NoError(t, os.WriteFile(bin, bodies["usr/local/bin/"+b.Image.Name], 0o755))
			out, err := exec.Command(bin, "--version").CombinedOutput()
			require.NoError(t, err, string(out))
			require.Equal(t, fmt.Sprintf("%s %s (commit %s, %s)\n", b.Image.Name, testVersion, testCommit, runtime.Version()), string(out))

			f, err := elf.Open(bin)
			require.NoError(t, err)
			defer f.Close()
			for _, p := range f.Progs {
				require.NotEqual(t, elf.PT_INTERP, p.Type, "static: no dynamic loader")
			}
			bi, err := buildinfo.ReadFile(bin)
			require.NoError(t, err)
			set := map[string]string{}
			for _, s := range bi.Settings {
				set[s.Key] = s.Value
			}
			require.Equal(t, "0", set["CGO_ENABLED"])
			require.Equal(t, "true", set["-trimpath"])
			require.NotContains(t, set, "-ldflags", "-trimpath keeps the linker flags out of the build info (and the SBOM)")
			require.NotContains(t, set, "vcs.revision", "-buildvcs=false: the commit is stamped, not read from the work tree")
		})
	}
}

// TestSBOM checks that each platform image has an SPDX artifact in its
// index whose subject is that image, listing the binary's modules as its
// build info has them.
func TestSBOM(t *testing.T) {
	res := build(t)
	for _, b := range res.Images {
		im, err := b.Index.IndexManifest()
		require.NoError(t, err)
		for _, p := range platforms() {
			imgDigest, err := b.Platforms[p].Digest()
			require.NoError(t, err)
			var art *v1.Descriptor
			for _, d := range im.Manifests {
				if d.ArtifactType == imagebuild.SBOMMediaType && d.Annotations["dev.isthmus.sbom.subject"] == imgDigest.String() {
					art = &d
				}
			}
			require.NotNil(t, art, "%s %s: no SBOM in the index", b.Ref, p)
			ai, err := b.Index.Image(art.Digest)
			require.NoError(t, err)
			m, err := ai.Manifest()
			require.NoError(t, err)
			require.Equal(t, imgDigest, m.Subject.Digest)
			require.Equal(t, imagebuild.SBOMMediaType, m.ArtifactType)
			require.Len(t, m.Layers, 1)
			l, err := ai.LayerByDigest(m.Layers[0].Digest)
			require.NoError(t, err)
			rc, err := l.Compressed()
			require.NoError(t, err)
			raw, err := io.ReadAll(rc)
			require.NoError(t, err)
			require.Equal(t, b.SBOMs[p], raw)

			var doc imagebuild.SPDX
			require.NoError(t, json.Unmarshal(raw, &doc))
			require.Equal(t, "SPDX-2.3", doc.SPDXVersion)
			require.Equal(t, "2026-01-01T00:00:00Z", doc.CreationInfo.Created)
			versions := map[string]string{}
			for _, pkg := range doc.Packages {
				versions[pkg.Name] = pkg.VersionInfo
			}
			require.Equal(t, testVersion, versions["github.com/isthmus-mesh/isthmus"])
			require.Equal(t, runtime.Version(), versions["stdlib"])
			require.NotEmpty(t, versions["github.com/spf13/cobra"], "every binary links cobra")
			require.Len(t, doc.Relationships, len(doc.Packages), "one DESCRIBES, one DEPENDS_ON per other package")
		}
	}
}

// TestDockerLoadTarball reads each platform's tarball as `docker load`
// would (manifest.json with RepoTags): every image is there under its
// reference, with the config and layers of the layout's image.
func TestDockerLoadTarball(t *testing.T) {
	res := build(t)
	for _, p := range platforms() {
		path := res.Tarballs[p]
		require.FileExists(t, path)
		m, err := tarball.LoadManifest(func() (io.ReadCloser, error) { return os.Open(path) })
		require.NoError(t, err)
		require.Len(t, m, len(res.Images))
		for _, b := range res.Images {
			tag, err := name.NewTag(b.Ref)
			require.NoError(t, err)
			img, err := tarball.ImageFromPath(path, &tag)
			require.NoError(t, err, "%s in %s", b.Ref, path)
			want, err := b.Platforms[p].ConfigName()
			require.NoError(t, err)
			got, err := img.ConfigName()
			require.NoError(t, err)
			require.Equal(t, want, got, "%s %s", b.Ref, p)
		}
	}
}

// TestPushThenPullByDigest pushes the layout to an in-process registry on
// loopback and pulls every index back by digest: same digests, and the
// registry's referrers API lists each platform image's SBOM.
func TestPushThenPullByDigest(t *testing.T) {
	res := build(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := httptest.NewUnstartedServer(registry.New(registry.Logger(log.New(io.Discard, "", 0)), registry.WithReferrersSupport(true)))
	srv.Listener = ln
	srv.Start()
	t.Cleanup(srv.Close)
	reg := ln.Addr().String() + "/mirror"

	pushed, err := imagebuild.Push(context.Background(), imagebuild.PushConfig{Layout: res.Layout, Registry: reg}, imagebuild.PushDeps{})
	require.NoError(t, err)
	require.Len(t, pushed, len(res.Images))
	for i, b := range res.Images {
		require.Equal(t, reg+"/isthmus/"+b.Image.Name+":"+testVersion, pushed[i].Tag)
		d, err := name.NewDigest(pushed[i].Digest)
		require.NoError(t, err)
		require.Equal(t, b.Digest.String(), d.DigestStr())
		idx, err := remote.Index(d)
		require.NoError(t, err)
		got, err := idx.Digest()
		require.NoError(t, err)
		require.Equal(t, b.Digest, got, "pulled by digest: the same index")
		for _, p := range platforms() {
			want, err := b.Platforms[p].Digest()
			require.NoError(t, err)
			img, err := remote.Image(d.Context().Digest(want.String()))
			require.NoError(t, err)
			cf, err := img.ConfigFile()
			require.NoError(t, err)
			require.Equal(t, "65532:65532", cf.Config.User)
			refs, err := remote.Referrers(d.Context().Digest(want.String()))
			require.NoError(t, err)
			rm, err := refs.IndexManifest()
			require.NoError(t, err)
			require.Len(t, rm.Manifests, 1, "the platform image's one referrer: its SBOM")
			// go-containerregistry's registry lists a referrer's config media
			// type as its artifactType: read the artifact's own manifest.
			art, err := remote.Image(d.Context().Digest(rm.Manifests[0].Digest.String()))
			require.NoError(t, err)
			am, err := art.Manifest()
			require.NoError(t, err)
			require.Equal(t, imagebuild.SBOMMediaType, am.ArtifactType)
			require.Equal(t, want, am.Subject.Digest)
		}
	}
	_, err = imagebuild.Push(context.Background(), imagebuild.PushConfig{Layout: res.Layout, Registry: "http://" + reg}, imagebuild.PushDeps{})
	require.ErrorContains(t, err, "want host[:port][/path]")
	_, err = imagebuild.Push(context.Background(), imagebuild.PushConfig{Layout: t.TempDir(), Registry: reg}, imagebuild.PushDeps{})
	require.ErrorContains(t, err, "layout")
}

// TestLayoutReadsBack opens the written layout with go-containerregistry's
// reader: one index per image, named by its reference; and sbom/ holds a
// copy of each SBOM.
func TestLayoutReadsBack(t *testing.T) {
	res := build(t)
	lp, err := layout.FromPath(res.Layout)
	require.NoError(t, err)
	root, err := lp.ImageIndex()
	require.NoError(t, err)
	im, err := root.IndexManifest()
	require.NoError(t, err)
	require.Len(t, im.Manifests, len(res.Images))
	for i, d := range im.Manifests {
		require.Equal(t, res.Images[i].Ref, d.Annotations["org.opencontainers.image.ref.name"])
		require.Equal(t, res.Images[i].Digest, d.Digest)
	}
	for _, b := range res.Images {
		for _, p := range platforms() {
			f := filepath.Join(res.Layout, "..", "sbom", b.Image.Name+"_"+strings.ReplaceAll(p, "/", "_")+".spdx.json")
			raw, err := os.ReadFile(f)
			require.NoError(t, err)
			require.Equal(t, b.SBOMs[p], raw, "the SBOM next to the layout is the attached one")
		}
	}
}

// TestConfigRefused lists inputs Build refuses before building anything.
func TestConfigRefused(t *testing.T) {
	for _, tc := range []struct {
		cfg  imagebuild.Config
		want string
	}{
		{imagebuild.Config{Commit: "c"}, `version ""`},
		{imagebuild.Config{Version: "1", Commit: "c d"}, `commit "c d"`},
		{imagebuild.Config{Version: "1", Commit: "c", Platforms: []string{"windows/amd64"}}, `platform "windows/amd64"`},
		{imagebuild.Config{Version: "1", Commit: "c", SourceDateEpoch: -1}, "negative"},
		{imagebuild.Config{Version: "1", Commit: "c", Images: []imagebuild.Image{{Name: "a", Package: "./a"}, {Name: "a", Package: "./b"}}}, `image name "a"`},
		{imagebuild.Config{Version: "1", Commit: "c", Images: []imagebuild.Image{{Name: "a", Package: "cmd/a"}}}, "relative to the module"},
		{imagebuild.Config{Version: "1", Commit: "c", Images: []imagebuild.Image{{Name: "a", Binary: "/bin/a"}}}, "for one platform, not 2"},
	} {
		_, err := imagebuild.Build(context.Background(), tc.cfg, imagebuild.Deps{})
		require.ErrorContains(t, err, tc.want)
	}
}

// TestPrebuiltBinary packs a binary built elsewhere (this test's own
// executable): the image's binary is that file, byte for byte, and its
// SBOM lists the binary's own main module.
func TestPrebuiltBinary(t *testing.T) {
	exe, err := os.Executable()
	require.NoError(t, err)
	want, err := os.ReadFile(exe)
	require.NoError(t, err)
	host := platforms()[0]
	res, err := imagebuild.Build(context.Background(), imagebuild.Config{
		Images: []imagebuild.Image{{Name: "prebuilt", Binary: exe, Description: "a prebuilt binary"}}, Platforms: []string{host},
		Version: testVersion, Commit: testCommit, OutDir: filepath.Join(t.TempDir(), "out"),
	}, imagebuild.Deps{})
	require.NoError(t, err)
	require.Len(t, res.Images, 1)
	_, bodies, _ := files(t, res.Images[0].Platforms[host])
	require.Equal(t, want, bodies["usr/local/bin/prebuilt"])
	require.Contains(t, string(res.Images[0].SBOMs[host]), "github.com/isthmus-mesh/isthmus")
}
