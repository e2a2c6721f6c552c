//go:build unix

package multicluster

import (
	"os/exec"
	"syscall"
)

// inProcessGroup starts cmd in a process group of its own and makes the
// context's end kill that whole group, so a plugin's children die with it.
func inProcessGroup(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
}

// killProcessGroup kills what is left of cmd's process group after the
// plugin exited (children it left behind). The group's ID cannot have been
// reused while any member lives; an empty group makes this a no-op.
func killProcessGroup(cmd *exec.Cmd) {
	if cmd.Process != nil {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	}
}
