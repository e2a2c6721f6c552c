//go:build linux

package zds

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// peerCgroup finds the cgroup v2 id of the process at the other end of uc
// from the kernel's record of it, for a peer whose hello carries none
// (Istio's ztunnel): SO_PEERPIDFD names the process that connected; its
// pid in the pid namespace of Config.PeerProcDir (the node's /proc) is read
// from that procfs' fdinfo of the pidfd, and the cgroup is the root of the
// first cgroup2 file system among Config.PeerCgroupMounts inside that
// process' own root (<PeerProcDir>/<pid>/root/<mount>). A container in a
// cgroup namespace of its own (the runtimes' default on cgroup v2) mounts
// its own cgroup there, which is what the Isthmus ztunnel reports of
// itself. A root that is the hierarchy's root (a peer in the node's cgroup
// namespace) is no answer. The pidfd is signalled (signal 0) after the
// read: a peer that has exited meanwhile (its pid may be another
// process') is refused.
func (s *Server) peerCgroup(uc *net.UnixConn) (uint64, error) {
	rc, err := uc.SyscallConn()
	if err != nil {
		return 0, err
	}
	pidfd, cerr := -1, error(nil)
	if err := rc.Control(func(fd uintptr) {
		pidfd, cerr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PEERPIDFD)
	}); err != nil {
		return 0, err
	}
	if cerr != nil {
		return 0, fmt.Errorf("zds: peer pidfd (SO_PEERPIDFD, Linux 6.5): %w", cerr)
	}
	defer unix.Close(pidfd)
	pid, err := pidOfPidfd(s.cfg.PeerProcDir, pidfd)
	if err != nil {
		return 0, err
	}
	root := filepath.Join(s.cfg.PeerProcDir, strconv.Itoa(pid), "root")
	var id uint64
	for _, m := range s.cfg.PeerCgroupMounts {
		dir := filepath.Join(root, m)
		var fs unix.Statfs_t
		if err := unix.Statfs(dir, &fs); err != nil || fs.Type != unix.CGROUP2_SUPER_MAGIC {
			continue
		}
		var st unix.Stat_t
		if err := unix.Stat(dir, &st); err != nil {
			return 0, fmt.Errorf("zds: peer's cgroup: %w", err)
		}
		id = st.Ino
		break
	}
	switch {
	case id == 0:
		return 0, fmt.Errorf("zds: no cgroup2 file system at %s in the peer's root (pid %d)", strings.Join(s.cfg.PeerCgroupMounts, ", "), pid)
	case id == RootCgroupID:
		return 0, fmt.Errorf("zds: the peer (pid %d) sees the whole cgroup hierarchy (no cgroup namespace of its own): its cgroup is not known", pid)
	}
	if err := unix.PidfdSendSignal(pidfd, 0, nil, 0); err != nil {
		return 0, fmt.Errorf("zds: the peer (pid %d) exited while its cgroup was read: %w", pid, err)
	}
	return id, nil
}

// pidOfPidfd reads the pid of pidfd's process in procDir's pid namespace
// (the "Pid:" of its fdinfo there; 0 when the process is not in that
// namespace, -1 when it has exited).
func pidOfPidfd(procDir string, pidfd int) (int, error) {
	f, err := os.Open(filepath.Join(procDir, "self", "fdinfo", strconv.Itoa(pidfd)))
	if err != nil {
		return 0, fmt.Errorf("zds: peer pid: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		v, ok := strings.CutPrefix(sc.Text(), "Pid:")
		if !ok {
			continue
		}
		pid, err := strconv.Atoi(strings.TrimSpace(v))
		switch {
		case err != nil:
			return 0, fmt.Errorf("zds: peer pid: %w", err)
		case pid <= 0:
			return 0, fmt.Errorf("zds: the peer's process is not in the pid namespace of %s (pid %d)", procDir, pid)
		}
		return pid, nil
	}
	if err := sc.Err(); err != nil {
		return 0, fmt.Errorf("zds: peer pid: %w", err)
	}
	return 0, errors.New("zds: peer pid: no Pid in the pidfd's fdinfo")
}
