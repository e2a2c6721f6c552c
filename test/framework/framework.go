// Package framework starts real Kubernetes clusters for tests: one etcd and
// one kube-apiserver per cluster (the binaries hack/build-testbin.sh builds
// from the Go module proxy), each with an admin client, plus helpers to write
// the objects discovery reads and to make remote-secret kubeconfigs.
//
// A "cluster" runs no controller-manager and no kubelet: pods never run, the
// harness sets their status (IP, Ready), EndpointSlices appear only when a
// test writes them, and ServiceAccount token Secrets are never filled (tokens
// come from the TokenRequest API).
//
// Processes are stopped by ClusterSet.Stop, by Main on SIGINT/SIGTERM, and,
// when a test binary was killed outright, by the orphan sweep that every
// Start runs first: each set lives under a folder named after the owning
// process and holds an exclusive flock on its "lock" file while it lives
// (the kernel drops it when the owner dies, also when the owner ran in a
// PID namespace of its own, where its pid says nothing); the processes of
// folders whose lock is free are killed and the folders removed.
//
// Cost, measured on this machine (2 cores, 24 GiB) with
// `go test ./test/framework -run TestThreeClusters -v`, which logs both
// figures: three clusters sharing one etcd start in parallel in 5.2 s (13 s
// while other builds loaded the machine) and hold 889 MiB of RSS in all
// (VmRSS of etcd and the three kube-apiservers, read from /proc right after
// start).
package framework

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
)

// Options configures a ClusterSet.
type Options struct {
	// Names of the clusters to start (default: cluster-1, cluster-2, cluster-3).
	Names []string
	// AssetsDir holds kube-apiserver and etcd (default: $KUBEBUILDER_ASSETS).
	AssetsDir string
	// Output receives the processes' logs (default: discarded).
	Output io.Writer
	// MaxParallel bounds how many API servers start at once (default: all;
	// dozens at once on two cores outlast their start timeout).
	MaxParallel int
	// APIServerArgs are extra kube-apiserver flags (name without dashes ->
	// value), set on every cluster's API server.
	APIServerArgs map[string]string
	// ServingIPs are more addresses each API server's serving certificate
	// is valid for (an advertise address, the kubernetes Service's
	// ClusterIP). With any, the framework makes each cluster's CA itself
	// (Cluster.CAData), the serving certificate also names the kubernetes
	// Service's DNS names, and the API server presents a client certificate
	// of that CA (system:masters) to kubelets, so a kubelet whose
	// clientCAFile is Cluster.CAData serves it logs and exec.
	ServingIPs []net.IP
	// PerCluster adds, by cluster name, flags and serving addresses that
	// differ between clusters (an advertise address, an egress socket).
	PerCluster map[string]ClusterOptions
}

// ClusterOptions are one cluster's own additions to Options: its
// APIServerArgs override the set's of the same name, its ServingIPs are
// added to the set's.
type ClusterOptions struct {
	APIServerArgs map[string]string
	ServingIPs    []net.IP
}

// ClusterSet is a set of running clusters sharing one etcd.
type ClusterSet struct {
	Clusters []*Cluster
	root     string
	lock     *os.File // flocked while the set lives
	etcd     *envtest.Etcd
	stopOnce sync.Once
	stopErr  error
}

// Cluster is one running kube-apiserver with an admin identity.
type Cluster struct {
	Name string
	// Config is an admin (system:masters) rest.Config.
	Config *rest.Config
	// Client is an admin clientset.
	Client kubernetes.Interface

	mu  sync.Mutex
	api *envtest.APIServer
}

const sweepDir = "isthmus-testclusters"

// Start sweeps orphans of killed earlier runs, then starts one etcd and the
// named clusters in parallel. Call Stop when done.
func Start(opts Options) (*ClusterSet, error) {
	if len(opts.Names) == 0 {
		opts.Names = []string{"cluster-1", "cluster-2", "cluster-3"}
	}
	if opts.AssetsDir == "" {
		opts.AssetsDir = os.Getenv("KUBEBUILDER_ASSETS")
	}
	if opts.AssetsDir == "" {
		return nil, errors.New("no Kubernetes binaries: set KUBEBUILDER_ASSETS (make testbin prints the folder)")
	}
	for _, b := range []string{"kube-apiserver", "etcd"} {
		if _, err := os.Stat(filepath.Join(opts.AssetsDir, b)); err != nil {
			return nil, fmt.Errorf("%s missing in %s (run make testbin): %w", b, opts.AssetsDir, err)
		}
	}
	base := filepath.Join(os.TempDir(), sweepDir)
	SweepOrphans(base)
	if err := os.MkdirAll(base, 0o700); err != nil {
		return nil, err
	}
	root, err := os.MkdirTemp(base, strconv.Itoa(os.Getpid())+"-")
	if err != nil {
		return nil, err
	}
	lock, err := lockRoot(root)
	if err != nil {
		_ = os.RemoveAll(root)
		return nil, err
	}
	s := &ClusterSet{root: root, lock: lock}
	s.etcd = &envtest.Etcd{
		Path: filepath.Join(opts.AssetsDir, "etcd"), DataDir: filepath.Join(root, "etcd"),
		Out: opts.Output, Err: opts.Output, StartTimeout: time.Minute,
	}
	if err := os.MkdirAll(s.etcd.DataDir, 0o700); err != nil {
		return nil, err
	}
	if err := s.etcd.Start(); err != nil {
		_ = os.RemoveAll(root)
		lock.Close()
		return nil, fmt.Errorf("start etcd: %w", err)
	}
	s.Clusters = make([]*Cluster, len(opts.Names))
	errs := make([]error, len(opts.Names))
	var wg sync.WaitGroup
	slots := make(chan struct{}, cmp.Or(opts.MaxParallel, len(opts.Names)))
	for i, name := range opts.Names {
		wg.Go(func() {
			slots <- struct{}{}
			defer func() { <-slots }()
			s.Clusters[i], errs[i] = s.startCluster(name, opts)
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		_ = s.Stop()
		return nil, err
	}
	return s, nil
}

func (s *ClusterSet) startCluster(name string, opts Options) (*Cluster, error) {
	dir := filepath.Join(s.root, name)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	api := &envtest.APIServer{
		Path: filepath.Join(opts.AssetsDir, "kube-apiserver"), CertDir: dir, EtcdURL: s.etcd.URL,
		Out: opts.Output, Err: opts.Output, StartTimeout: 2 * time.Minute,
	}
	api.Configure().Set("etcd-prefix", "/"+name)
	own := opts.PerCluster[name]
	if ips := append(slices.Clone(opts.ServingIPs), own.ServingIPs...); len(ips) > 0 {
		ca, err := writeCerts(dir, ips)
		if err != nil {
			return nil, fmt.Errorf("certificates of %s: %w", name, err)
		}
		api.SecureServing.CA = ca // envtest keeps the files it finds
		api.Configure().Set("kubelet-client-certificate", filepath.Join(dir, kubeletClientCertFile))
		api.Configure().Set("kubelet-client-key", filepath.Join(dir, kubeletClientKeyFile))
	}
	for k, v := range opts.APIServerArgs {
		api.Configure().Set(k, v)
	}
	for k, v := range own.APIServerArgs {
		api.Configure().Set(k, v)
	}
	if err := api.Start(); err != nil {
		return nil, fmt.Errorf("start kube-apiserver of %s: %w", name, err)
	}
	cp := &envtest.ControlPlane{APIServer: api, Etcd: s.etcd}
	user, err := cp.AddUser(envtest.User{Name: "admin", Groups: []string{"system:masters"}}, &rest.Config{QPS: 1000, Burst: 2000})
	if err != nil {
		_ = api.Stop()
		return nil, err
	}
	cfg := user.Config()
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		_ = api.Stop()
		return nil, err
	}
	return &Cluster{Name: name, Config: cfg, Client: client, api: api}, nil
}

// Cluster returns the cluster of that name, or nil.
func (s *ClusterSet) Cluster(name string) *Cluster {
	for _, c := range s.Clusters {
		if c.Name == name {
			return c
		}
	}
	return nil
}

// Stop stops every process of the set and removes its files. It is
// idempotent.
func (s *ClusterSet) Stop() error {
	s.stopOnce.Do(func() {
		var errs []error
		var mu sync.Mutex
		var wg sync.WaitGroup
		for _, c := range s.Clusters {
			if c == nil {
				continue
			}
			wg.Go(func() {
				if err := c.StopAPIServer(); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
				}
			})
		}
		wg.Wait()
		if err := stopKill(s.etcd.DataDir, s.etcd.Stop, "etcd"); err != nil {
			errs = append(errs, err)
		}
		errs = append(errs, os.RemoveAll(s.root))
		s.lock.Close()
		s.stopErr = errors.Join(errs...)
	})
	return s.stopErr
}

// PIDs returns the pids of the set's running processes (etcd and the
// kube-apiservers).
func (s *ClusterSet) PIDs() []int {
	pids := PIDsWithArg(s.etcd.DataDir)
	for _, c := range s.Clusters {
		if p := c.APIServerPID(); p != 0 {
			pids = append(pids, p)
		}
	}
	return pids
}

// Host returns the URL of the cluster's API server.
func (c *Cluster) Host() string { return c.Config.Host }

// CAData returns the PEM CA of the cluster's API server.
func (c *Cluster) CAData() []byte { return c.Config.CAData }

// WriteAdminKubeconfig writes a kubeconfig with the cluster's admin client
// certificate to path (mode 0600), for processes the test starts.
func (c *Cluster) WriteAdminKubeconfig(path string) error {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters[c.Name] = &clientcmdapi.Cluster{Server: c.Host(), CertificateAuthorityData: c.CAData()}
	cfg.AuthInfos[c.Name] = &clientcmdapi.AuthInfo{ClientCertificateData: c.Config.CertData, ClientKeyData: c.Config.KeyData}
	cfg.Contexts[c.Name] = &clientcmdapi.Context{Cluster: c.Name, AuthInfo: c.Name}
	cfg.CurrentContext = c.Name
	return clientcmd.WriteToFile(*cfg, path)
}

// StopAPIServer kills the cluster's kube-apiserver, as a crash would (its
// data stays in etcd); RestartAPIServer brings it back on the same address
// with the same certificates, so existing kubeconfigs and tokens keep working.
func (c *Cluster) StopAPIServer() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return stopKill(c.api.CertDir, c.api.Stop, "kube-apiserver of "+c.Name)
}

// stopKill kills the process whose command line names dir, waits until it
// is gone, then lets envtest reap it (stop).
func stopKill(dir string, stop func() error, what string) error {
	for _, p := range PIDsWithArg(dir) {
		_ = syscall.Kill(p, syscall.SIGKILL)
	}
	deadline := time.Now().Add(20 * time.Second)
	for len(PIDsWithArg(dir)) > 0 {
		if time.Now().After(deadline) {
			return fmt.Errorf("stop %s: still running after SIGKILL", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
	var err error
	for range 50 {
		// envtest notices the exit asynchronously; until then Stop tries
		// to signal the dead process and fails.
		if err = stop(); err == nil {
			return nil
		}
		time.Sleep(10 * time.Millisecond)
	}
	return fmt.Errorf("stop %s: %w", what, err)
}

// RestartAPIServer starts the cluster's kube-apiserver again after
// StopAPIServer.
func (c *Cluster) RestartAPIServer() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.api.Start(); err != nil {
		return fmt.Errorf("restart kube-apiserver of %s: %w", c.Name, err)
	}
	return nil
}

// APIServerPID returns the pid of the running kube-apiserver (0 if none).
func (c *Cluster) APIServerPID() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.api == nil {
		return 0
	}
	return pidOfArg(c.api.CertDir)
}

// ReaderKubeconfig creates the reader ServiceAccount and RBAC pilot needs in
// this cluster and returns a kubeconfig with its bearer token and the inline
// CA: exactly what a remote secret holds for clusterID.
func (c *Cluster) ReaderKubeconfig(ctx context.Context, clusterID string, opts remotesecret.ReaderOptions) ([]byte, error) {
	if opts.TokenWait == 0 {
		opts.TokenWait = time.Millisecond // no token controller runs here
	}
	token, err := remotesecret.EnsureReader(ctx, c.Client, opts)
	if err != nil {
		return nil, err
	}
	return remotesecret.Kubeconfig(clusterID, c.Host(), c.CAData(), token)
}

// lockRoot creates root's lock file and takes its exclusive flock, held as
// long as the returned file is open. The file is locked under another name
// and renamed into place, so a sweep never finds it unlocked while its
// owner lives.
func lockRoot(root string) (*os.File, error) {
	tmp := filepath.Join(root, "lock.new")
	lock, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		lock.Close()
		return nil, fmt.Errorf("lock %s: %w", root, err)
	}
	if err := os.Rename(tmp, filepath.Join(root, "lock")); err != nil {
		lock.Close()
		return nil, err
	}
	return lock, nil
}

// orphaned reports whether the set in dir (named <owner pid>-...) has lost
// its owner: its lock is free, or, for a folder without a lock file, its
// owner's pid is gone.
func orphaned(dir, name string) bool {
	lock, err := os.OpenFile(filepath.Join(dir, "lock"), os.O_RDWR, 0)
	if err == nil {
		defer lock.Close() // releases the probe's own flock, if it got one
		return syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) == nil
	}
	owner, _, ok := strings.Cut(name, "-")
	pid, err := strconv.Atoi(owner)
	return ok && err == nil && !alive(pid)
}

// SweepOrphans kills the processes of cluster sets whose owning test process
// is gone and removes their folders under base.
func SweepOrphans(base string) {
	entries, err := os.ReadDir(base)
	if err != nil {
		return
	}
	for _, e := range entries {
		dir := filepath.Join(base, e.Name())
		if !orphaned(dir, e.Name()) {
			continue
		}
		for _, p := range PIDsWithArg(dir) {
			_ = syscall.Kill(-p, syscall.SIGKILL) // its process group (envtest sets Setpgid)
			_ = syscall.Kill(p, syscall.SIGKILL)
		}
		_ = os.RemoveAll(dir)
	}
}

func alive(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

// PIDsWithArg lists the processes whose command line contains s (how a
// cluster, or a real node, finds what it started under its folder).
func PIDsWithArg(s string) []int {
	procs, _ := os.ReadDir("/proc")
	var out []int
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		cmd, err := os.ReadFile(filepath.Join("/proc", p.Name(), "cmdline"))
		if err == nil && strings.Contains(string(cmd), s) {
			out = append(out, pid)
		}
	}
	return out
}

func pidOfArg(s string) int {
	if p := PIDsWithArg(s); len(p) > 0 {
		return p[0]
	}
	return 0
}

// RSSBytes returns the resident set size of process pid, from /proc.
func RSSBytes(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb * 1024, err
		}
	}
	return 0, errors.New("no VmRSS")
}

// ProcessPIDs returns the pids of every process the set runs (etcd and the
// API servers).
func (s *ClusterSet) ProcessPIDs() []int {
	return PIDsWithArg(s.root)
}

// TestWriter is an io.Writer that writes each line to the test's log (for
// slog handlers and process output in tests).
func TestWriter(t testing.TB) io.Writer { return testWriter{t} }

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}
