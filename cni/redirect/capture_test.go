//go:build linux

package redirect_test

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/isthmus-mesh/isthmus/cni/redirect"
)

// The dialer helper: the test binary re-executed, one connection from
// inside a pod namespace, as a process of its own (so that it can sit in a
// cgroup of its own and drop capabilities). Its environment says what to
// do; it prints the first line the server answered.
const (
	helperEnv     = "ISTHMUS_REDIRECT_TEST_DIAL" // the destination address:port
	helperMarkEnv = "ISTHMUS_REDIRECT_TEST_MARK"
	helperCapsEnv = "ISTHMUS_REDIRECT_TEST_CAPS" // "net_raw": keep only CAP_NET_RAW
)

// dialHelper runs in the child. The pod namespace is its fd 3.
func dialHelper() int {
	if err := dialHelperErr(); err != nil {
		fmt.Fprintln(os.Stderr, "dial helper:", err)
		return 1
	}
	return 0
}

func dialHelperErr() error {
	runtime.LockOSThread() // the namespace and capabilities are the thread's
	dst, err := netip.ParseAddrPort(os.Getenv(helperEnv))
	if err != nil {
		return err
	}
	mark, err := strconv.ParseUint(os.Getenv(helperMarkEnv), 0, 32)
	if err != nil {
		return err
	}
	if err := unix.Setns(3, unix.CLONE_NEWNET); err != nil {
		return fmt.Errorf("setns: %w", err)
	}
	var family int
	var sa unix.Sockaddr
	if dst.Addr().Is4() {
		family, sa = unix.AF_INET, &unix.SockaddrInet4{Port: int(dst.Port()), Addr: dst.Addr().As4()}
	} else {
		family, sa = unix.AF_INET6, &unix.SockaddrInet6{Port: int(dst.Port()), Addr: dst.Addr().As16()}
	}
	fd, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, unix.IPPROTO_TCP)
	if err != nil {
		return fmt.Errorf("socket: %w", err)
	}
	defer unix.Close(fd)
	if os.Getenv(helperCapsEnv) == "net_raw" {
		// What any container holds by default: CAP_NET_RAW, not
		// CAP_NET_ADMIN. Since Linux 5.17 it is enough for SO_MARK.
		raw := uint32(1) << unix.CAP_NET_RAW
		hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
		data := [2]unix.CapUserData{{Effective: raw, Permitted: raw}}
		if err := unix.Capset(&hdr, &data[0]); err != nil {
			return fmt.Errorf("capset: %w", err)
		}
		if err := unix.Capget(&hdr, &data[0]); err != nil {
			return fmt.Errorf("capget: %w", err)
		}
		if data[0].Effective != raw || data[1].Effective != 0 {
			return fmt.Errorf("capabilities %#x %#x, want only CAP_NET_RAW", data[0].Effective, data[1].Effective)
		}
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 1<<20); !errors.Is(err, unix.EPERM) {
			return fmt.Errorf("SO_RCVBUFFORCE needs CAP_NET_ADMIN, got %v", err)
		}
	}
	if mark != 0 {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, int(mark)); err != nil {
			return fmt.Errorf("SO_MARK: %w", err)
		}
	}
	tv := unix.Timeval{Sec: 10}
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv)
	if err := unix.Connect(fd, sa); err != nil {
		return fmt.Errorf("connect %s: %w", dst, err)
	}
	conn, err := unix.Dup(fd)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(conn), "conn")
	defer f.Close()
	line, err := bufio.NewReader(f).ReadString('\n')
	if err != nil {
		return fmt.Errorf("read: %w", err)
	}
	fmt.Print(line)
	return nil
}

// cgroup is a cgroup v2 directory the test made (and removes).
type cgroup struct {
	path string
	id   uint64
	dir  *os.File
}

// cgroup2Root is where this machine mounts cgroup v2 (hybrid v1+v2).
const cgroup2Root = "/sys/fs/cgroup/unified"

func newCgroup(t *testing.T, parent string, name string) *cgroup {
	t.Helper()
	path := filepath.Join(parent, name)
	require.NoError(t, os.Mkdir(path, 0o755), "create a test cgroup (needs root and a writable cgroup2 at %s)", cgroup2Root)
	t.Cleanup(func() {
		// The helpers have exited; a cgroup without processes is removed
		// with rmdir.
		require.NoError(t, os.Remove(path), "remove test cgroup %s", path)
	})
	var st unix.Stat_t
	require.NoError(t, unix.Stat(path, &st))
	dir, err := os.Open(path)
	require.NoError(t, err)
	t.Cleanup(func() { dir.Close() })
	return &cgroup{path: path, id: st.Ino, dir: dir}
}

func testCgroupRoot(t *testing.T) string {
	t.Helper()
	var fs unix.Statfs_t
	require.NoError(t, unix.Statfs(cgroup2Root, &fs), "cgroup v2 at %s", cgroup2Root)
	require.EqualValues(t, unix.CGROUP2_SUPER_MAGIC, fs.Type, "%s is not cgroup2", cgroup2Root)
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return newCgroup(t, cgroup2Root, "isthmus-test-"+hex.EncodeToString(b)).path
}

// dialAs connects from ns to dst in a new process placed in cg, with mark
// on its socket and, when netRawOnly, no capability but CAP_NET_RAW; it
// returns the first line the server answered.
func dialAs(t *testing.T, ns *os.File, cg *cgroup, dst netip.AddrPort, mark uint32, netRawOnly bool) string {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"="+dst.String(), helperMarkEnv+"="+strconv.FormatUint(uint64(mark), 10))
	if netRawOnly {
		cmd.Env = append(cmd.Env, helperCapsEnv+"=net_raw")
	}
	cmd.ExtraFiles = []*os.File{ns}
	cmd.SysProcAttr = &unix.SysProcAttr{UseCgroupFD: true, CgroupFD: int(cg.dir.Fd())}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	done := make(chan error, 1)
	require.NoError(t, cmd.Start())
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		require.NoError(t, err, "dial helper: %s", stderr.String())
	case <-time.After(30 * time.Second):
		_ = cmd.Process.Kill()
		<-done
		t.Fatalf("dial helper hung: %s", stderr.String())
	}
	return strings.TrimSpace(stdout.String())
}

// TestCaptureCannotBeLeftByAMark is the attack of issue 31 item 6: any
// process of a pod holds CAP_NET_RAW by default, which is enough to set
// ztunnel's socket mark; the rules exempt a marked socket only when a
// process of ztunnel's cgroup opened it.
func TestCaptureCannotBeLeftByAMark(t *testing.T) {
	tp := newTopo(t)
	root := testCgroupRoot(t)
	// ztunnel two levels down (as in a pod's container cgroup), the
	// attacking pod's process a sibling of its parent.
	ztParent := newCgroup(t, root, "ztunnel-pod")
	zt := newCgroup(t, ztParent.path, "ztunnel")
	ztChild := newCgroup(t, zt.path, "worker")
	app := newCgroup(t, root, "app-pod")

	require.NoError(t, redirect.Apply(tp.p, redirect.Options{ZtunnelCgroups: []uint64{zt.id}}))
	cgroups, markOnly, err := redirect.Exemption(tp.p)
	require.NoError(t, err)
	require.Equal(t, []uint64{zt.id}, cgroups)
	require.False(t, markOnly)
	out := serve(t, tp.p, "[::]:15001", "outbound")
	qApp := serve(t, tp.q, "[::]:80", "q-app")

	t.Run("a pod process with only CAP_NET_RAW marks its socket and is still captured", func(t *testing.T) {
		require.Equal(t, "outbound", dialAs(t, tp.p, app, ap(tp.q4, 80), redirect.Mark, true))
		require.Equal(t, ap(tp.q4, 80), out.next(t).origDst)
		require.Equal(t, "outbound", dialAs(t, tp.p, app, ap(tp.q6, 80), redirect.Mark, true))
		require.Equal(t, ap(tp.q6, 80), out.next(t).origDst)
	})
	t.Run("a marked socket of ztunnel's parent cgroup is captured", func(t *testing.T) {
		require.Equal(t, "outbound", dialAs(t, tp.p, ztParent, ap(tp.q4, 80), redirect.Mark, false))
		out.next(t)
	})
	t.Run("ztunnel's unmarked socket is captured", func(t *testing.T) {
		require.Equal(t, "outbound", dialAs(t, tp.p, zt, ap(tp.q4, 80), 0, false))
		out.next(t)
	})
	t.Run("ztunnel's marked sockets are not captured, at any depth below it", func(t *testing.T) {
		require.Equal(t, "q-app", dialAs(t, tp.p, zt, ap(tp.q4, 80), redirect.Mark, false))
		require.Equal(t, tp.p4, qApp.next(t).remote.Addr().Unmap())
		require.Equal(t, "q-app", dialAs(t, tp.p, ztChild, ap(tp.q6, 80), redirect.Mark, false))
		qApp.next(t)
	})
	t.Run("two ztunnels during a restart: both are exempt", func(t *testing.T) {
		zt2 := newCgroup(t, root, "ztunnel-2")
		require.NoError(t, redirect.Apply(tp.p, redirect.Options{ZtunnelCgroups: []uint64{zt.id, zt2.id}}))
		require.Equal(t, "q-app", dialAs(t, tp.p, zt2, ap(tp.q4, 80), redirect.Mark, false))
		qApp.next(t)
		require.Equal(t, "q-app", dialAs(t, tp.p, zt, ap(tp.q4, 80), redirect.Mark, false))
		qApp.next(t)
		require.Equal(t, "outbound", dialAs(t, tp.p, app, ap(tp.q4, 80), redirect.Mark, true))
		out.next(t)
	})
	t.Run("no ztunnel known: no socket is exempt", func(t *testing.T) {
		require.NoError(t, redirect.Apply(tp.p, redirect.Options{}))
		cgroups, markOnly, err := redirect.Exemption(tp.p)
		require.NoError(t, err)
		require.Empty(t, cgroups)
		require.False(t, markOnly)
		require.Equal(t, "outbound", dialAs(t, tp.p, zt, ap(tp.q4, 80), redirect.Mark, false))
		out.next(t)
	})
	t.Run("mark-only (a ztunnel without a cgroup id): the mark alone is enough, as it was", func(t *testing.T) {
		require.NoError(t, redirect.Apply(tp.p, redirect.Options{MarkOnly: true}))
		cgroups, markOnly, err := redirect.Exemption(tp.p)
		require.NoError(t, err)
		require.Empty(t, cgroups)
		require.True(t, markOnly)
		require.Equal(t, "q-app", dialAs(t, tp.p, app, ap(tp.q4, 80), redirect.Mark, true))
		qApp.next(t)
	})
	require.Empty(t, out.got)
	require.Empty(t, qApp.got)
}
