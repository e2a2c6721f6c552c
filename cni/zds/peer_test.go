//go:build linux

package zds_test

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/isthmus-mesh/isthmus/cni/zds"
)

// The peer helper: the test binary re-executed as another uid; it connects
// to the socket and hands the connection back to the test (fd 3), so that
// the test speaks the protocol over a connection whose SO_PEERCRED is the
// helper's.
const (
	peerEnv     = "ISTHMUS_ZDS_TEST_PEER" // the socket path
	peerCapsEnv = "ISTHMUS_ZDS_TEST_PEER_DROP_CAPS"
	nobody      = 65534
)

func peerHelper() int {
	runtime.LockOSThread() // capabilities are the thread's
	if os.Getenv(peerCapsEnv) != "" {
		hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
		data := [2]unix.CapUserData{}
		if err := unix.Capset(&hdr, &data[0]); err != nil {
			fmt.Println("capset:", err)
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
		return 0
	}
	if err := unix.Sendmsg(3, []byte("c"), unix.UnixRights(fd), nil, 0); err != nil {
		fmt.Println("send:", err)
		return 1
	}
	fmt.Println("connected")
	return 0
}

// connectAs connects to path from a process of uid nobody (holding
// CAP_DAC_OVERRIDE unless dropCaps) and returns the connection, or the
// helper's report of why it could not connect.
func connectAs(t *testing.T, path string, dropCaps bool) (*net.UnixConn, string) {
	t.Helper()
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	ours, theirs := os.NewFile(uintptr(pair[0]), "ours"), os.NewFile(uintptr(pair[1]), "theirs")
	defer ours.Close()
	// The test binary sits in the build's private directory: uid nobody
	// runs it through a descriptor (fexecve), without walking that path.
	bin, err := os.Open(os.Args[0])
	require.NoError(t, err)
	defer bin.Close()
	cmd := &exec.Cmd{Path: "/proc/self/fd/4", Args: []string{os.Args[0], "-test.run=^$"}}
	cmd.Env = append(os.Environ(), peerEnv+"="+path)
	if dropCaps {
		cmd.Env = append(cmd.Env, peerCapsEnv+"=1")
	}
	cmd.ExtraFiles = []*os.File{theirs, bin}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody},
		AmbientCaps: []uintptr{unix.CAP_DAC_OVERRIDE}}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err = cmd.Run()
	theirs.Close()
	require.NoError(t, err, "peer helper: %s", out.String())
	report := strings.TrimSpace(out.String())
	if report != "connected" {
		return nil, report
	}
	buf, oob := make([]byte, 1), make([]byte, unix.CmsgSpace(4))
	_, oobn, _, _, err := unix.Recvmsg(int(ours.Fd()), buf, oob, 0)
	require.NoError(t, err)
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	require.NoError(t, err)
	require.Len(t, msgs, 1)
	fds, err := unix.ParseUnixRights(&msgs[0])
	require.NoError(t, err)
	f := os.NewFile(uintptr(fds[0]), "peer")
	defer f.Close()
	c, err := net.FileConn(f)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	return c.(*net.UnixConn), report
}

func TestSocketIsOwnerOnly(t *testing.T) {
	old := unix.Umask(0) // the most permissive umask: the mode is the server's doing
	t.Cleanup(func() { unix.Umask(old) })
	f := start(t, zds.Config{})
	st, err := os.Stat(f.path)
	require.NoError(t, err)
	require.Equal(t, os.ModeSocket|0o600, st.Mode(), "only the agent's uid may connect")

	// Another uid without CAP_DAC_OVERRIDE cannot even connect.
	c, report := connectAs(t, f.path, true)
	require.Nil(t, c)
	require.Contains(t, report, "permission denied")
}

func TestPeerOfAnotherUIDIsRefused(t *testing.T) {
	var mu sync.Mutex
	refusals := map[zds.RefusalReason]int{}
	path := t.TempDir() + "/ztunnel.sock"
	run := func(t *testing.T, cfg zds.Config) *zds.Server {
		cfg.SocketPath = path
		srv, err := zds.New(cfg, zds.Deps{OnRefused: func(r zds.RefusalReason) {
			mu.Lock()
			defer mu.Unlock()
			refusals[r]++
		}})
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- srv.Run(ctx) }()
		t.Cleanup(func() { cancel(); require.NoError(t, <-done) })
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			_, err := os.Stat(path)
			assert.NoError(c, err)
		}, 10*time.Second, 10*time.Millisecond)
		return srv
	}
	t.Run("refused", func(t *testing.T) {
		srv := run(t, zds.Config{})
		// A process of uid nobody that passes the file's permission
		// (CAP_DAC_OVERRIDE) says a valid hello claiming a cgroup.
		uc, report := connectAs(t, path, false)
		require.NotNil(t, uc, report)
		// (The agent may have closed it already: the write may fail.)
		_ = zds.Write(uc, zds.Hello{Version: zds.Version, CgroupID: 4242}, nil)
		_ = uc.SetReadDeadline(time.Now().Add(10 * time.Second))
		var req zds.Request
		_, err := zds.Read(uc, &req)
		require.Error(t, err, "the agent closes the connection without a snapshot")
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			mu.Lock()
			defer mu.Unlock()
			assert.Equal(c, 1, refusals[zds.RefusedPeer])
		}, 10*time.Second, 10*time.Millisecond)
		require.Equal(t, zds.Capture{}, srv.Capture(), "its cgroup exempts nothing")
	})
	t.Run("allowed by Config.AllowedUIDs", func(t *testing.T) {
		srv := run(t, zds.Config{AllowedUIDs: []uint32{nobody}})
		uc, report := connectAs(t, path, false)
		require.NotNil(t, uc, report)
		p := &peer{t: t, uc: uc}
		require.NoError(t, zds.Write(uc, zds.Hello{Version: zds.Version, CgroupID: 4242}, nil))
		req, _ := p.next()
		require.NotNil(t, req.SnapshotSent)
		p.ack("")
		require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Equal(c, 1, srv.Connected()) }, 10*time.Second, 10*time.Millisecond)
		require.Equal(t, zds.Capture{Cgroups: []uint64{4242}}, srv.Capture())
	})
}
