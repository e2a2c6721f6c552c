//go:build !unix

package multicluster

import "os/exec"

// inProcessGroup leaves cmd as it is: without process groups, only the
// plugin itself is killed when the context ends.
func inProcessGroup(*exec.Cmd) {}

// killProcessGroup is a no-op without process groups.
func killProcessGroup(*exec.Cmd) {}
