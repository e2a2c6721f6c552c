package realnode

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/isthmus-mesh/isthmus/internal/nettopo"
	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
)

// Node is one real node: containerd and a kubelet in a network and mount
// namespace of their own.
type Node struct {
	// Name is the node's name in the cluster.
	Name string
	// IP is the node's InternalIP (on eth0 in its namespace, linked to its
	// network's router).
	IP netip.Addr
	// PodCIDR is the range the node's CNI bridge hands out pod IPs from
	// (also the Node object's spec.podCIDR), routed to the node by its
	// network's router.
	PodCIDR netip.Prefix

	cfg     nodeConfig
	cgroup  string // the cgroup name: the kubelet's cgroupRoot
	started time.Time

	launcher *launcher
	holder   *proc
	netns    *os.File // the node's network namespace
	mntns    *os.File // the node's mount namespace
	procs    []*proc  // containerd, kubelet
	fwd      *forwarder
}

type nodeConfig struct {
	name, dir, bin        string
	apiServer, kubeconfig string // the control plane, as the host sees it
	caFile                string
	moduleDir             string
	cgroup                string // the cgroup name in every hierarchy
	sandboxImage          string
	images                string       // docker-archive tarball imported into containerd
	clusterDNS            netip.Addr   // the pods' nameserver (invalid: none)
	clusterCIDR           netip.Prefix // kube-proxy's: traffic from outside it is masqueraded
	log                   *slog.Logger
	logFile               func(name string) io.Writer
	logDir                string // where logFile writes

	// The node's network: its address on eth0, its default gateway, its
	// pods' range, and uplink, which makes eth0 in the node's namespace.
	addr    netip.Prefix
	gateway netip.Addr
	podCIDR netip.Prefix
	uplink  func(node *os.File) error
}

// DialContext dials address from inside the node's network namespace, as a
// process on the node would (pod IPs, hostNetwork pods, the node's IP).
func (n *Node) DialContext(ctx context.Context, network, address string) (net.Conn, error) {
	var c net.Conn
	err := netns.Do(n.netns, func() error {
		var err error
		c, err = (&net.Dialer{}).DialContext(ctx, network, address)
		return err
	})
	return c, err
}

// startNode starts the namespace holder, sets up the node's network and
// cgroups, then containerd (importing the images) and the kubelet.
func startNode(cfg nodeConfig) (n *Node, err error) {
	n = &Node{
		Name: cfg.name, IP: cfg.addr.Addr(), PodCIDR: cfg.podCIDR, cfg: cfg,
		cgroup: cfg.cgroup,
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, n.stop())
		}
	}()
	for _, d := range []string{"containerd/root", "containerd/state", "runc", "cni/net.d", "cni/bin", "cni/ipam", "kubelet", "pod-logs"} {
		if err := os.MkdirAll(filepath.Join(cfg.dir, d), 0o755); err != nil {
			return n, err
		}
	}
	if err := n.copyCNIPlugins(); err != nil {
		return n, err
	}
	n.launcher = newLauncher()
	if err := n.enterNamespaces(); err != nil {
		return n, err
	}
	if err := n.setupNetwork(); err != nil {
		return n, fmt.Errorf("node network: %w", err)
	}
	if err := createCgroups(n.cgroup); err != nil {
		return n, err
	}
	if err := n.forwardAPIServer(); err != nil {
		return n, err
	}
	if err := n.startContainerd(); err != nil {
		return n, err
	}
	if err := n.startKubelet(); err != nil {
		return n, err
	}
	if err := n.startKubeProxy(); err != nil {
		return n, err
	}
	return n, nil
}

// enterNamespaces starts the holder (pause, in new network and mount
// namespaces whose "/" is private: Go's unshare in the child remounts it
// MS_REC|MS_PRIVATE, so nothing mounted there reaches the host), then moves
// the launcher's thread into them and mounts the tmpfs that keep the node's
// runtime files off the host, each of which a node was seen to write there
// whatever its configuration says (TestRealNode checks): /run (containerd's
// shim sockets are always under /run/containerd), /var/log (the kubelet's
// /var/log/containers links) and /var/lib (libcni's cache in /var/lib/cni,
// the kubelet's /var/lib/kubelet/device-plugins); then the charts' host
// paths (mountHostPaths).
func (n *Node) enterNamespaces() error {
	pause := filepath.Join(n.cfg.dir, "pause")
	if err := goBuild(n.cfg.moduleDir, "./test/framework/realnode/pause", pause); err != nil {
		return err
	}
	cmd := exec.Command(pause)
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS | syscall.CLONE_NEWNET}
	var err error
	n.holder, err = startProc("namespace holder", cmd, n.cfg.logFile("holder"), n.launcher.start)
	if err != nil {
		return fmt.Errorf("%w (creating namespaces needs root)", err)
	}
	pid := strconv.Itoa(n.holder.cmd.Process.Pid)
	if n.netns, err = netns.Open("/proc/" + pid + "/ns/net"); err != nil {
		return err
	}
	if n.mntns, err = os.Open("/proc/" + pid + "/ns/mnt"); err != nil {
		return err
	}
	return n.launcher.do(func() error {
		// setns into a mount namespace needs a thread that shares no
		// filesystem attributes with the others.
		if err := unix.Unshare(unix.CLONE_FS); err != nil {
			return fmt.Errorf("unshare CLONE_FS: %w", err)
		}
		if err := unix.Setns(int(n.mntns.Fd()), unix.CLONE_NEWNS); err != nil {
			return fmt.Errorf("enter the node's mount namespace: %w", err)
		}
		if err := unix.Setns(int(n.netns.Fd()), unix.CLONE_NEWNET); err != nil {
			return fmt.Errorf("enter the node's network namespace: %w", err)
		}
		for _, d := range []string{"/run", "/var/log", "/var/lib"} {
			if err := unix.Mount("tmpfs", d, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0755"); err != nil {
				return fmt.Errorf("mount a tmpfs on %s in the node's mount namespace: %w", d, err)
			}
		}
		return n.mountHostPaths()
	})
}

// setupNetwork brings lo up, links the node to its network (eth0, with a
// default route through the router) and forwards the pods' packets.
func (n *Node) setupNetwork() error {
	if err := nettopo.LoopbackUp(n.netns); err != nil {
		return err
	}
	if err := n.cfg.uplink(n.netns); err != nil {
		return fmt.Errorf("uplink: %w", err)
	}
	if err := nettopo.Route(n.netns, netip.PrefixFrom(netip.IPv4Unspecified(), 0), n.cfg.gateway); err != nil {
		return err
	}
	return nettopo.Sysctl(n.netns, "net/ipv4/ip_forward", "1")
}

// forwardAPIServer listens on the API server's port on every address
// inside the node's namespace and relays to the API server on the host's
// loopback: the kubelet and kube-proxy use the host's kubeconfig
// (127.0.0.1), and pods reach the API server's advertise address, the
// node's IP, through the kubernetes Service.
func (n *Node) forwardAPIServer() error {
	u, err := url.Parse(n.cfg.apiServer)
	if err != nil {
		return err
	}
	var ln net.Listener
	if err := netns.Do(n.netns, func() error {
		var err error
		ln, err = net.Listen("tcp", ":"+u.Port())
		return err
	}); err != nil {
		return fmt.Errorf("listen for the API server in the node's namespace: %w", err)
	}
	n.fwd = newForwarder(ln, dialTCP(u.Host))
	return nil
}

// sock is containerd's socket.
func (n *Node) sock() string { return filepath.Join(n.cfg.dir, "containerd", "c.sock") }

func (n *Node) startContainerd() error {
	cfgPath := filepath.Join(n.cfg.dir, "containerd", "config.toml")
	if err := os.WriteFile(cfgPath, []byte(n.containerdConfig()), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(n.cfg.dir, "cni", "net.d", "10-realnode.conflist"), n.cniConfig(), 0o644); err != nil {
		return err
	}
	cmd := exec.Command(filepath.Join(n.cfg.bin, "containerd"), "--config", cfgPath)
	cmd.Env = append(os.Environ(), "PATH="+n.cfg.bin+":"+os.Getenv("PATH"))
	p, err := startProc("containerd", cmd, n.cfg.logFile("containerd"), n.launcher.start)
	if err != nil {
		return err
	}
	n.procs = append(n.procs, p)
	deadline := time.Now().Add(time.Minute)
	for {
		c, err := net.Dial("unix", n.sock())
		if err == nil {
			c.Close()
			break
		}
		if err := p.exited(); err != nil {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("containerd not serving on %s after a minute: %w", n.sock(), err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return n.ImportImages(n.cfg.images)
}

func (n *Node) startKubelet() error {
	dir := filepath.Join(n.cfg.dir, "kubelet")
	cfgPath := filepath.Join(dir, "config.json")
	cfg, err := n.kubeletConfig()
	if err != nil {
		return err
	}
	if err := os.WriteFile(cfgPath, cfg, 0o644); err != nil {
		return err
	}
	cmd := exec.Command(filepath.Join(n.cfg.bin, "kubelet"),
		"--config="+cfgPath, "--kubeconfig="+n.cfg.kubeconfig, "--root-dir="+dir, "--cert-dir="+filepath.Join(dir, "pki"),
		"--node-ip="+n.IP.String(), "--hostname-override="+n.Name, "-v=1")
	cmd.Env = append(os.Environ(), "PATH="+n.cfg.bin+":"+os.Getenv("PATH"))
	n.started = time.Now()
	p, err := startProc("kubelet", cmd, n.cfg.logFile("kubelet"), n.launcher.start)
	if err != nil {
		return err
	}
	n.procs = append(n.procs, p)
	return nil
}

// startKubeProxy starts kube-proxy in the node's namespaces, in nftables
// mode (its tables live in the node's network namespace).
func (n *Node) startKubeProxy() error {
	cfgPath := filepath.Join(n.cfg.dir, "kube-proxy.json")
	cfg, err := n.kubeProxyConfig()
	if err != nil {
		return err
	}
	if err := os.WriteFile(cfgPath, cfg, 0o644); err != nil {
		return err
	}
	cmd := exec.Command(filepath.Join(n.cfg.bin, "kube-proxy"), "--config="+cfgPath, "-v=1")
	p, err := startProc("kube-proxy", cmd, n.cfg.logFile("kube-proxy"), n.launcher.start)
	if err != nil {
		return err
	}
	n.procs = append(n.procs, p)
	return nil
}

// exited returns an error if containerd, the kubelet or kube-proxy has
// exited.
func (n *Node) exited() error {
	for _, p := range n.procs {
		if err := p.exited(); err != nil {
			return fmt.Errorf("%w (log in %s)", err, filepath.Join(n.cfg.logDir, p.name+".log"))
		}
	}
	return nil
}

// pids lists the node's processes: holder, containerd, kubelet, the shims
// (their command lines name the node's folder) and every container (in
// the node's cgroups).
func (n *Node) pids() []int {
	var out []int
	for _, p := range append([]*proc{n.holder}, n.procs...) {
		if p != nil && p.exited() == nil {
			out = append(out, p.cmd.Process.Pid)
		}
	}
	out = append(out, framework.PIDsWithArg(n.cfg.dir)...)
	return append(out, cgroupPIDs(n.cgroup)...)
}

// stop kills the kubelet, the containers, containerd and its shims, then
// the holder (the namespaces and their mounts vanish with the last of
// them), and removes the cgroups.
func (n *Node) stop() error {
	var errs []error
	for i := len(n.procs) - 1; i >= 0; i-- {
		if n.procs[i].name == "kubelet" {
			errs = append(errs, n.procs[i].stop())
		}
	}
	killCgroups(n.cgroup)
	for _, p := range n.procs {
		if p.name != "kubelet" {
			errs = append(errs, p.stop())
		}
	}
	killAll(framework.PIDsWithArg(n.cfg.dir))
	if n.fwd != nil {
		n.fwd.close()
	}
	if n.holder != nil {
		errs = append(errs, n.holder.stop())
	}
	var nsID string
	if n.mntns != nil {
		if st, err := n.mntns.Stat(); err == nil {
			nsID = fmt.Sprintf("mnt:[%d]", st.Sys().(*syscall.Stat_t).Ino)
		}
		n.mntns.Close()
	}
	if n.netns != nil {
		n.netns.Close()
	}
	if n.launcher != nil {
		n.launcher.close()
	}
	if nsID != "" {
		errs = append(errs, waitNamespaceGone(nsID))
	}
	errs = append(errs, removeCgroups(n.cgroup))
	return errors.Join(errs...)
}

// waitNamespaceGone waits until no process is left in the mount namespace
// id ("mnt:[inode]"), so that its mounts are gone.
func waitNamespaceGone(id string) error {
	deadline := time.Now().Add(20 * time.Second)
	for {
		var left []int
		procs, _ := os.ReadDir("/proc")
		for _, p := range procs {
			pid, err := strconv.Atoi(p.Name())
			// Never this process: when the launcher's goroutine ran on the
			// main thread, the runtime keeps that thread (wedged, running
			// nothing) after the launcher ends, and /proc/<pid>/ns names
			// the main thread's namespaces: killing "what is left" would
			// kill the test itself.
			if err != nil || pid == os.Getpid() {
				continue
			}
			if l, err := os.Readlink("/proc/" + p.Name() + "/ns/mnt"); err == nil && l == id {
				left = append(left, pid)
			}
		}
		if len(left) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("processes %v still in the node's mount namespace", left)
		}
		killAll(left)
		time.Sleep(50 * time.Millisecond)
	}
}

// killAll sends SIGKILL to pids.
func killAll(pids []int) {
	for _, p := range pids {
		_ = syscall.Kill(p, syscall.SIGKILL)
	}
}

// launcher runs functions on one OS thread that it keeps locked: the
// thread enters the node's namespaces, and the node's processes are forked
// from it (a child inherits its thread's namespaces, and Pdeathsig fires
// when that thread ends: at teardown, or when the test process dies). The
// thread is never unlocked, so the runtime destroys it when close returns
// and no goroutine ever runs in the node's namespaces by accident.
type launcher struct {
	reqs chan func()
	done chan struct{}
}

func newLauncher() *launcher {
	l := &launcher{reqs: make(chan func()), done: make(chan struct{})}
	go func() {
		runtime.LockOSThread()
		defer close(l.done)
		for f := range l.reqs {
			f()
		}
	}()
	return l
}

// do runs f on the launcher's thread.
func (l *launcher) do(f func() error) error {
	errc := make(chan error, 1)
	l.reqs <- func() { errc <- f() }
	return <-errc
}

// start starts cmd from the launcher's thread.
func (l *launcher) start(cmd *exec.Cmd) error { return l.do(cmd.Start) }

// close ends the thread.
func (l *launcher) close() {
	close(l.reqs)
	<-l.done
}
