//go:build linux

package zds

import (
	"fmt"
	"net"
	"os"
	"slices"

	"golang.org/x/sys/unix"
)

// listen makes the server's socket at path, mode 0600 from the start: the
// socket file takes the mode of the socket's inode (less the umask) when
// it is bound, so the inode is made 0600 before bind, and the file is made
// 0600 again once listening (should a umask or file system add nothing,
// it changes nothing). Only the owner (the agent's uid) can connect; a
// process that passes the file's permission anyway (CAP_DAC_OVERRIDE)
// meets the peer check.
func listen(path string) (*net.UnixListener, error) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("zds: socket: %w", err)
	}
	f := os.NewFile(uintptr(fd), path)
	defer f.Close() // FileListener holds its own descriptor
	if err := unix.Fchmod(fd, 0o600); err != nil {
		return nil, fmt.Errorf("zds: restrict the socket: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: path}); err != nil {
		return nil, fmt.Errorf("zds: bind %s: %w", path, err)
	}
	if err := unix.Listen(fd, unix.SOMAXCONN); err != nil {
		os.Remove(path)
		return nil, fmt.Errorf("zds: listen %s: %w", path, err)
	}
	ln, err := net.FileListener(f)
	if err != nil {
		os.Remove(path)
		return nil, fmt.Errorf("zds: listener %s: %w", path, err)
	}
	ul := ln.(*net.UnixListener)
	ul.SetUnlinkOnClose(true)
	if err := os.Chmod(path, 0o600); err != nil {
		ul.Close()
		return nil, fmt.Errorf("zds: restrict %s: %w", path, err)
	}
	return ul, nil
}

// checkPeer refuses a peer whose uid (SO_PEERCRED, fixed when it
// connected) is neither the server's nor allowed by Config.AllowedUIDs.
func (s *Server) checkPeer(uc *net.UnixConn) error {
	rc, err := uc.SyscallConn()
	if err != nil {
		return fmt.Errorf("zds: peer credentials: %w", err)
	}
	var cred *unix.Ucred
	var cerr error
	if err := rc.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return fmt.Errorf("zds: peer credentials: %w", err)
	}
	if cerr != nil {
		return fmt.Errorf("zds: peer credentials: %w", cerr)
	}
	if cred.Uid == uint32(os.Getuid()) || slices.Contains(s.cfg.AllowedUIDs, cred.Uid) {
		return nil
	}
	return fmt.Errorf("zds: peer uid %d (pid %d) is neither the agent's (%d) nor an allowed one", cred.Uid, cred.Pid, os.Getuid())
}
