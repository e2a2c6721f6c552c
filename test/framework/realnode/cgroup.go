package realnode

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// cgroupMounts lists the mount points of every cgroup hierarchy (each v1
// one and the v2 "unified" one), from this thread's /proc/thread-self/mountinfo.
func cgroupMounts() ([]string, error) {
	f, err := os.Open("/proc/thread-self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	s := bufio.NewScanner(f)
	for s.Scan() {
		pre, post, ok := strings.Cut(s.Text(), " - ")
		if !ok {
			continue
		}
		fields, fstype := strings.Fields(pre), strings.Fields(post)
		if len(fields) < 5 || len(fstype) < 1 || (fstype[0] != "cgroup" && fstype[0] != "cgroup2") {
			continue
		}
		if !slices.Contains(out, fields[4]) {
			out = append(out, fields[4])
		}
	}
	if err := s.Err(); err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, errors.New("no cgroup hierarchy mounted (want /sys/fs/cgroup/*)")
	}
	return out, nil
}

// createCgroups creates the cgroup name (the kubelet's cgroupRoot) at the
// top of every hierarchy; in cpuset's, with the parent's cpus and mems (a
// v1 cpuset starts empty, and no task could join it).
func createCgroups(name string) error {
	mounts, err := cgroupMounts()
	if err != nil {
		return err
	}
	for _, m := range mounts {
		dir := filepath.Join(m, name)
		if err := os.Mkdir(dir, 0o755); err != nil {
			return fmt.Errorf("create cgroup %s (needs root): %w", dir, err)
		}
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			v, err := os.ReadFile(filepath.Join(m, f))
			if errors.Is(err, fs.ErrNotExist) {
				continue
			}
			if err != nil {
				return err
			}
			if err := os.WriteFile(filepath.Join(dir, f), v, 0o644); err != nil {
				return fmt.Errorf("cgroup %s: %w", dir, err)
			}
		}
	}
	return nil
}

// cgroupDirs lists the cgroup name and every cgroup below it, in every
// hierarchy, deepest first.
func cgroupDirs(name string) []string {
	mounts, _ := cgroupMounts()
	var dirs []string
	for _, m := range mounts {
		_ = filepath.WalkDir(filepath.Join(m, name), func(p string, d fs.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
	}
	slices.SortFunc(dirs, func(a, b string) int { return strings.Count(b, "/") - strings.Count(a, "/") })
	return dirs
}

// cgroupPIDs lists the processes in the cgroup name and below.
func cgroupPIDs(name string) []int {
	seen := map[int]bool{}
	var out []int
	for _, d := range cgroupDirs(name) {
		b, err := os.ReadFile(filepath.Join(d, "cgroup.procs"))
		if err != nil {
			continue
		}
		for _, f := range strings.Fields(string(b)) {
			if p, err := strconv.Atoi(f); err == nil && !seen[p] {
				seen[p] = true
				out = append(out, p)
			}
		}
	}
	return out
}

// killCgroups kills every process in the cgroup name and below, until
// none is left (or 20 s have passed).
func killCgroups(name string) {
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		pids := cgroupPIDs(name)
		if len(pids) == 0 {
			return
		}
		for _, p := range pids {
			_ = syscall.Kill(p, syscall.SIGKILL)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// removeCgroups removes the cgroup name and everything below it, in every
// hierarchy, killing what is left in them.
func removeCgroups(name string) error {
	killCgroups(name)
	deadline := time.Now().Add(20 * time.Second)
	for {
		var errs []error
		for _, d := range cgroupDirs(name) {
			if err := syscall.Rmdir(d); err != nil && !errors.Is(err, syscall.ENOENT) {
				errs = append(errs, fmt.Errorf("remove cgroup %s: %w", d, err))
			}
		}
		if len(errs) == 0 || time.Now().After(deadline) {
			return errors.Join(errs...)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
