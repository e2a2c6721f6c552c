//go:build linux

package netns

import (
	"errors"
	"fmt"
	"os"
	"runtime"

	"golang.org/x/sys/unix"
)

// threadNetNS is the network namespace of the calling thread (the process'
// /proc/self/ns/net names the main thread's, which may differ).
const threadNetNS = "/proc/thread-self/ns/net"

// Do runs fn on an OS thread that has entered the network namespace ns and
// returns fn's error. The calling goroutine is not affected: fn runs on a
// fresh goroutine locked to its thread, which returns to the original
// namespace afterwards. Should that return fail, the thread is never
// unlocked, so the runtime destroys it when the goroutine ends and no other
// goroutine ever runs in the wrong namespace.
//
// fn must not start goroutines that expect to run in ns (they run on other
// threads, in the process' namespace) and should not block for long: the
// thread is reserved while it runs.
func Do(ns *os.File, fn func() error) error {
	if ns == nil {
		return errors.New("netns: no namespace file")
	}
	errc := make(chan error, 1)
	go func() { errc <- doLocked(ns, fn) }()
	return <-errc
}

func doLocked(ns *os.File, fn func() error) error {
	runtime.LockOSThread()
	orig, err := os.Open(threadNetNS)
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("netns: open the thread's namespace: %w", err)
	}
	defer orig.Close()
	if err := setns(ns); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("netns: enter %s: %w", ns.Name(), err)
	}
	fnErr := fn()
	if err := setns(orig); err != nil {
		// Stay locked: the goroutine ends, and the runtime kills the
		// thread rather than reuse it in the pod's namespace.
		return errors.Join(fnErr, fmt.Errorf("netns: return from %s (thread discarded): %w", ns.Name(), err))
	}
	runtime.UnlockOSThread()
	return fnErr
}

func setns(f *os.File) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = unix.Setns(int(fd), unix.CLONE_NEWNET)
	}); err != nil {
		return err
	}
	return serr
}

// ID identifies a network namespace: the device and inode of its nsfs file.
// Two files name the same namespace exactly when their IDs are equal.
type ID struct {
	Dev, Ino uint64
}

// IDOf returns the ID of the namespace ns refers to.
func IDOf(ns *os.File) (ID, error) {
	var st unix.Stat_t
	rc, err := ns.SyscallConn()
	if err != nil {
		return ID{}, err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = unix.Fstat(int(fd), &st) }); err != nil {
		return ID{}, err
	}
	if serr != nil {
		return ID{}, fmt.Errorf("netns: stat %s: %w", ns.Name(), serr)
	}
	return ID{Dev: st.Dev, Ino: st.Ino}, nil
}

// Open opens the namespace file at path and checks that it is a network
// namespace (an nsfs file; a plain file or another namespace type is
// refused).
func Open(path string) (*os.File, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("netns: %w", err)
	}
	if err := Check(f); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// Check returns an error unless f refers to a network namespace (for files
// received from elsewhere, such as over SCM_RIGHTS).
func Check(f *os.File) error {
	var sfs unix.Statfs_t
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var nstype int
	var serr, terr error
	if err := rc.Control(func(fd uintptr) {
		serr = unix.Fstatfs(int(fd), &sfs)
		if serr == nil {
			nstype, terr = unix.IoctlRetInt(int(fd), unix.NS_GET_NSTYPE)
		}
	}); err != nil {
		return err
	}
	switch {
	case serr != nil:
		return fmt.Errorf("netns: statfs %s: %w", f.Name(), serr)
	case sfs.Type != unix.NSFS_MAGIC:
		return fmt.Errorf("netns: %s is not a namespace file", f.Name())
	case terr != nil:
		return fmt.Errorf("netns: namespace type of %s: %w", f.Name(), terr)
	case nstype != unix.CLONE_NEWNET:
		return fmt.Errorf("netns: %s is not a network namespace", f.Name())
	}
	return nil
}

// Current opens the network namespace of the calling goroutine's thread. It
// is meant for a process that does not switch namespaces itself (for
// example, to hand "the node's namespace" to code that takes a file).
func Current() (*os.File, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	return os.Open(threadNetNS)
}
