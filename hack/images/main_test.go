package main

import (
	"bytes"
	"context"
	"io"
	"log"
	"net"
	"net/http/httptest"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/stretchr/testify/require"
)

func execute(t *testing.T, args ...string) (string, error) {
	t.Helper()
	var out bytes.Buffer
	cmd := newCommand()
	cmd.SetArgs(args)
	cmd.SetOut(&out)
	cmd.SetErr(&bytes.Buffer{})
	err := cmd.ExecuteContext(context.Background())
	return out.String(), err
}

// TestBuildThenPush runs the command as `make images` and `make push` do
// (for one image and the host platform, to stay quick): build prints the
// image's reference by digest, push sends it to an in-process registry and
// prints where, and the registry serves that digest.
func TestBuildThenPush(t *testing.T) {
	out := filepath.Join(t.TempDir(), "images")
	stdout, err := execute(t, "build", "--module", "../..", "--version", "0.0.0-cli", "--commit", "abc123",
		"--source-date-epoch", "1767225600", "--platform", "linux/"+runtime.GOARCH, "--image", "isthmusctl", "--out", out)
	require.NoError(t, err)
	ref, digest, ok := strings.Cut(strings.TrimSpace(stdout), "@")
	require.True(t, ok, stdout)
	require.Equal(t, "docker.io/isthmus/isthmusctl:0.0.0-cli", ref)

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := httptest.NewUnstartedServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	srv.Listener = ln
	srv.Start()
	t.Cleanup(srv.Close)
	stdout, err = execute(t, "push", "--registry", ln.Addr().String(), "--out", out)
	require.NoError(t, err)
	want := ln.Addr().String() + "/isthmus/isthmusctl@" + digest
	require.Equal(t, want+"\n", stdout)
	d, err := name.NewDigest(want)
	require.NoError(t, err)
	idx, err := remote.Index(d)
	require.NoError(t, err)
	got, err := idx.Digest()
	require.NoError(t, err)
	require.Equal(t, digest, got.String())

	_, err = execute(t, "build", "--version", "1", "--commit", "c", "--image", "nope")
	require.ErrorContains(t, err, "not all of them are in the image list")
	_, err = execute(t, "push", "--registry", "", "--out", out)
	require.ErrorContains(t, err, "want host[:port][/path]")
}
