// Package realnode starts a Kubernetes cluster whose pods really run: the
// control plane of test/framework (etcd, kube-apiserver) plus
// kube-controller-manager and kube-scheduler, and one node (containerd, runc,
// the reference CNI plugins and a kubelet) in a network and mount namespace of
// the test's own, with images built locally and imported, never pulled.
//
// The binaries come from hack/build-nodebin.sh (ISTHMUS_NODEBIN) and
// hack/build-testbin.sh (KUBEBUILDER_ASSETS); `make test` builds both.
//
// Isolation. The node's namespaces are held by one process (the pause
// binary, started with unshare(CLONE_NEWNS|CLONE_NEWNET) and a private "/"),
// so every mount the node makes (overlay snapshots, pod network namespaces,
// volume tmpfs, the tmpfs on /run and /var/log that keep containerd's shim
// sockets and the kubelet's log links off the host) lives and dies with it.
// The node's IP sits on a veth pair whose two ends are both inside the node's
// namespace (with a default route through it, which the kubelet wants); the
// pods sit on a CNI bridge there. Nothing touches the host's routes,
// firewall tables, /opt/cni, /etc/cni or /run/netns. The only host-side
// traces are a cgroup named after the node in each cgroup hierarchy (the
// kubelet's cgroupRoot), removed at teardown with every process in them.
//
// The charts' host paths are the node's: inside its mount namespace,
// CNIBinDir and CNIConfDir are bind mounts of the node's own folders
// (their mount points made in overlays of /etc and /opt whose upper layers
// are in the node's folder), /var/run (the charts' socket and state
// folders) is the node's tmpfs, and pod network namespaces are under
// NetnsDir, a shared mount. Node.ImportImages adds images (`make images`
// tarballs) to containerd.
//
// The control plane runs on the host's loopback as in test/framework; the
// kubelet reaches it through a forwarder that listens on the API server's
// address inside the node's namespace. Tests reach pods with Node.DialContext,
// which dials from inside the node's namespace.
//
// Cost, measured on this machine (2 cores shared with other builds) with
// `go test -v ./test/realnode`, which logs the figures: the node is Ready
// 2-3.5 s after its kubelet starts, a pod Running 2-3 s after it was
// created, and the whole cluster (etcd, kube-apiserver, the controllers,
// containerd, kubelet, shims and containers) holds 710-725 MiB of RSS. Start
// takes 25-45 s in all, mostly building the images and starting the API
// server, which run in parallel.
//
// Not yet: the API server cannot reach the kubelet (logs, exec, port-forward
// fail: the node's IP exists only in its namespace), no kube-proxy (no
// Service routing), no cluster DNS.
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
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/isthmus-mesh/isthmus/internal/imagebuild"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// Options configures Start.
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
	// ReadyTimeout bounds the wait for the node to be Ready (default 3 min).
	ReadyTimeout time.Duration
}

// Env is a running cluster with one real node.
type Env struct {
	// Cluster is the control plane: an admin client on the host's loopback.
	Cluster *framework.Cluster
	// Node is the cluster's only node.
	Node *Node
	// NodeReady is how long the node took to become Ready after its
	// kubelet started.
	NodeReady time.Duration

	set    *framework.ClusterSet
	opts   Options
	log    *slog.Logger
	dir    string
	lock   *os.File // flocked while the environment lives (see sweepOrphans)
	procs  []*proc  // host-side processes (scheduler, controller-manager)
	images map[string]string
	mu     sync.Mutex
	files  []*os.File // the log files, closed by stop
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
	return e.images[name]
}

// Dir is the environment's folder in os.TempDir() (logs, configs, the
// node's state); its base name is also the name of the node's cgroups.
// Teardown removes it.
func (e *Env) Dir() string { return e.dir }

// Start brings up the cluster and its node, waits for the node to be Ready,
// and registers the teardown with t.Cleanup. Any failure fails the test.
func Start(t testing.TB, opts Options) *Env {
	t.Helper()
	e, err := start(t, opts)
	if err != nil {
		t.Fatalf("realnode: %v", err)
	}
	return e
}

func (o Options) withDefaults(t testing.TB) (Options, error) {
	if o.Name == "" {
		o.Name = "realnode"
	}
	if o.NodeName == "" {
		o.NodeName = o.Name + "-node-1"
	}
	if o.NodeBinDir == "" {
		o.NodeBinDir = os.Getenv("ISTHMUS_NODEBIN")
	}
	if o.AssetsDir == "" {
		o.AssetsDir = os.Getenv("KUBEBUILDER_ASSETS")
	}
	if o.Log == nil {
		o.Log = slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelInfo}))
	}
	if o.ReadyTimeout == 0 {
		o.ReadyTimeout = 3 * time.Minute
	}
	if o.ModuleDir == "" {
		dir, err := moduleRoot()
		if err != nil {
			return o, err
		}
		o.ModuleDir = dir
	}
	return o, nil
}

// check names everything missing before anything starts.
func (o Options) check() error {
	var errs []error
	if os.Geteuid() != 0 {
		errs = append(errs, errors.New("a real node needs root (network and mount namespaces, mounts, cgroups): run the tests as root"))
	}
	if o.NodeBinDir == "" {
		errs = append(errs, errors.New("no node binaries: set ISTHMUS_NODEBIN (make nodebin builds them and prints the folder)"))
	} else {
		for _, b := range nodeBinaries {
			if _, err := os.Stat(filepath.Join(o.NodeBinDir, b)); err != nil {
				errs = append(errs, fmt.Errorf("%s missing in %s (run make nodebin)", b, o.NodeBinDir))
			}
		}
	}
	if o.AssetsDir == "" {
		errs = append(errs, errors.New("no Kubernetes binaries: set KUBEBUILDER_ASSETS (make testbin prints the folder)"))
	}
	if _, err := cgroupMounts(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// nodeBinaries are the binaries of hack/build-nodebin.sh this package runs.
var nodeBinaries = []string{
	"kubelet", "kube-scheduler", "kube-controller-manager",
	"containerd", "containerd-shim-runc-v2", "ctr", "runc", "bridge", "host-local", "loopback",
}

func start(t testing.TB, opts Options) (*Env, error) {
	opts, err := opts.withDefaults(t)
	if err != nil {
		return nil, err
	}
	if err := opts.check(); err != nil {
		return nil, err
	}
	sweepOrphans()
	dir, err := os.MkdirTemp("", fmt.Sprintf("%s%d-", dirPrefix, os.Getpid()))
	if err != nil {
		return nil, err
	}
	lock, err := lockDir(dir)
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	e := &Env{opts: opts, log: opts.Log, dir: dir, lock: lock}
	t.Cleanup(func() {
		if err := e.stop(); err != nil {
			t.Errorf("realnode: teardown: %v", err)
		}
	})
	if err := os.MkdirAll(filepath.Join(dir, "logs"), 0o755); err != nil {
		return nil, err
	}

	// The images and the control plane do not depend on each other.
	var wg sync.WaitGroup
	var imgErr error
	var tarball string
	wg.Go(func() { tarball, imgErr = e.buildImages() })
	t0 := time.Now()
	e.set, err = framework.Start(framework.Options{
		Names: []string{opts.Name}, AssetsDir: opts.AssetsDir, Output: e.logFile("control-plane"),
		// The API server reaches kubelets by the node's IP, never by a
		// name the host's DNS would resolve.
		APIServerArgs: map[string]string{"kubelet-preferred-address-types": "InternalIP"},
	})
	e.log.Info("control plane up", "took", time.Since(t0).Round(time.Millisecond), "err", err)
	wg.Wait()
	if err != nil {
		return nil, err
	}
	if imgErr != nil {
		return nil, imgErr
	}
	e.Cluster = e.set.Clusters[0]

	kubeconfig := filepath.Join(dir, "admin.kubeconfig")
	if err := e.Cluster.WriteAdminKubeconfig(kubeconfig); err != nil {
		return nil, err
	}
	caFile := filepath.Join(dir, "ca.crt")
	if err := os.WriteFile(caFile, e.Cluster.CAData(), 0o644); err != nil {
		return nil, err
	}
	if err := e.startControllers(kubeconfig, caFile); err != nil {
		return nil, err
	}

	e.Node, err = startNode(nodeConfig{
		name: opts.NodeName, dir: filepath.Join(dir, "node"), bin: opts.NodeBinDir, cgroup: filepath.Base(dir),
		apiServer: e.Cluster.Host(), kubeconfig: kubeconfig, caFile: caFile, moduleDir: opts.ModuleDir,
		sandboxImage: e.images[pauseImage], images: tarball, log: e.log, logFile: e.logFile,
	})
	if err != nil {
		return nil, err
	}
	if err := e.waitNodeReady(); err != nil {
		return nil, err
	}
	return e, nil
}

// startControllers starts kube-controller-manager and kube-scheduler on the
// host's loopback, neither serving (--secure-port=0).
func (e *Env) startControllers(kubeconfig, caFile string) error {
	bin := e.opts.NodeBinDir
	cm := exec.Command(filepath.Join(bin, "kube-controller-manager"),
		"--kubeconfig="+kubeconfig, "--authentication-kubeconfig="+kubeconfig,
		"--authorization-kubeconfig="+kubeconfig,
		// The apiserver may not yet serve extension-apiserver-authentication
		// to it: the controller manager would exit.
		"--authentication-skip-lookup=true",
		"--secure-port=0", "--leader-elect=false", "--root-ca-file="+caFile,
		"--use-service-account-credentials=false", "--controllers=*",
		"--node-monitor-period=2s", "-v=1")
	sched := exec.Command(filepath.Join(bin, "kube-scheduler"),
		"--kubeconfig="+kubeconfig, "--authentication-kubeconfig="+kubeconfig,
		"--authorization-kubeconfig="+kubeconfig, "--authentication-skip-lookup=true",
		"--secure-port=0", "--leader-elect=false", "-v=1")
	for name, cmd := range map[string]*exec.Cmd{"kube-controller-manager": cm, "kube-scheduler": sched} {
		p, err := startProc(name, cmd, e.logFile(name), nil)
		if err != nil {
			return err
		}
		e.procs = append(e.procs, p)
	}
	return nil
}

// waitNodeReady waits until the node reports Ready, and records how long
// that took.
func (e *Env) waitNodeReady() error {
	ctx, cancel := context.WithTimeout(context.Background(), e.opts.ReadyTimeout)
	defer cancel()
	var last string
	err := wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		if err := e.Node.exited(); err != nil {
			return false, err
		}
		for _, p := range e.procs {
			if err := p.exited(); err != nil {
				return false, err
			}
		}
		n, err := e.Cluster.Client.CoreV1().Nodes().Get(ctx, e.Node.Name, metav1.GetOptions{})
		if err != nil {
			last = err.Error()
			return false, nil
		}
		for _, c := range n.Status.Conditions {
			if c.Type == corev1.NodeReady {
				last = fmt.Sprintf("Ready=%s (%s: %s)", c.Status, c.Reason, c.Message)
				return c.Status == corev1.ConditionTrue, nil
			}
		}
		last = "no Ready condition yet"
		return false, nil
	})
	if err != nil {
		return fmt.Errorf("node %s not Ready (%s; logs in %s): %w", e.Node.Name, last, e.dir, err)
	}
	e.NodeReady = time.Since(e.Node.started)
	e.log.Info("node ready", "node", e.Node.Name, "took", e.NodeReady.Round(time.Millisecond))
	return nil
}

// RSSBytes is the resident memory of the whole cluster: etcd, the API
// server, the controllers, containerd, the kubelet, the shims and every
// container.
func (e *Env) RSSBytes() int64 {
	pids := map[int]bool{}
	for _, p := range e.set.PIDs() {
		pids[p] = true
	}
	for _, p := range e.procs {
		pids[p.cmd.Process.Pid] = true
	}
	if e.Node != nil {
		for _, p := range e.Node.pids() {
			pids[p] = true
		}
	}
	var sum int64
	for p := range pids {
		if b, err := framework.RSSBytes(p); err == nil {
			sum += b
		}
	}
	return sum
}

// stop tears everything down: the node (its processes, containers,
// namespaces and cgroups), the controllers, the control plane, the files.
func (e *Env) stop() error {
	var errs []error
	if e.Node != nil {
		errs = append(errs, e.Node.stop())
	}
	for _, p := range e.procs {
		errs = append(errs, p.stop())
	}
	if e.set != nil {
		errs = append(errs, e.set.Stop())
	}
	e.mu.Lock()
	for _, f := range e.files {
		f.Close()
	}
	e.files = nil
	e.mu.Unlock()
	if err := errors.Join(errs...); err != nil {
		e.lock.Close() // the next Start's sweep retries
		return fmt.Errorf("%w (files kept in %s)", err, e.dir)
	}
	err := os.RemoveAll(e.dir)
	e.lock.Close()
	return err
}

// logFile returns the log file of a process, in the environment's folder
// (kept when teardown fails).
func (e *Env) logFile(name string) io.Writer {
	f, err := os.OpenFile(filepath.Join(e.dir, "logs", name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return io.Discard
	}
	e.mu.Lock()
	e.files = append(e.files, f)
	e.mu.Unlock()
	return f
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

// tWriter writes log lines to a test's log.
type tWriter struct{ t testing.TB }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
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
