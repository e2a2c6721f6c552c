// Command pause is the sandbox ("pause") image of the real-node test
// environment, and the process that holds a node's network and mount
// namespaces: it sleeps until SIGINT or SIGTERM, reaping the children it
// inherits (as PID 1 of a pod's PID namespace would).
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sig := make(chan os.Signal, 4)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sig {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var ws syscall.WaitStatus
			if pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil); pid <= 0 || err != nil {
				break
			}
		}
	}
}
