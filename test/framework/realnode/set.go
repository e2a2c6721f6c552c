package realnode

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/isthmus-mesh/isthmus/internal/imagebuild"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// ClusterSpec is one cluster of a Set.
type ClusterSpec struct {
	// Name of the cluster (a DNS-1123 label).
	Name string
	// Network the cluster's nodes are on (default "<Name>-network").
	// Clusters naming the same network share its router: their pods reach
	// each other directly.
	Network string
	// Nodes is how many nodes the cluster has (default 1), named
	// "<Name>-node-<k>" unless NodeNames names them.
	Nodes int
	// NodeNames, when set, names the nodes (and sets their number).
	NodeNames []string
}

// SetOptions configures StartSet and Launch.
type SetOptions struct {
	// Clusters to start (at least one).
	Clusters []ClusterSpec
	// NodeBinDir holds the node binaries (default $ISTHMUS_NODEBIN).
	NodeBinDir string
	// AssetsDir holds kube-apiserver and etcd (default $KUBEBUILDER_ASSETS).
	AssetsDir string
	// Images are the test's own images, built once with internal/imagebuild
	// from this module's main packages and imported into every node's
	// containerd; Env.ImageRef names them. The pause image is always added.
	Images []imagebuild.Image
	// ModuleDir is the root of this Go module (default: found from the
	// working directory upwards).
	ModuleDir string
	// Log receives progress (default: the test's log in StartSet,
	// discarded in Launch).
	Log *slog.Logger
	// ReadyTimeout bounds the wait for the nodes to be Ready, and for each
	// cluster's DNS (default 3 min each).
	ReadyTimeout time.Duration
	// NoClusterDNS skips CoreDNS in every cluster: StartSet returns sooner,
	// and pods get no cluster nameserver.
	NoClusterDNS bool
}

// Set is a set of running clusters with real nodes on joined networks
// (see the package doc for the address plan and what crosses the wan).
type Set struct {
	// Clusters are the clusters, in SetOptions.Clusters' order.
	Clusters []*Env
	// Started is how long starting the set took.
	Started time.Duration

	opts   SetOptions
	log    *slog.Logger
	dir    string
	lock   *os.File // flocked while the set lives (see sweepOrphans)
	cp     *framework.ClusterSet
	topo   *topology
	images map[string]string
	mu     sync.Mutex
	files  []*os.File // the log files, closed by stop

	stopOnce sync.Once
	stopErr  error
}

// Cluster returns the cluster called name, or nil.
func (s *Set) Cluster(name string) *Env {
	for _, e := range s.Clusters {
		if e.Cluster.Name == name {
			return e
		}
	}
	return nil
}

// Dir is the set's folder in os.TempDir() (logs, configs, the nodes'
// state); its base name is also the name of the cgroup every node's
// cgroup is under. Teardown removes it.
func (s *Set) Dir() string { return s.dir }

// ExposeGateway lets TCP connections from every network to ap through the
// wan: ap is a node's IP and a port that a hostNetwork pod on that node
// (a gateway) listens on. Nothing else of the node becomes reachable.
func (s *Set) ExposeGateway(ap netip.AddrPort) error {
	for _, e := range s.Clusters {
		for _, n := range e.Nodes {
			if n.IP == ap.Addr() {
				return s.topo.pass(ap)
			}
		}
	}
	return fmt.Errorf("expose gateway %s: %w (a gateway listens on a node's IP)", ap, errNoNetwork)
}

// ExposeHost gives network an address whose port relays to target, a
// listener on the host's loopback (pilot's xDS, say: "127.0.0.1:15012"),
// reachable from every network through the wan, as each API server is.
func (s *Set) ExposeHost(network string, port uint16, target string) (netip.AddrPort, error) {
	n := s.topo.network(network)
	if n == nil {
		return netip.AddrPort{}, fmt.Errorf("expose host: no network %q", network)
	}
	return s.topo.exposeHost(n, port, target)
}

// WANRejected is how many packets the wan's filter has refused.
func (s *Set) WANRejected() (uint64, error) { return s.topo.rejected() }

// RSSBytes is the resident memory of the whole set: etcd, every API
// server, controller, containerd, kubelet, shim and container.
func (s *Set) RSSBytes() int64 {
	pids := map[int]bool{}
	for _, p := range s.cp.PIDs() {
		pids[p] = true
	}
	for _, e := range s.Clusters {
		for _, p := range e.pids() {
			pids[p] = true
		}
	}
	return sumRSS(pids)
}

// StartSet brings up the clusters and their nodes, waits for every node to
// be Ready, and registers the teardown with t.Cleanup (see Launch). Any
// failure fails the test; Log defaults to the test's log.
func StartSet(t testing.TB, opts SetOptions) *Set {
	t.Helper()
	if opts.Log == nil {
		opts.Log = slog.New(slog.NewTextHandler(framework.TestWriter(t), &slog.HandlerOptions{Level: slog.LevelInfo}))
	}
	s, err := Launch(t.Context(), opts)
	if err != nil {
		t.Fatalf("realnode: %v", err)
	}
	t.Cleanup(func() {
		if err := s.Stop(); err != nil {
			t.Errorf("realnode: teardown: %v", err)
		}
	})
	return s
}

// Launch brings up the clusters and their nodes and waits for every node
// (and each cluster's DNS) to be Ready, for programs that are not tests
// (the demo, a set kept up for tests given kubeconfigs). The control
// planes, the images and the networks are made in parallel, then the nodes
// start in parallel. On error everything started is torn down; otherwise
// the caller calls Stop. Log defaults to discarding.
func Launch(ctx context.Context, opts SetOptions) (*Set, error) {
	s, err := startSet(ctx, opts)
	if err != nil && s != nil {
		if stopErr := s.Stop(); stopErr != nil {
			err = fmt.Errorf("%w; teardown: %w", err, stopErr)
		}
		return nil, err
	}
	return s, err
}

func (o SetOptions) withDefaults() (SetOptions, error) {
	o.Clusters = append([]ClusterSpec(nil), o.Clusters...)
	for i := range o.Clusters {
		c := &o.Clusters[i]
		if c.Network == "" {
			c.Network = c.Name + "-network"
		}
		if c.Nodes < 0 {
			continue // validate says so
		}
		if len(c.NodeNames) == 0 {
			for k := 1; k <= max(c.Nodes, 1); k++ {
				c.NodeNames = append(c.NodeNames, fmt.Sprintf("%s-node-%d", c.Name, k))
			}
		}
		c.Nodes = len(c.NodeNames)
	}
	if o.NodeBinDir == "" {
		o.NodeBinDir = os.Getenv("ISTHMUS_NODEBIN")
	}
	if o.AssetsDir == "" {
		o.AssetsDir = os.Getenv("KUBEBUILDER_ASSETS")
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
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

// validate checks the clusters (after withDefaults): names are DNS-1123
// labels, no cluster or node name twice, a sane number of nodes.
func (o SetOptions) validate() error {
	if len(o.Clusters) == 0 {
		return errors.New("no clusters")
	}
	var errs []error
	names := map[string]bool{}
	perNetwork := map[string]int{}
	for _, c := range o.Clusters {
		for _, name := range append([]string{c.Name}, c.NodeNames...) {
			if msgs := validation.IsDNS1123Label(name); len(msgs) > 0 {
				errs = append(errs, fmt.Errorf("name %q: %v", name, msgs))
			}
			if names[name] {
				errs = append(errs, fmt.Errorf("name %q used twice (cluster and node names are unique in a set)", name))
			}
			names[name] = true
		}
		if c.Nodes < 0 {
			errs = append(errs, fmt.Errorf("cluster %s: %d nodes", c.Name, c.Nodes))
		}
		perNetwork[c.Network] += c.Nodes
	}
	for n, count := range perNetwork {
		if count > maxNodesPerNetwork {
			errs = append(errs, fmt.Errorf("network %s: %d nodes, at most %d", n, count, maxNodesPerNetwork))
		}
	}
	return errors.Join(errs...)
}

// check names everything missing before anything starts.
func (o SetOptions) check() error {
	var errs []error
	if os.Geteuid() != 0 {
		errs = append(errs, errors.New("a real node needs root (network and mount namespaces, mounts, cgroups): run the tests as root"))
	}
	if o.NodeBinDir == "" {
		errs = append(errs, errors.New("no node binaries: set ISTHMUS_NODEBIN (make nodebin builds them and prints the folder)"))
	} else {
		bins := nodeBinaries
		if !o.NoClusterDNS {
			bins = append(bins[:len(bins):len(bins)], "coredns")
		}
		for _, b := range bins {
			if _, err := os.Stat(filepath.Join(o.NodeBinDir, b)); err != nil {
				errs = append(errs, fmt.Errorf("%s missing in %s (run make nodebin)", b, o.NodeBinDir))
			}
		}
	}
	if _, err := exec.LookPath("nft"); err != nil {
		errs = append(errs, errors.New("no nft on PATH: kube-proxy's nftables mode runs it (Debian package nftables; hack/build-nodebin.sh installs it)"))
	}
	if o.AssetsDir == "" {
		errs = append(errs, errors.New("no Kubernetes binaries: set KUBEBUILDER_ASSETS (make testbin prints the folder)"))
	}
	if _, err := cgroupMounts(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// startSet starts the set; on error it returns what it started (nil when
// nothing was) for the caller to stop.
func startSet(ctx context.Context, opts SetOptions) (*Set, error) {
	t0 := time.Now()
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	if err := errors.Join(opts.validate(), opts.check()); err != nil {
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
	s := &Set{opts: opts, log: opts.Log, dir: dir, lock: lock}
	if err := os.MkdirAll(filepath.Join(dir, "logs"), 0o755); err != nil {
		return s, err
	}
	tarball, err := s.startShared()
	if err != nil {
		return s, err
	}
	if err := s.startControlPlanes(); err != nil {
		return s, err
	}
	if err := s.startNodes(tarball); err != nil {
		return s, err
	}
	if !opts.NoClusterDNS {
		if err := s.startClusterDNS(ctx); err != nil {
			return s, err
		}
	}
	s.Started = time.Since(t0)
	s.log.Info("set up", "clusters", len(s.Clusters), "took", s.Started.Round(time.Millisecond))
	return s, nil
}

// startShared builds the images, starts the control planes (one etcd, an
// API server per cluster, each with its egress socket and the address it
// will have in its network) and builds the networks, all three in
// parallel; it returns the images' tarball.
func (s *Set) startShared() (string, error) {
	var networks []string
	names := make([]string, len(s.opts.Clusters))
	perCluster := map[string]framework.ClusterOptions{}
	for i, c := range s.opts.Clusters {
		names[i] = c.Name
		if !slices.Contains(networks, c.Network) {
			networks = append(networks, c.Network)
		}
		e := &Env{Network: c.Network, set: s, spec: c}
		s.Clusters = append(s.Clusters, e)
		cdir := filepath.Join(s.dir, c.Name)
		if err := os.MkdirAll(cdir, 0o755); err != nil {
			return "", err
		}
		egress, err := e.serveEgress(cdir)
		if err != nil {
			return "", err
		}
		perCluster[c.Name] = apiServerOptions(plannedAPIServerIP(s.opts.Clusters, i), egress)
	}
	var wg sync.WaitGroup
	var imgErr, topoErr, cpErr error
	var tarball string
	wg.Go(func() { tarball, imgErr = s.buildImages() })
	wg.Go(func() { s.topo, topoErr = newTopology(networks) })
	t0 := time.Now()
	s.cp, cpErr = framework.Start(framework.Options{
		Names: names, AssetsDir: s.opts.AssetsDir, Output: s.logFile("control-plane"), PerCluster: perCluster,
	})
	s.log.Info("control planes up", "clusters", len(names), "took", time.Since(t0).Round(time.Millisecond), "err", cpErr)
	wg.Wait()
	if topoErr != nil {
		topoErr = fmt.Errorf("networks: %w", topoErr)
	}
	return tarball, errors.Join(cpErr, imgErr, topoErr)
}

// startControlPlanes writes each cluster's admin kubeconfig and CA, starts
// its controllers, gives its API server its address in its network (the
// one it advertises) and points its egress at the network's router.
func (s *Set) startControlPlanes() error {
	for i, spec := range s.opts.Clusters {
		e := s.Clusters[i]
		e.Cluster = s.cp.Clusters[i]
		cdir := filepath.Join(s.dir, spec.Name)
		e.kubeconfig, e.caFile = filepath.Join(cdir, "admin.kubeconfig"), filepath.Join(cdir, "ca.crt")
		if err := e.Cluster.WriteAdminKubeconfig(e.kubeconfig); err != nil {
			return err
		}
		if err := os.WriteFile(e.caFile, e.Cluster.CAData(), 0o644); err != nil {
			return err
		}
		if err := e.startControllers(); err != nil {
			return err
		}
		u, err := url.Parse(e.Cluster.Host())
		if err != nil {
			return err
		}
		port, err := strconv.ParseUint(u.Port(), 10, 16)
		if err != nil {
			return fmt.Errorf("cluster %s: API server port: %w", spec.Name, err)
		}
		if e.APIServer, err = s.ExposeHost(spec.Network, uint16(port), u.Host); err != nil {
			return fmt.Errorf("cluster %s: API server address: %w", spec.Name, err)
		}
		if want := plannedAPIServerIP(s.opts.Clusters, i); e.APIServer.Addr() != want {
			return fmt.Errorf("cluster %s: API server address %s, but it advertises %s", spec.Name, e.APIServer.Addr(), want)
		}
		e.egressFrom.Store(s.topo.network(spec.Network).router)
	}
	return nil
}

// plannedAPIServerIP is the address cluster i's API server gets in its
// network (topology.exposeHost's, for the clusters in order, before any
// other host forward): 10.<network>.255.<k>, with networks numbered in the
// order the clusters first name them and k counting the clusters on that
// network so far. It is known before the API servers start, so each
// advertises it.
func plannedAPIServerIP(specs []ClusterSpec, i int) netip.Addr {
	var networks []string
	k := 0
	for _, c := range specs[:i+1] {
		if !slices.Contains(networks, c.Network) {
			networks = append(networks, c.Network)
		}
		if c.Network == specs[i].Network {
			k++
		}
	}
	return pfx("10.%d.255.%d/32", slices.Index(networks, specs[i].Network)+1, k).Addr()
}

// startClusterDNS deploys each cluster's DNS and waits for all of them, in
// parallel.
func (s *Set) startClusterDNS(ctx context.Context) error {
	errs := make([]error, len(s.Clusters))
	var wg sync.WaitGroup
	for i, e := range s.Clusters {
		wg.Go(func() { errs[i] = e.startClusterDNS(ctx) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// startNodes places every node in its network, creates its Node object
// with its PodCIDR, then starts the nodes in parallel and waits for all to
// be Ready.
func (s *Set) startNodes(tarball string) error {
	if err := createCgroups(filepath.Base(s.dir)); err != nil {
		return err
	}
	type todo struct {
		e   *Env
		cfg nodeConfig
	}
	var all []todo
	for _, e := range s.Clusters {
		for _, name := range e.spec.NodeNames {
			nn, err := s.topo.attachNode(s.topo.network(e.Network))
			if err != nil {
				return err
			}
			if err := createNode(e.Cluster, name, nn.podCIDR); err != nil {
				return err
			}
			all = append(all, todo{e, nodeConfig{
				name: name, dir: filepath.Join(s.dir, name), bin: s.opts.NodeBinDir,
				cgroup:    filepath.Join(filepath.Base(s.dir), name),
				apiServer: e.Cluster.Host(), kubeconfig: e.kubeconfig, caFile: e.caFile, moduleDir: s.opts.ModuleDir,
				sandboxImage: s.images[pauseImage], images: tarball, log: s.log.With("node", name),
				logFile: func(p string) io.Writer { return s.logFile(filepath.Join(name, p)) },
				logDir:  filepath.Join(s.dir, "logs", name),
				addr:    nn.addr, gateway: nn.gateway, podCIDR: nn.podCIDR, uplink: nn.uplink,
				clusterDNS: e.clusterDNS(), clusterCIDR: s.topo.network(e.Network).prefix(),
			}})
			if err := os.MkdirAll(filepath.Join(s.dir, "logs", name), 0o755); err != nil {
				return err
			}
		}
	}
	nodes := make([]*Node, len(all))
	errs := make([]error, len(all))
	var wg sync.WaitGroup
	for i, td := range all {
		wg.Go(func() {
			nodes[i], errs[i] = startNode(td.cfg)
			if errs[i] == nil {
				errs[i] = td.e.waitNodeReady(nodes[i])
			}
		})
	}
	wg.Wait()
	// Every node started is the set's to stop, failed or not.
	for i, td := range all {
		if nodes[i] != nil {
			td.e.Nodes = append(td.e.Nodes, nodes[i])
		}
	}
	for _, e := range s.Clusters {
		if len(e.Nodes) > 0 {
			e.Node = e.Nodes[0]
		}
	}
	return errors.Join(errs...)
}

// createNode creates the Node object the kubelet then registers as (it
// keeps an existing Node's spec), so its spec.podCIDR is the range the
// node's CNI bridge and its router use, with no controller deciding.
func createNode(c *framework.Cluster, name string, podCIDR netip.Prefix) error {
	_, err := c.Client.CoreV1().Nodes().Create(context.Background(), &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       corev1.NodeSpec{PodCIDR: podCIDR.String(), PodCIDRs: []string{podCIDR.String()}},
	}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("create Node %s: %w", name, err)
	}
	return nil
}

// Stop tears everything down: the nodes (their processes, containers,
// namespaces and cgroups) in parallel, the controllers, the networks, the
// control planes, the cgroups, the files.
func (s *Set) Stop() error {
	s.stopOnce.Do(func() { s.stopErr = s.stop() })
	return s.stopErr
}

func (s *Set) stop() error {
	var mu sync.Mutex
	var errs []error
	add := func(err error) {
		mu.Lock()
		errs = append(errs, err)
		mu.Unlock()
	}
	var wg sync.WaitGroup
	for _, e := range s.Clusters {
		for _, n := range e.Nodes {
			wg.Go(func() { add(n.stop()) })
		}
	}
	wg.Wait()
	for _, e := range s.Clusters {
		for _, p := range e.procs {
			add(p.stop())
		}
		if e.egress != nil {
			e.egress.close()
		}
	}
	if s.topo != nil {
		s.topo.close()
	}
	if s.cp != nil {
		add(s.cp.Stop())
	}
	add(removeCgroups(filepath.Base(s.dir)))
	s.mu.Lock()
	for _, f := range s.files {
		f.Close()
	}
	s.files = nil
	s.mu.Unlock()
	if err := errors.Join(errs...); err != nil {
		s.lock.Close() // the next Start's sweep retries
		return fmt.Errorf("%w (files kept in %s)", err, s.dir)
	}
	err := os.RemoveAll(s.dir)
	s.lock.Close()
	return err
}

// logFile returns the log file of a process, in the set's folder (kept
// when teardown fails).
func (s *Set) logFile(name string) io.Writer {
	f, err := os.OpenFile(filepath.Join(s.dir, "logs", name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return io.Discard
	}
	s.mu.Lock()
	s.files = append(s.files, f)
	s.mu.Unlock()
	return f
}

// sumRSS adds up the resident memory of pids (those gone count nothing).
func sumRSS(pids map[int]bool) int64 {
	var sum int64
	for p := range pids {
		if b, err := framework.RSSBytes(p); err == nil {
			sum += b
		}
	}
	return sum
}

// clusterDNS is the kube-dns Service's IP, invalid without cluster DNS.
func (e *Env) clusterDNS() netip.Addr {
	if e.set.opts.NoClusterDNS {
		return netip.Addr{}
	}
	return dnsSvcIP
}

// RemoteKubeconfig is what a remote secret for this cluster holds when
// its reader is in another network: the reader ServiceAccount's kubeconfig
// (framework.Cluster.ReaderKubeconfig) whose server is the API server's
// address in the cluster's network (APIServer), with the name its
// certificate has (tls-server-name).
func (e *Env) RemoteKubeconfig(ctx context.Context, clusterID string, opts remotesecret.ReaderOptions) ([]byte, error) {
	kc, err := e.Cluster.ReaderKubeconfig(ctx, clusterID, opts)
	if err != nil {
		return nil, err
	}
	return remotesecret.ReplaceServer(kc, "https://"+e.APIServer.String())
}
