//go:build linux

package istiozds_test

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/isthmus-mesh/isthmus/cni/zds"
	"istio.io/istio/pkg/zdsapi"
)

// The peer helper: the test binary re-executed in a test cgroup (and, when
// asked, in a cgroup and mount namespace of its own with a cgroup2 mounted
// at peerMountEnv, as a container runtime sets up a ztunnel); it connects
// to the socket, hands the connection to the test (fd 3), and lives until
// the test closes its end, so that the connection's peer process is the
// helper, alive, in that cgroup.
const (
	peerEnv      = "ISTHMUS_ISTIOZDS_TEST_PEER" // the socket path
	peerMountEnv = "ISTHMUS_ISTIOZDS_TEST_PEER_MOUNT"
)

func peerHelper() int {
	if m := os.Getenv(peerMountEnv); m != "" {
		// In its own mount namespace: the node's cgroup2 mount goes (the
		// same file system cannot be mounted on its own root again), one
		// rooted at the helper's cgroup namespace takes its place.
		if err := unix.Unmount(m, unix.MNT_DETACH); err != nil {
			fmt.Println("unmount:", err)
			return 1
		}
		if err := unix.Mount("cgroup2", m, "cgroup2", 0, ""); err != nil {
			fmt.Println("mount cgroup2:", err)
			return 1
		}
	}
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		fmt.Println("socket:", err)
		return 1
	}
	if err := unix.Connect(fd, &unix.SockaddrUnix{Name: os.Getenv(peerEnv)}); err != nil {
		fmt.Println("connect:", err)
		return 1
	}
	if err := unix.Sendmsg(3, []byte("c"), unix.UnixRights(fd), nil, 0); err != nil {
		fmt.Println("send:", err)
		return 1
	}
	_, _ = unix.Read(3, make([]byte, 1)) // until the test closes its end
	return 0
}

// cgroup2Mount is where this machine mounts cgroup v2: the first cgroup2
// of the server's default PeerCgroupMounts.
func cgroup2Mount(t *testing.T) string {
	t.Helper()
	for _, m := range []string{"/sys/fs/cgroup", "/sys/fs/cgroup/unified"} {
		var fs unix.Statfs_t
		if unix.Statfs(m, &fs) == nil && fs.Type == unix.CGROUP2_SUPER_MAGIC {
			return m
		}
	}
	t.Fatal("no cgroup2 at /sys/fs/cgroup or /sys/fs/cgroup/unified: this test needs cgroup v2")
	return ""
}

// testCgroup makes a cgroup under the cgroup2 root (removed at the end, once
// its helper has gone) and returns it open, with its id.
func testCgroup(t *testing.T, mount string) (*os.File, uint64) {
	t.Helper()
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	dir := filepath.Join(mount, "isthmus-test-"+hex.EncodeToString(b))
	require.NoError(t, os.Mkdir(dir, 0o755), "create a test cgroup (needs root and a writable cgroup2 at %s)", mount)
	t.Cleanup(func() {
		require.EventuallyWithT(t, func(c *assert.CollectT) { assert.NoError(c, os.Remove(dir)) }, 10*time.Second, 10*time.Millisecond)
	})
	var st unix.Stat_t
	require.NoError(t, unix.Stat(dir, &st))
	f, err := os.Open(dir)
	require.NoError(t, err)
	t.Cleanup(func() { f.Close() })
	return f, st.Ino
}

// connectFrom connects to path from a helper in cg (in namespaces of its
// own when ownNS) and returns the connection; the helper ends when the test
// does.
func connectFrom(t *testing.T, path string, cg *os.File, mount string, ownNS bool) *istioZtunnel {
	t.Helper()
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	ours, theirs := os.NewFile(uintptr(pair[0]), "ours"), os.NewFile(uintptr(pair[1]), "theirs")
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), peerEnv+"="+path)
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(cg.Fd())}
	if ownNS {
		cmd.Env = append(cmd.Env, peerMountEnv+"="+mount)
		// A private mount namespace (Go makes / private in it): the
		// helper's cgroup2 mount never reaches the host's.
		cmd.SysProcAttr.Unshareflags = unix.CLONE_NEWNS | unix.CLONE_NEWCGROUP
	}
	cmd.ExtraFiles = []*os.File{theirs}
	// A file, not a buffer: read while the helper runs, without a copier.
	out, err := os.CreateTemp(t.TempDir(), "helper")
	require.NoError(t, err)
	defer out.Close()
	report := func() string {
		b, _ := os.ReadFile(out.Name())
		return strings.TrimSpace(string(b))
	}
	cmd.Stdout, cmd.Stderr = out, out
	require.NoError(t, cmd.Start())
	theirs.Close()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		ours.Close()
		select {
		case err := <-done:
			require.NoError(t, err, "peer helper: %s", report())
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
			t.Errorf("peer helper did not end: %s", report())
		}
	})
	buf, oob := make([]byte, 1), make([]byte, unix.CmsgSpace(4))
	_, oobn, _, _, err := unix.Recvmsg(int(ours.Fd()), buf, oob, 0)
	if err != nil || oobn == 0 {
		t.Fatalf("peer helper did not connect (%v): %s", err, report())
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	require.NoError(t, err)
	require.Len(t, msgs, 1)
	fds, err := unix.ParseUnixRights(&msgs[0])
	require.NoError(t, err)
	f := os.NewFile(uintptr(fds[0]), "peer")
	defer f.Close()
	c, err := net.FileConn(f)
	require.NoError(t, err)
	z := &istioZtunnel{t: t, uc: c.(*net.UnixConn)}
	t.Cleanup(func() { z.uc.Close() })
	z.write(&zdsapi.ZdsHello{Version: zdsapi.Version_V1})
	return z
}

// TestCgroupOfIstioZtunnelFromTheKernel: Istio's hello carries no cgroup
// id, so the server (PeerProcDir) takes the cgroup of the process that
// connected from the kernel: a ztunnel in a cgroup namespace of its own (as
// runtimes start containers) is exempt by its cgroup, before it gets its
// snapshot. One that sees the whole hierarchy has no known cgroup: it is
// refused (the pods stay captured), unless MarkOnlyFallback, where its
// sockets are exempt by the mark alone.
func TestCgroupOfIstioZtunnelFromTheKernel(t *testing.T) {
	mount := cgroup2Mount(t)
	cg, id := testCgroup(t, mount)

	t.Run("own cgroup namespace: its cgroup", func(t *testing.T) {
		f := start(t, zds.Config{PeerProcDir: "/proc"})
		z := connectFrom(t, f.path, cg, mount, true)
		req, _ := z.next()
		require.NotNil(t, req.GetSnapshotSent(), "%v", req)
		z.ack("")
		require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Equal(c, 1, f.srv.Connected()) }, 10*time.Second, 10*time.Millisecond)
		_, _, captures := f.events()
		require.Equal(t, []zds.Capture{{Cgroups: []uint64{id}}}, captures)
	})
	t.Run("the node's cgroup namespace: refused", func(t *testing.T) {
		f := start(t, zds.Config{PeerProcDir: "/proc"})
		z := connectFrom(t, f.path, cg, mount, false)
		require.NoError(t, z.uc.SetReadDeadline(time.Now().Add(10*time.Second)))
		n, _ := z.uc.Read(make([]byte, 1024))
		require.Zero(t, n, "closed without a snapshot")
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			_, refused, _ := f.events()
			assert.Equal(c, []zds.RefusalReason{zds.RefusedCgroup}, refused)
		}, 10*time.Second, 10*time.Millisecond)
		_, _, captures := f.events()
		require.Empty(t, captures, "the exemption is untouched")
		require.Contains(t, f.log.String(), "sees the whole cgroup hierarchy")
	})
	t.Run("the node's cgroup namespace, MarkOnlyFallback: mark alone", func(t *testing.T) {
		f := start(t, zds.Config{PeerProcDir: "/proc", MarkOnlyFallback: true})
		z := connectFrom(t, f.path, cg, mount, false)
		req, _ := z.next()
		require.NotNil(t, req.GetSnapshotSent(), "%v", req)
		z.ack("")
		require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Equal(c, 1, f.srv.Connected()) }, 10*time.Second, 10*time.Millisecond)
		_, _, captures := f.events()
		require.Equal(t, []zds.Capture{{MarkOnly: true}}, captures)
	})
}
