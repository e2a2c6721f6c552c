//go:build linux

package demo

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
)

// Every run keeps its sockets, tokens and bind mounts in a folder of its
// own under <tmp>/isthmus-demo-runs, holding an exclusive flock on its
// "lock" file while it lives (the kernel drops it when the runner dies,
// whatever the pid namespace). Each Start first sweeps the folders whose
// lock is free: it kills the processes whose command line names the folder,
// unmounts what is mounted under it and removes it. Stop removes its own.
const runsDir = "isthmus-demo-runs"

// newRunDir sweeps dead runs, then makes this run's folder and returns it
// with its locked lock file (the flock lives as long as the file is open).
func newRunDir() (string, *os.File, error) {
	base := filepath.Join(os.TempDir(), runsDir)
	SweepDeadRuns(base)
	if err := os.MkdirAll(base, 0o700); err != nil {
		return "", nil, err
	}
	dir, err := os.MkdirTemp(base, strconv.Itoa(os.Getpid())+"-")
	if err != nil {
		return "", nil, err
	}
	tmp := filepath.Join(dir, "lock.new") // locked, then renamed: never found unlocked
	lock, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_RDWR, 0o600)
	if err == nil {
		err = unix.Flock(int(lock.Fd()), unix.LOCK_EX|unix.LOCK_NB)
	}
	if err == nil {
		err = os.Rename(tmp, filepath.Join(dir, "lock"))
	}
	if err != nil {
		if lock != nil {
			lock.Close()
		}
		os.RemoveAll(dir)
		return "", nil, fmt.Errorf("lock the run folder: %w", err)
	}
	return dir, lock, nil
}

// removeRunDir unmounts what is left under dir, removes it and drops its
// lock.
func removeRunDir(dir string, lock *os.File) error {
	var errs []error
	for _, m := range MountsUnder(dir) {
		if err := unix.Unmount(m, unix.MNT_DETACH); err != nil {
			errs = append(errs, fmt.Errorf("unmount %s: %w", m, err))
		}
	}
	errs = append(errs, os.RemoveAll(dir))
	lock.Close()
	return errors.Join(errs...)
}

// SweepDeadRuns cleans up after runs under base whose runner is gone:
// their processes, mounts and folders.
func SweepDeadRuns(base string) {
	entries, err := os.ReadDir(base)
	if err != nil {
		return
	}
	for _, e := range entries {
		dir := filepath.Join(base, e.Name())
		lock, err := os.OpenFile(filepath.Join(dir, "lock"), os.O_RDWR, 0)
		if err != nil {
			continue // not a run folder, or not ours to sweep
		}
		if unix.Flock(int(lock.Fd()), unix.LOCK_EX|unix.LOCK_NB) != nil {
			lock.Close() // its runner lives
			continue
		}
		for _, p := range ProcessesWithArg(dir) {
			_ = syscall.Kill(-p, syscall.SIGKILL) // its process group (Setpgid)
			_ = syscall.Kill(p, syscall.SIGKILL)
		}
		for _, m := range MountsUnder(dir) {
			_ = unix.Unmount(m, unix.MNT_DETACH)
		}
		_ = os.RemoveAll(dir)
		lock.Close()
	}
}

// ProcessesWithArg lists the processes whose command line contains s.
func ProcessesWithArg(s string) []int {
	procs, _ := os.ReadDir("/proc")
	var out []int
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		cmd, err := os.ReadFile(filepath.Join("/proc", p.Name(), "cmdline"))
		if err == nil && strings.Contains(string(cmd), s) {
			out = append(out, pid)
		}
	}
	return out
}

// MountsUnder lists the mount points under dir in the caller's mount
// namespace, deepest first.
func MountsUnder(dir string) []string {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		if mp := unescapeMount(f[4]); strings.HasPrefix(mp, dir+"/") {
			out = append(out, mp)
		}
	}
	slices.SortFunc(out, func(a, b string) int { return len(b) - len(a) })
	return out
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// NetnsIDs returns the IDs of every network namespace the demo made (none
// in loopback mode), for checking that none outlives it.
func (d *Demo) NetnsIDs() []netns.ID {
	iso, ok := d.dp.(*isolated)
	if !ok {
		return nil
	}
	iso.mu.Lock()
	defer iso.mu.Unlock()
	return slices.Clone(iso.ids)
}

// NetnsInUse lists what still holds any of the network namespaces ids: a
// process in it, an open descriptor or a mount in any process' mount
// namespace. Empty means the kernel has freed them all.
func NetnsInUse(ids []netns.ID) []string {
	want := map[string]bool{}
	for _, id := range ids {
		want[fmt.Sprintf("net:[%d]", id.Ino)] = true
	}
	var held []string
	seenMnt := map[string]bool{}
	procs, _ := os.ReadDir("/proc")
	for _, p := range procs {
		if _, err := strconv.Atoi(p.Name()); err != nil {
			continue
		}
		dir := filepath.Join("/proc", p.Name())
		if l, _ := os.Readlink(filepath.Join(dir, "ns", "net")); want[l] {
			held = append(held, fmt.Sprintf("process %s runs in %s", p.Name(), l))
		}
		fds, _ := os.ReadDir(filepath.Join(dir, "fd"))
		for _, fd := range fds {
			if l, _ := os.Readlink(filepath.Join(dir, "fd", fd.Name())); want[l] {
				held = append(held, fmt.Sprintf("process %s holds %s as fd %s", p.Name(), l, fd.Name()))
			}
		}
		mnt, _ := os.Readlink(filepath.Join(dir, "ns", "mnt"))
		if mnt == "" || seenMnt[mnt] {
			continue
		}
		seenMnt[mnt] = true
		info, _ := os.ReadFile(filepath.Join(dir, "mountinfo"))
		for _, line := range strings.Split(string(info), "\n") {
			if f := strings.Fields(line); len(f) > 4 && want[f[3]] {
				held = append(held, fmt.Sprintf("%s is mounted at %s (mount namespace of process %s)", f[3], f[4], p.Name()))
			}
		}
	}
	return held
}

// RunInfo is what a run made that must not outlive it, written to
// <WorkDir>/run.json when Config.WorkDir is set, so that whoever started a
// runner can check after it is gone.
type RunInfo struct {
	// Run is the run's folder (sockets, tokens, bind mounts).
	Run string `json:"run"`
	// Netns are the network namespaces the run made.
	Netns []netns.ID `json:"netns"`
}

// RunDir returns the run's folder.
func (d *Demo) RunDir() string { return d.run }

func (d *Demo) writeRunInfo() error {
	b, err := json.Marshal(RunInfo{Run: d.run, Netns: d.NetnsIDs()})
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(d.work, "run.json"), b, 0o644)
}

// ReadRunInfo reads the run.json a run wrote in work.
func ReadRunInfo(work string) (RunInfo, error) {
	var ri RunInfo
	b, err := os.ReadFile(filepath.Join(work, "run.json"))
	if err != nil {
		return ri, err
	}
	return ri, json.Unmarshal(b, &ri)
}
