//go:build linux

package demo

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/isthmus-mesh/isthmus/internal/nettopo"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
)

// The isolated demo runs in namespaces of its own, as rootless container
// tools do: Isolate re-executes the binary (with InnerCommand first) in a
// new mount namespace, for the bind mounts, and a new PID namespace, so
// that whatever it starts dies with it even when it is killed outright.
// Without root it adds a user namespace, in which it is root, and a network
// namespace: in a user namespace one may enter the network namespaces one
// made but never return to the host's (setns needs CAP_SYS_ADMIN over the
// target's owner), so the runner's own namespace must be one of its own
// too. Its pilot and API servers then live on that namespace's loopback;
// listeners Isolate opens on the host's loopback are handed down and
// forwarded to them, so isthmusctl and kubeconfigs work from the host.

// InnerCommand is the hidden first argument of the re-executed runner:
//
//	isthmus-demo __inner root|user <names of fds 3, 4, ...> <the user's flags...>
//
// "user" means a user namespace (and a network namespace) of its own.
const InnerCommand = "__inner"

// exitNoNamespaces is the inner runner's exit code when namespaces cannot
// be made; the reason is on the status pipe.
const exitNoNamespaces = 3

// Unavailable is the one line printed when neither root nor user
// namespaces allow the isolated demo.
func Unavailable(cause error) string {
	return fmt.Sprintf("isthmus-demo: cannot create network namespaces here, neither as root nor in an unprivileged user namespace (%v); "+
		"run `isthmus-demo --loopback` (make demo DEMO_FLAGS=--loopback) for the loopback demo", oneLine(cause))
}

func oneLine(err error) string { return strings.Join(strings.Fields(err.Error()), " ") }

// exposedAddrs are the host addresses Isolate opens for a rootless run.
var exposedAddrs = []struct{ name, addr string }{
	{"pilot-debug", pilotIP + ":8080"}, {"pilot-monitoring", pilotIP + ":15014"},
	{"cluster-1", "127.0.0.1:0"}, {"cluster-2", "127.0.0.1:0"},
}

// Isolate runs this binary again with InnerCommand and args in namespaces
// of its own (see above), passes SIGINT and SIGTERM on, and returns its
// exit code. Its output goes to stdout and stderr; when namespaces cannot
// be made, one line to stderr says so (Unavailable).
func Isolate(args []string, stdout, stderr io.Writer) int {
	self, err := os.Executable()
	if err != nil {
		fmt.Fprintln(stderr, "isthmus-demo:", err)
		return 1
	}
	status, statusW, err := os.Pipe()
	if err != nil {
		fmt.Fprintln(stderr, "isthmus-demo:", err)
		return 1
	}
	defer status.Close()
	names, files := []string{"status"}, []*os.File{statusW}
	attr := &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNS | syscall.CLONE_NEWPID, Pdeathsig: syscall.SIGKILL}
	env, mode := os.Environ(), "root"
	if os.Geteuid() != 0 {
		mode = "user"
		attr.Cloneflags |= syscall.CLONE_NEWUSER | syscall.CLONE_NEWNET
		attr.UidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getuid(), Size: 1}}
		attr.GidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getgid(), Size: 1}}
		n, f := exposeListeners(stderr)
		names, files = append(names, n...), append(files, f...)
		// Folders of root's runs are not ours: keep ours apart.
		tmp := filepath.Join(os.TempDir(), fmt.Sprintf("isthmus-%d", os.Getuid()))
		if err := os.MkdirAll(tmp, 0o700); err == nil {
			env = append(env, "TMPDIR="+tmp)
		}
	}
	cmd := exec.Command(self, append([]string{InnerCommand, mode, strings.Join(names, ",")}, args...)...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr, cmd.Env = os.Stdin, stdout, stderr, env
	cmd.ExtraFiles, cmd.SysProcAttr = files, attr
	err = cmd.Start()
	for _, f := range files {
		f.Close()
	}
	if err != nil {
		fmt.Fprintln(stderr, Unavailable(err))
		return 1
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sig)
	go func() {
		for s := range sig {
			_ = cmd.Process.Signal(s)
		}
	}()
	err = cmd.Wait()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ee) && ee.ExitCode() == exitNoNamespaces:
		reason, _ := io.ReadAll(status)
		fmt.Fprintln(stderr, Unavailable(errors.New(string(reason))))
		return 1
	case errors.As(err, &ee) && ee.ExitCode() > 0:
		return ee.ExitCode()
	default:
		fmt.Fprintln(stderr, "isthmus-demo:", err)
		return 1
	}
}

// exposeListeners opens the host listeners of a rootless run; one that
// cannot be opened (its address is busy) is left out, with a note.
func exposeListeners(stderr io.Writer) ([]string, []*os.File) {
	var names []string
	var files []*os.File
	for _, e := range exposedAddrs {
		ln, err := net.Listen("tcp", e.addr)
		if err != nil {
			fmt.Fprintf(stderr, "==> not exposing %s on the host: %v\n", e.name, err)
			continue
		}
		f, err := ln.(*net.TCPListener).File()
		ln.Close()
		if err != nil {
			continue
		}
		names, files = append(names, e.name), append(files, f)
	}
	return names, files
}

// Inner prepares the namespaces Isolate made: mounts private to this
// namespace, a /proc of the new PID namespace, the network namespace's
// loopback up (mode "user"), and a check that network namespaces can be
// made here. mode and fds are Isolate's arguments after InnerCommand (fds
// names the descriptors from 3 on); the exposed listeners come back as
// Exposed (nil as root). If the namespaces do not allow the demo, Inner
// writes why on the status pipe and exits with exitNoNamespaces.
func Inner(mode, fds string) *Exposed {
	files := map[string]*os.File{}
	for i, name := range strings.Split(fds, ",") {
		files[name] = os.NewFile(uintptr(3+i), name)
	}
	status := files["status"]
	fail := func(err error) {
		if status != nil {
			fmt.Fprint(status, oneLine(err))
		}
		os.Exit(exitNoNamespaces)
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		fail(fmt.Errorf("make mounts private: %w", err))
	}
	if err := unix.Mount("proc", "/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		fail(fmt.Errorf("mount /proc: %w", err))
	}
	if mode == "user" {
		if err := hostLikeNetwork(); err != nil {
			fail(err)
		}
	}
	probe, err := nettopo.New("")
	if err != nil {
		fail(err)
	}
	probe.Close()
	if status != nil {
		status.Close()
	}
	if mode != "user" {
		return nil
	}
	return exposed(files)
}

// hostLikeNetwork readies the runner's own network namespace as a host's:
// loopback up, and a network card with an address and a default route,
// without which kube-apiserver finds no address to advertise. The card is
// one end of a veth pair whose other end stays in the same namespace
// (veth is in every kernel that runs containers; the dummy driver is not).
// Nothing is ever sent there (192.0.2.0/24 is for documentation).
func hostLikeNetwork() error {
	self, err := netns.Current()
	if err != nil {
		return err
	}
	defer self.Close()
	if err := nettopo.LoopbackUp(self); err != nil {
		return err
	}
	if err := nettopo.Veth(self, "host0", pfx("192.0.2.1/24"), self, "host0-peer", netip.Prefix{}); err != nil {
		return err
	}
	return nettopo.Route(self, pfx("0.0.0.0/0"), mustAddr("192.0.2.254"))
}

func exposed(files map[string]*os.File) *Exposed {
	listen := func(name string) net.Listener {
		f := files[name]
		if f == nil {
			return nil
		}
		defer f.Close()
		ln, err := net.FileListener(f)
		if err != nil {
			return nil
		}
		return ln
	}
	e := &Exposed{PilotDebug: listen("pilot-debug"), PilotMonitoring: listen("pilot-monitoring"), APIServers: map[string]net.Listener{}}
	for _, c := range []string{"cluster-1", "cluster-2"} {
		if ln := listen(c); ln != nil {
			e.APIServers[c] = ln
		}
	}
	return e
}
