//go:build linux

package netns_test

import (
	"context"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns/netnstest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// soNetnsCookie is SO_NETNS_COOKIE (Linux 5.14): a number naming the
// namespace a socket lives in.
const soNetnsCookie = 71

func cookieOf(t *testing.T, c syscall.Conn) uint64 {
	t.Helper()
	rc, err := c.SyscallConn()
	require.NoError(t, err)
	var v uint64
	var gerr error
	require.NoError(t, rc.Control(func(fd uintptr) {
		v, gerr = unix.GetsockoptUint64(int(fd), unix.SOL_SOCKET, soNetnsCookie)
	}))
	require.NoError(t, gerr, "SO_NETNS_COOKIE")
	return v
}

func threadNS(t *testing.T) netns.ID {
	t.Helper()
	f, err := netns.Current()
	require.NoError(t, err)
	defer f.Close()
	id, err := netns.IDOf(f)
	require.NoError(t, err)
	return id
}

func TestDoEntersAndReturns(t *testing.T) {
	ns := netnstest.New(t)
	want, err := netns.IDOf(ns)
	require.NoError(t, err)
	home := threadNS(t)
	require.NotEqual(t, home, want)

	var inside netns.ID
	require.NoError(t, netns.Do(ns, func() error {
		f, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			return err
		}
		defer f.Close()
		inside, err = netns.IDOf(f)
		return err
	}))
	require.Equal(t, want, inside, "fn runs in the namespace")

	// Many concurrent Do calls never leave a thread of the runtime in the
	// namespace: every goroutine afterwards, on whatever thread, is home.
	var wg sync.WaitGroup
	for range 64 {
		wg.Go(func() {
			_ = netns.Do(ns, func() error { runtime.Gosched(); return nil })
		})
	}
	wg.Wait()
	for range 256 {
		runtime.Gosched()
		require.Equal(t, home, threadNS(t))
	}
	require.ErrorContains(t, netns.Do(nil, func() error { return nil }), "no namespace")
}

func TestOpenChecksTheFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "pod")
	ns := netnstest.NewAt(t, path)
	f, err := netns.Open(path)
	require.NoError(t, err)
	defer f.Close()
	a, _ := netns.IDOf(ns)
	b, _ := netns.IDOf(f)
	require.Equal(t, a, b)

	plain := filepath.Join(dir, "plain")
	require.NoError(t, os.WriteFile(plain, nil, 0o600))
	_, err = netns.Open(plain)
	require.ErrorContains(t, err, "not a namespace file")
	_, err = netns.Open("/proc/self/ns/uts")
	require.ErrorContains(t, err, "not a network namespace")
	_, err = netns.Open(filepath.Join(dir, "missing"))
	require.ErrorIs(t, err, os.ErrNotExist)
}

func TestListenAndDialInNamespace(t *testing.T) {
	ns, peer := netnstest.New(t), netnstest.New(t)
	netnstest.Veth(t, ns, "v0", netip.MustParsePrefix("10.251.0.1/24"), peer, "v1", netip.MustParsePrefix("10.251.0.2/24"))
	ctx := context.Background()

	ln, err := netns.Listen(ctx, ns, "tcp", "10.251.0.1:0", nil)
	require.NoError(t, err)
	defer ln.Close()
	home, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer home.Close()
	nsCookie := cookieOf(t, ln.(*net.TCPListener))
	require.NotEqual(t, cookieOf(t, home.(*net.TCPListener)), nsCookie)

	// The listener is served from an ordinary goroutine.
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = io.Copy(c, c)
	})

	d := &netns.Dialer{NetNS: ns, Mark: 0x539, Timeout: 5 * time.Second}
	c, err := d.DialContext(ctx, "tcp", ln.Addr().String())
	require.NoError(t, err)
	defer c.Close()
	tc := c.(*net.TCPConn)
	require.Equal(t, nsCookie, cookieOf(t, tc), "the dialled socket lives in the namespace")
	rc, err := tc.SyscallConn()
	require.NoError(t, err)
	var mark int
	require.NoError(t, rc.Control(func(fd uintptr) { mark, err = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK) }))
	require.NoError(t, err)
	require.Equal(t, 0x539, mark)

	_, err = c.Write([]byte("ping"))
	require.NoError(t, err)
	buf := make([]byte, 4)
	_, err = io.ReadFull(c, buf)
	require.NoError(t, err)
	require.Equal(t, "ping", string(buf))
	require.NoError(t, tc.CloseWrite())
}

func TestDialErrors(t *testing.T) {
	ns := netnstest.New(t)
	ctx := context.Background()
	d := &netns.Dialer{NetNS: ns}
	// Nothing listens on the namespace's loopback: refused at once.
	_, err := d.DialContext(ctx, "tcp", "127.0.0.1:9")
	require.ErrorIs(t, err, unix.ECONNREFUSED)
	_, err = d.DialContext(ctx, "tcp", "localhost:9")
	require.ErrorContains(t, err, "IP literal")
	_, err = d.DialContext(ctx, "tcp6", "127.0.0.1:9")
	require.ErrorContains(t, err, "cannot dial")
	_, err = netns.Listen(ctx, ns, "tcp", "localhost:0", nil)
	require.ErrorContains(t, err, "IP literal")

	// A connect that never completes ends with the context: the namespace
	// has a veth into 10.252.0.0/24 where nobody answers ARP for .9.
	netnstest.Veth(t, ns, "v0", netip.MustParsePrefix("10.252.0.1/24"), netnstest.New(t), "v1", netip.Prefix{})
	cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	_, err = d.DialContext(cctx, "tcp", "10.252.0.9:80")
	require.ErrorIs(t, err, context.DeadlineExceeded)
}

func TestListenPacketInNamespace(t *testing.T) {
	ns := netnstest.New(t)
	ctx := context.Background()
	pc, err := netns.ListenPacket(ctx, ns, "udp", "127.0.0.1:0", nil)
	require.NoError(t, err)
	defer pc.Close()
	var sent bool
	require.NoError(t, netns.Do(ns, func() error {
		c, err := net.Dial("udp", pc.LocalAddr().String())
		if err != nil {
			return err
		}
		defer c.Close()
		_, err = c.Write([]byte("dns?"))
		sent = err == nil
		return err
	}))
	require.True(t, sent)
	buf := make([]byte, 16)
	require.NoError(t, pc.SetReadDeadline(time.Now().Add(5*time.Second)))
	n, _, err := pc.ReadFrom(buf)
	require.NoError(t, err)
	require.Equal(t, "dns?", string(buf[:n]))
}
