//go:build linux

package demo

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// NetnsExecCommand is the hidden first argument of isthmus-demo that makes
// it the helper starting a process inside a network namespace:
//
//	isthmus-demo __netns-exec /path/to/program [args...]   (namespace file as fd 3)
//
// The helper enters the namespace on its locked main thread and execve()s
// the program, which so starts in it (no `ip netns exec`, no other binary).
const NetnsExecCommand = "__netns-exec"

// NetnsExec is the helper's whole life: enter the network namespace given
// as file descriptor 3 and execute args[0] with args. It returns only on
// failure, with the error to report.
func NetnsExec(args []string) error {
	if len(args) == 0 {
		return fmt.Errorf("%s: no program given", NetnsExecCommand)
	}
	runtime.LockOSThread() // execve from the thread that entered the namespace
	if err := unix.Setns(3, unix.CLONE_NEWNET); err != nil {
		return fmt.Errorf("%s: enter the network namespace: %w", NetnsExecCommand, err)
	}
	unix.CloseOnExec(3)
	return syscall.Exec(args[0], args, os.Environ())
}

// proc is a process the demo started.
type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
}

// procSet holds the running processes, stopped in reverse order.
type procSet struct {
	mu    sync.Mutex
	procs []*proc
}

// spawn starts BinDir/<bin> with args as process name, logging to
// <work>/<name>.log; inside netns when it is not nil (through the
// isthmus-demo helper). Every process is in its own process group and is
// killed if the demo dies (Pdeathsig).
func (s *procSet) spawn(d *Demo, name string, netns *os.File, bin string, args ...string) error {
	f, err := os.OpenFile(d.logOf(name), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	var cmd *exec.Cmd
	if netns == nil {
		cmd = exec.Command(d.bin(bin), args...)
	} else {
		cmd = exec.Command(d.bin("isthmus-demo"), append([]string{NetnsExecCommand, d.bin(bin)}, args...)...)
		cmd.ExtraFiles = []*os.File{netns}
	}
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		return fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); f.Close(); close(p.done) }()
	s.mu.Lock()
	s.procs = append(s.procs, p)
	s.mu.Unlock()
	return nil
}

// stop stops the named process and forgets it.
func (s *procSet) stop(name string) {
	s.mu.Lock()
	var p *proc
	for i, q := range s.procs {
		if q.name == name {
			p = q
			s.procs = append(s.procs[:i], s.procs[i+1:]...)
			break
		}
	}
	s.mu.Unlock()
	if p != nil {
		stopProc(p)
	}
}

// stopAll stops every process, the last started first.
func (s *procSet) stopAll() {
	s.mu.Lock()
	procs := s.procs
	s.procs = nil
	s.mu.Unlock()
	for i := len(procs) - 1; i >= 0; i-- {
		stopProc(procs[i])
	}
}

// stopProc sends SIGTERM to the process group, then SIGKILL after 10 s.
func stopProc(p *proc) {
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.done
	}
}
