//go:build linux

package netns_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns/netnstest"
)

// TestReusePortBindsBeside: without SO_REUSEPORT a second listener on the
// same port fails; with it on both, the second binds beside the first.
func TestReusePortBindsBeside(t *testing.T) {
	ns := netnstest.New(t)
	ctx := context.Background()
	first, err := netns.Listen(ctx, ns, "tcp4", "127.0.0.1:0", nil)
	require.NoError(t, err)
	_, err = netns.Listen(ctx, ns, "tcp4", first.Addr().String(), nil)
	require.ErrorIs(t, err, syscall.EADDRINUSE)
	first.Close()

	a, err := netns.Listen(ctx, ns, "tcp4", "127.0.0.1:0", netns.ReusePortConfig())
	require.NoError(t, err)
	defer a.Close()
	b, err := netns.Listen(ctx, ns, "tcp4", a.Addr().String(), netns.ReusePortConfig())
	require.NoError(t, err, "SO_REUSEPORT on both lets the second bind")
	defer b.Close()
	pa, err := netns.ListenPacket(ctx, ns, "udp4", "127.0.0.1:0", netns.ReusePortConfig())
	require.NoError(t, err)
	defer pa.Close()
	pb, err := netns.ListenPacket(ctx, ns, "udp4", pa.LocalAddr().String(), netns.ReusePortConfig())
	require.NoError(t, err)
	defer pb.Close()
}

// TestListenerMigration: connections the kernel queued for a listener of a
// SO_REUSEPORT group that nobody accepted yet are reset when it closes,
// unless the namespace migrates them (EnableListenerMigration): then the
// remaining listener accepts every one of them.
func TestListenerMigration(t *testing.T) {
	const n = 64 // each lands on one of two listeners by hash: some on each
	for _, migrate := range []bool{false, true} {
		t.Run(map[bool]string{false: "reset", true: "migrated"}[migrate], func(t *testing.T) {
			ns := netnstest.New(t)
			if migrate {
				require.NoError(t, netns.EnableListenerMigration(ns))
			}
			ctx := context.Background()
			old, err := netns.Listen(ctx, ns, "tcp4", "127.0.0.1:0", netns.ReusePortConfig())
			require.NoError(t, err)
			successor, err := netns.Listen(ctx, ns, "tcp4", old.Addr().String(), netns.ReusePortConfig())
			require.NoError(t, err)
			defer successor.Close()
			d := &netns.Dialer{NetNS: ns, Timeout: 5 * time.Second}
			var clients []net.Conn
			for range n {
				c, err := d.DialContext(ctx, "tcp4", old.Addr().String())
				require.NoError(t, err, "connected: queued by the kernel for one of the listeners")
				clients = append(clients, c)
			}
			defer func() {
				for _, c := range clients {
					c.Close()
				}
			}()
			require.NoError(t, old.Close(), "closed with its accept queue unread")

			accepted := acceptAll(t, successor.(*net.TCPListener))
			for _, c := range accepted {
				c.Close()
			}
			reset := 0
			for _, c := range clients {
				_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
				if _, err := c.Read(make([]byte, 1)); errors.Is(err, syscall.ECONNRESET) {
					reset++
				}
			}
			if migrate {
				require.Len(t, accepted, n, "every queued connection moved to the successor")
				require.Zero(t, reset)
			} else {
				require.Less(t, len(accepted), n, "the closed listener's queue is lost")
				require.Equal(t, n-len(accepted), reset, "and its connections are reset")
			}
		})
	}
}

// acceptAll accepts until nothing more is queued (a short deadline ends it).
func acceptAll(t *testing.T, ln *net.TCPListener) []net.Conn {
	t.Helper()
	var out []net.Conn
	for {
		require.NoError(t, ln.SetDeadline(time.Now().Add(500*time.Millisecond)))
		c, err := ln.Accept()
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return out
		}
		require.NoError(t, err)
		out = append(out, c)
	}
}

// TestReusePortGroupIsOneUIDs: a socket of another effective uid cannot
// join a SO_REUSEPORT group, even with SO_REUSEPORT set (a pod's processes
// run as other uids than ztunnel's).
func TestReusePortGroupIsOneUIDs(t *testing.T) {
	ns := netnstest.New(t)
	ln, err := netns.Listen(context.Background(), ns, "tcp4", "127.0.0.1:0", netns.ReusePortConfig())
	require.NoError(t, err)
	defer ln.Close()
	var bindErr error
	require.NoError(t, netns.Do(ns, func() error {
		// setresuid on this (locked) thread only: the raw system call,
		// not syscall.Setresuid, which changes every thread.
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, ^uintptr(0), 65534, ^uintptr(0)); e != 0 {
			return fmt.Errorf("set the thread's euid (needs root): %w", e)
		}
		other, err := (&net.ListenConfig{Control: netns.ReusePort}).Listen(context.Background(), "tcp4", ln.Addr().String())
		if err == nil {
			other.Close()
		}
		bindErr = err
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, ^uintptr(0), 0, ^uintptr(0)); e != 0 {
			return fmt.Errorf("restore the thread's euid: %w", e)
		}
		return nil
	}))
	require.ErrorIs(t, bindErr, syscall.EADDRINUSE, "another uid cannot share ztunnel's port")
}
