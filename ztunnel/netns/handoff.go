//go:build linux

package netns

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"syscall"

	"golang.org/x/sys/unix"
)

// ReusePort is a net.ListenConfig Control function that sets SO_REUSEPORT:
// a second process can then bind the same address and port beside the
// first (a new ztunnel beside the old one while it drains), and the kernel
// spreads new connections (and datagrams) over the group. Linux admits to
// a group only sockets of the same effective uid as its first member.
func ReusePort(_, _ string, c syscall.RawConn) error {
	var serr error
	if err := c.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1)
	}); err != nil {
		return err
	}
	if serr != nil {
		return fmt.Errorf("netns: set SO_REUSEPORT: %w", serr)
	}
	return nil
}

// ReusePortConfig returns a ListenConfig whose sockets set SO_REUSEPORT.
func ReusePortConfig() *net.ListenConfig { return &net.ListenConfig{Control: ReusePort} }

// Sysctl writes value to /proc/sys/<key> as seen from inside ns (nil: the
// caller's namespace), e.g. Sysctl(ns, "net/ipv4/ip_forward", "1"). The
// net/ keys are per network namespace: the kernel resolves them in the
// namespace of the thread that opens the file.
func Sysctl(ns *os.File, key, value string) error {
	err := inNS(ns, func() error {
		return os.WriteFile(filepath.Join("/proc/sys", key), []byte(value), 0o644)
	})
	if err != nil {
		return fmt.Errorf("netns: sysctl %s=%s: %w", key, value, err)
	}
	return nil
}

// MigrateReqKey is the sysctl that makes a closing listener of a
// SO_REUSEPORT group hand the connections in its accept queue, and those
// still in their handshake, to another listener of the group instead of
// resetting them (Linux 5.14).
const MigrateReqKey = "net/ipv4/tcp_migrate_req"

// EnableListenerMigration sets MigrateReqKey to 1 inside ns: once it is
// set, a ztunnel that closes its listeners while another ztunnel's listen
// beside them (SO_REUSEPORT) loses none of the connections that the kernel
// had already queued for it. It changes nothing else in the namespace.
func EnableListenerMigration(ns *os.File) error {
	return Sysctl(ns, MigrateReqKey, "1")
}
