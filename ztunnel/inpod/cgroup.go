//go:build linux

package inpod

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// CgroupID returns the cgroup v2 id of the process whose cgroup file
// (/proc/self/cgroup) is procCgroup: the inode number of its cgroup
// directory, found by joining the "0::<path>" line to the first of mounts
// that is a cgroup2 file system (a hybrid node mounts it at
// /sys/fs/cgroup/unified). In a cgroup namespace both the path and the
// mount are relative to the namespace's root, so the join is the process'
// own cgroup either way. The agent exempts the marked sockets of this
// cgroup (and below) from the pods' capture.
func CgroupID(procCgroup string, mounts []string) (uint64, error) {
	b, err := os.ReadFile(procCgroup)
	if err != nil {
		return 0, fmt.Errorf("inpod: own cgroup: %w", err)
	}
	var rel string
	found := false
	for line := range bytes.Lines(b) {
		if p, ok := strings.CutPrefix(strings.TrimRight(string(line), "\n"), "0::"); ok {
			rel, found = p, true
			break
		}
	}
	if !found {
		return 0, fmt.Errorf("inpod: %s has no cgroup v2 entry (0::)", procCgroup)
	}
	if !strings.HasPrefix(rel, "/") || strings.Contains(rel, "..") {
		// "/../x" appears when the cgroup lies outside the reader's
		// cgroup namespace: no mount shows it.
		return 0, fmt.Errorf("inpod: cgroup path %q is not under this namespace's root", rel)
	}
	for _, m := range mounts {
		var fs unix.Statfs_t
		if err := unix.Statfs(m, &fs); err != nil || fs.Type != unix.CGROUP2_SUPER_MAGIC {
			continue
		}
		var st unix.Stat_t
		dir := filepath.Join(m, rel)
		if err := unix.Stat(dir, &st); err != nil {
			return 0, fmt.Errorf("inpod: own cgroup directory: %w", err)
		}
		return st.Ino, nil
	}
	return 0, errors.New("inpod: no cgroup2 file system at " + strings.Join(mounts, ", "))
}
