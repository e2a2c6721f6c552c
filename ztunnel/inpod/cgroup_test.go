//go:build linux

package inpod_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/isthmus-mesh/isthmus/cni/zds"
	"github.com/isthmus-mesh/isthmus/ztunnel/inpod"
	"github.com/isthmus-mesh/isthmus/ztunnel/inpod/inpodtest"
)

// cgroup2 is where this machine (hybrid cgroup v1+v2) mounts cgroup v2;
// /sys/fs/cgroup is a tmpfs of v1 controllers.
const cgroup2 = "/sys/fs/cgroup/unified"

func testCgroup(t *testing.T) (string, uint64) {
	t.Helper()
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	rel := "/isthmus-test-" + hex.EncodeToString(b)
	require.NoError(t, os.Mkdir(cgroup2+rel, 0o755), "create a test cgroup (needs root and a writable cgroup2 at %s)", cgroup2)
	t.Cleanup(func() { require.NoError(t, os.Remove(cgroup2+rel)) })
	var st unix.Stat_t
	require.NoError(t, unix.Stat(cgroup2+rel, &st))
	return rel, st.Ino
}

func procFile(t *testing.T, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "cgroup")
	require.NoError(t, os.WriteFile(p, []byte(content), 0o600))
	return p
}

func TestCgroupID(t *testing.T) {
	rel, id := testCgroup(t)
	mounts := []string{"/sys/fs/cgroup", cgroup2} // the first is not cgroup2 here: skipped
	hybrid := "9:name=systemd:/x\n4:memory:/y\n0::" + rel + "\n"
	got, err := inpod.CgroupID(procFile(t, hybrid), mounts)
	require.NoError(t, err)
	require.Equal(t, id, got)

	got, err = inpod.CgroupID("/proc/self/cgroup", mounts)
	require.NoError(t, err)
	own, err := os.ReadFile("/proc/self/cgroup")
	require.NoError(t, err)
	var st unix.Stat_t
	for _, l := range strings.Split(string(own), "\n") {
		if p, ok := strings.CutPrefix(l, "0::"); ok {
			require.NoError(t, unix.Stat(cgroup2+p, &st))
		}
	}
	require.Equal(t, st.Ino, got, "this process' own cgroup")

	for name, tc := range map[string]struct {
		file   string
		mounts []string
	}{
		"cgroup v1 only":        {"4:memory:/y\n", mounts},
		"outside the namespace": {"0::/../other\n", mounts},
		"no cgroup2 mount":      {"0::" + rel + "\n", []string{"/sys/fs/cgroup", t.TempDir()}},
		"directory gone":        {"0::/isthmus-no-such-cgroup\n", mounts},
		"relative path":         {"0::x\n", mounts},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := inpod.CgroupID(procFile(t, tc.file), tc.mounts)
			require.Error(t, err)
		})
	}
	_, err = inpod.CgroupID(filepath.Join(t.TempDir(), "absent"), mounts)
	require.Error(t, err)
}

// TestHelloCarriesTheCgroupID: the agent learns ztunnel's cgroup before
// it sends any pod, and a ztunnel that cannot find its own sends none.
func TestHelloCarriesTheCgroupID(t *testing.T) {
	rel, id := testCgroup(t)
	for _, tc := range []struct {
		name string
		proc string
		want zds.Capture
	}{
		{"known", procFile(t, "0::"+rel+"\n"), zds.Capture{Cgroups: []uint64{id}}},
		{"unknown", procFile(t, "1:cpu:/\n"), zds.Capture{MarkOnly: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "ztunnel.sock")
			got := make(chan zds.Capture, 4)
			srv, err := zds.New(zds.Config{SocketPath: path}, zds.Deps{OnCapture: func(c zds.Capture) { got <- c }})
			require.NoError(t, err)
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- srv.Run(ctx) }()
			defer func() { cancel(); require.NoError(t, <-done) }()

			c, err := inpod.New(inpod.Config{SocketPath: path, InitialBackoff: 20 * time.Millisecond,
				ProcCgroup: tc.proc, CgroupMounts: []string{cgroup2}}, inpod.Deps{Handler: inpodtest.New(t)})
			require.NoError(t, err)
			cctx, ccancel := context.WithCancel(context.Background())
			cdone := make(chan error, 1)
			go func() { cdone <- c.Run(cctx) }()
			defer func() { ccancel(); require.NoError(t, <-cdone) }()
			select {
			case c := <-got:
				require.Equal(t, tc.want, c)
			case <-time.After(10 * time.Second):
				t.Fatal("no hello")
			}
		})
	}
}
