// Package realnode starts Kubernetes clusters whose pods really run: the
// control planes of test/framework (one etcd, a kube-apiserver per
// cluster) plus kube-controller-manager and kube-scheduler per cluster,
// and real nodes (containerd, runc, the reference CNI plugins and a
// kubelet), each in a network and mount namespace of the test's own, with
// images built locally once and imported into every node, never pulled.
// StartSet starts several clusters on several networks; Start one cluster
// with one node (a set of one).
//
// The binaries come from hack/build-nodebin.sh (ISTHMUS_NODEBIN) and
// hack/build-testbin.sh (KUBEBUILDER_ASSETS); `make test` builds both.
//
// Isolation. Each node's namespaces are held by one process (the pause
// binary, started with unshare(CLONE_NEWNS|CLONE_NEWNET) and a private "/"),
// so every mount the node makes (overlay snapshots, pod network namespaces,
// volume tmpfs, the tmpfs on /run and /var/log that keep containerd's shim
// sockets and the kubelet's log links off the host) lives and dies with it.
// The pods sit on a CNI bridge in the node's namespace. Nothing touches the
// host's routes, links, firewall tables, /opt/cni, /etc/cni or /run/netns.
// The only host-side traces are a cgroup named after the set's folder in
// each cgroup hierarchy, with a cgroup per node below it (the kubelets'
// cgroupRoot), removed at teardown with every process in them.
//
// Networks, as the demo builds them (test/demo/isolated.go) with
// internal/nettopo, in namespaces of their own: network i (in the order
// the clusters name them; clusters may share one) is 10.i.0.0/16 with a
// router. Node k of network i has a veth uplink into the router: its eth0
// is 10.i.k.2/24 (its InternalIP), the router's end 10.i.k.1 its default
// route, its PodCIDR 10.i.(100+k).0/24 (the Node object's spec.podCIDR:
// the set creates the Node before its kubelet registers), routed by the
// router to the node, so pods of one network talk directly by pod IP,
// without overlay or NAT. The routers join a wan namespace, whose forward
// filter (a nettopo pass filter) refuses everything from one network to
// another with ICMP admin-prohibited ("no route to host" at once, counted:
// Set.WANRejected) but what a multi-network mesh lets cross:
//   - gateways: a hostNetwork pod listening on its node's IP and a port,
//     once the test calls Set.ExposeGateway(node IP:port) (only that port
//     of the node crosses);
//   - each cluster's API server: Env.APIServer, an address of its network
//     (10.i.255.n, with the API server's port) on the router, where a
//     forwarder relays to the API server on the host's loopback; a remote secret's server for pods of
//     other networks (the certificate names 127.0.0.1, so the kubeconfig
//     sets tls-server-name: Env.RemoteKubeconfig writes it);
//   - any other host listener, pilot's xDS say: Set.ExposeHost gives it
//     such an address in a network.
//
// The control planes run on the host's loopback as in test/framework; each
// kubelet and kube-proxy reach their API server through a forwarder that
// listens on the API server's port inside the node's namespace. Tests
// reach pods with Node.DialContext, which dials from inside the node's
// namespace; the test server image (test/realnode/server) dials from
// inside a pod.
//
// Services. kube-proxy runs in each node's namespaces in nftables mode (it
// runs `nft`, Debian's nftables), so its tables are the node's; it
// masquerades every Service connection (a pod reaching itself through its
// Service gets the reply back through the node, with no br_netfilter) and
// leaves the host's conntrack sysctls alone. Each API server advertises
// its address in its network (Env.APIServer, on the router, with the API
// server's own port), so the kubernetes Service (10.0.0.1) leads every
// node's pods to it; the framework signs the API server's certificate for
// that address, the ClusterIP and the kubernetes Service's names, and the
// ServiceAccount admission plugin is on, so in-cluster clients verify the
// server and authenticate with their token. CoreDNS (Options.NoClusterDNS
// turns it off) serves ClusterDomain as the Service kube-dns (10.0.0.10,
// the kubelets' clusterDNS), with nothing forwarded upstream; Start waits
// until it is Ready. Each API server's "cluster" egress (kubelets for logs,
// exec and port-forward; pods and Services for proxies and webhooks) is
// HTTP CONNECT on a unix socket the set serves by dialling from inside the
// cluster's network's router: no host route leads to the nodes, and the API
// server presents a client certificate of the cluster CA to the kubelets.
//
// The charts' host paths are the node's: inside its mount namespace,
// CNIBinDir and CNIConfDir are bind mounts of the node's own folders
// (their mount points made in overlays of /etc and /opt whose upper layers
// are in the node's folder), /var/run (the charts' socket and state
// folders) is the node's tmpfs, and pod network namespaces are under
// NetnsDir, a shared mount. Node.ImportImages adds images (`make images`
// tarballs) to containerd.
//
// Cost, measured on this machine (2 cores shared with other builds) with
// `go test -v ./test/realnode`, which logs the figures: a node is Ready
// 1-2.6 s after its kubelet starts, CoreDNS Ready 2.7-3.8 s after that, a
// pod Running 1-4 s after it was created; a one-node cluster (etcd,
// kube-apiserver, the controllers, containerd, kubelet, kube-proxy,
// CoreDNS, shims and the test's containers) holds 915-940 MiB of RSS
// (710-725 without kube-proxy and CoreDNS). Start takes 100-130 s on a
// loaded machine, mostly building the images, which runs alongside the API
// servers' start: packing CoreDNS's 79 MB binary takes a minute of it. A
// set of two clusters with three nodes (TestRealNodeSet), before kube-proxy
// and CoreDNS, started in 21-34 s (51 s loaded) and held 1510-1520 MiB.
//
// Everything needs root (namespaces, mounts, cgroups). Start fails the test
// with a message naming what is missing (privilege, a binary, a cgroup
// hierarchy); it never skips.
package realnode

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/isthmus-mesh/isthmus/internal/imagebuild"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// Options configures Start: one cluster with one node.
type Options struct {
	// Name of the cluster (default "realnode").
	Name string
	// NodeName is the node's name (default "<Name>-node-1").
	NodeName string
	// NodeBinDir holds the node binaries (default $ISTHMUS_NODEBIN).
	NodeBinDir string
	// AssetsDir holds kube-apiserver and etcd (default $KUBEBUILDER_ASSETS).
	AssetsDir string
	// Images are the test's own images, built with internal/imagebuild from
	// this module's main packages and imported into the node's containerd;
	// Env.ImageRef names them. The pause image is always added.
	Images []imagebuild.Image
	// ModuleDir is the root of this Go module (default: found from the
	// working directory upwards).
	ModuleDir string
	// Log receives progress (default: the test's log).
	Log *slog.Logger
	// ReadyTimeout bounds the wait for the node to be Ready, and for the
	// cluster DNS (default 3 min each).
	ReadyTimeout time.Duration
	// NoClusterDNS skips CoreDNS: Start returns sooner, and pods get no
	// cluster nameserver (the kubelet's clusterDNS is empty).
	NoClusterDNS bool
}

// Env is a running cluster with real nodes, one of a Set.
type Env struct {
	// Cluster is the control plane: an admin client on the host's loopback.
	Cluster *framework.Cluster
	// Network is the network the cluster's nodes are on.
	Network string
	// Nodes are the cluster's nodes; Node is the first.
	Nodes []*Node
	Node  *Node
	// NodeReady is how long the slowest node took to become Ready after
	// its kubelet started.
	NodeReady time.Duration
	// APIServer is the API server's address in the cluster's network: a
	// forwarder on the network's router relays it to the API server on
	// the host's loopback, and the wan lets it through, so pods of every
	// network reach it (a remote secret's server). Its certificate names
	// the host's loopback address, not this one: clients verify it with
	// that name (tls-server-name), as Cluster.Host says.
	APIServer netip.AddrPort
	// DNSReady is how long the cluster DNS took to be Ready after the
	// nodes were (zero with NoClusterDNS).
	DNSReady time.Duration

	set                *Set
	spec               ClusterSpec
	kubeconfig, caFile string
	procs              []*proc // host-side processes (scheduler, controller-manager)
	mu                 sync.Mutex

	egress     *forwarder              // the API server's cluster egress
	egressFrom atomic.Pointer[os.File] // the router egress dials from, once up
}

// The image references of the images built here: <registry>/<repo>/<name>:<version>.
const (
	imageRegistry = "isthmus.test"
	imageRepo     = "realnode"
	imageVersion  = "test"
	pauseImage    = "pause"
)

// ImageRef returns the reference the image named name (Options.Images, or
// "pause") was imported under; pods use it with the default pull policy
// (IfNotPresent), so nothing is ever pulled.
func (e *Env) ImageRef(name string) string {
	return e.set.images[name]
}

// Dir is the folder of the environment's set in os.TempDir() (logs,
// configs, the nodes' state); its base name is also the name of the
// cgroup the nodes' cgroups are under. Teardown removes it.
func (e *Env) Dir() string { return e.set.dir }

// Start brings up one cluster with one node (a Set of one), waits for the
// node to be Ready, and registers the teardown with t.Cleanup. Any failure
// fails the test.
func Start(t testing.TB, opts Options) *Env {
	t.Helper()
	if opts.Name == "" {
		opts.Name = "realnode"
	}
	spec := ClusterSpec{Name: opts.Name}
	if opts.NodeName != "" {
		spec.NodeNames = []string{opts.NodeName}
	}
	s := StartSet(t, SetOptions{
		Clusters: []ClusterSpec{spec}, NodeBinDir: opts.NodeBinDir, AssetsDir: opts.AssetsDir,
		Images: opts.Images, ModuleDir: opts.ModuleDir, Log: opts.Log, ReadyTimeout: opts.ReadyTimeout,
		NoClusterDNS: opts.NoClusterDNS,
	})
	return s.Clusters[0]
}

// nodeBinaries are the binaries of hack/build-nodebin.sh this package runs.
var nodeBinaries = []string{
	"kubelet", "kube-scheduler", "kube-controller-manager", "kube-proxy",
	"containerd", "containerd-shim-runc-v2", "ctr", "runc", "bridge", "host-local", "loopback",
}

// startControllers starts the cluster's kube-controller-manager and
// kube-scheduler on the host's loopback, neither serving (--secure-port=0).
func (e *Env) startControllers() error {
	bin, kubeconfig := e.set.opts.NodeBinDir, e.kubeconfig
	cm := exec.Command(filepath.Join(bin, "kube-controller-manager"),
		"--kubeconfig="+kubeconfig, "--authentication-kubeconfig="+kubeconfig,
		"--authorization-kubeconfig="+kubeconfig,
		// The apiserver may not yet serve extension-apiserver-authentication
		// to it: the controller manager would exit.
		"--authentication-skip-lookup=true",
		"--secure-port=0", "--leader-elect=false", "--root-ca-file="+e.caFile,
		"--use-service-account-credentials=false", "--controllers=*",
		"--node-monitor-period=2s", "-v=1")
	sched := exec.Command(filepath.Join(bin, "kube-scheduler"),
		"--kubeconfig="+kubeconfig, "--authentication-kubeconfig="+kubeconfig,
		"--authorization-kubeconfig="+kubeconfig, "--authentication-skip-lookup=true",
		"--secure-port=0", "--leader-elect=false", "-v=1")
	for name, cmd := range map[string]*exec.Cmd{"kube-controller-manager": cm, "kube-scheduler": sched} {
		p, err := startProc(name, cmd, e.set.logFile(e.Cluster.Name+"-"+name), nil)
		if err != nil {
			return err
		}
		e.procs = append(e.procs, p)
	}
	return nil
}

// waitNodeReady waits until node n reports Ready, and records how long
// that took.
func (e *Env) waitNodeReady(n *Node) error {
	ctx, cancel := context.WithTimeout(context.Background(), e.set.opts.ReadyTimeout)
	defer cancel()
	var last string
	err := wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		if err := n.exited(); err != nil {
			return false, err
		}
		for _, p := range e.procs {
			if err := p.exited(); err != nil {
				return false, err
			}
		}
		obj, err := e.Cluster.Client.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
		if err != nil {
			last = err.Error()
			return false, nil
		}
		for _, c := range obj.Status.Conditions {
			if c.Type == corev1.NodeReady {
				last = fmt.Sprintf("Ready=%s (%s: %s)", c.Status, c.Reason, c.Message)
				return c.Status == corev1.ConditionTrue, nil
			}
		}
		last = "no Ready condition yet"
		return false, nil
	})
	if err != nil {
		return fmt.Errorf("node %s not Ready (%s; logs in %s): %w", n.Name, last, e.set.dir, err)
	}
	took := time.Since(n.started)
	e.mu.Lock()
	e.NodeReady = max(e.NodeReady, took)
	e.mu.Unlock()
	e.set.log.Info("node ready", "node", n.Name, "took", took.Round(time.Millisecond))
	return nil
}

// pids lists the cluster's own processes: its API server, controllers and
// nodes (not the etcd the set's clusters share).
func (e *Env) pids() []int {
	var out []int
	if p := e.Cluster.APIServerPID(); p != 0 {
		out = append(out, p)
	}
	for _, p := range e.procs {
		out = append(out, p.cmd.Process.Pid)
	}
	for _, n := range e.Nodes {
		out = append(out, n.pids()...)
	}
	return out
}

// RSSBytes is the resident memory of the cluster: the etcd its set's
// clusters share, the API server, the controllers, and its nodes'
// containerd, kubelet, shims and containers.
func (e *Env) RSSBytes() int64 {
	pids := map[int]bool{}
	for _, p := range e.set.cp.PIDs() {
		if !e.set.isAPIServer(p) {
			pids[p] = true // etcd
		}
	}
	for _, p := range e.pids() {
		pids[p] = true
	}
	return sumRSS(pids)
}

// isAPIServer reports whether pid is one of the set's API servers.
func (s *Set) isAPIServer(pid int) bool {
	for _, c := range s.cp.Clusters {
		if c.APIServerPID() == pid {
			return true
		}
	}
	return false
}

// moduleRoot finds the folder of go.mod from the working directory up.
func moduleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod above the working directory: set Options.ModuleDir")
		}
		dir = parent
	}
}

// proc is a process this package started.
type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
	err  error // set before done closes
}

// startProc starts cmd with its output to out and SIGKILL when the starting
// thread dies (spawn, when given, runs cmd.Start on a thread of its choice).
func startProc(name string, cmd *exec.Cmd, out io.Writer, spawn func(*exec.Cmd) error) (*proc, error) {
	cmd.Stdout, cmd.Stderr = out, out
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	var err error
	if spawn != nil {
		err = spawn(cmd)
	} else {
		err = cmd.Start()
	}
	if err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, done: make(chan struct{})}
	go func() {
		err := cmd.Wait()
		p.err = fmt.Errorf("%s exited: %v", name, err)
		close(p.done)
	}()
	return p, nil
}

// exited returns an error if the process has exited.
func (p *proc) exited() error {
	select {
	case <-p.done:
		return p.err
	default:
		return nil
	}
}

// stop sends SIGTERM, then SIGKILL after 10 s, and waits for the exit.
func (p *proc) stop() error {
	if p.exited() != nil {
		return nil
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return nil
	case <-time.After(10 * time.Second):
	}
	_ = p.cmd.Process.Kill()
	select {
	case <-p.done:
		return nil
	case <-time.After(20 * time.Second):
		return fmt.Errorf("%s (pid %d) still running after SIGKILL", p.name, p.cmd.Process.Pid)
	}
}
