//go:build linux

package agent_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/cni/agent"
	"github.com/isthmus-mesh/isthmus/cni/plugin"
	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/ztunnel/inpod"
	"github.com/isthmus-mesh/isthmus/ztunnel/inpod/inpodtest"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns/netnstest"
)

var (
	clusters *framework.ClusterSet
	buildDir string
)

func TestMain(m *testing.M) {
	if os.Getenv(sandboxHolderEnv) == "1" {
		holdSandbox() // a child process: a pod's process, nothing else
	}
	var err error
	buildDir, err = os.MkdirTemp("", "isthmus-cni-build-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := framework.Main(m, framework.Options{Names: []string{"cni"}}, &clusters)
	os.RemoveAll(buildDir)
	if code == 0 {
		if err := goleak.Find(goleak.IgnoreTopFunction("k8s.io/klog/v2.(*flushDaemon).run.func1")); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

var (
	buildOnce sync.Once
	binPath   string
	buildErr  error
)

// pluginBinary builds cmd/isthmus-cni once per test process.
func pluginBinary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		binPath = filepath.Join(buildDir, "isthmus-cni")
		out, err := exec.Command("go", "build", "-o", binPath, "github.com/isthmus-mesh/isthmus/cmd/isthmus-cni").CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("go build cmd/isthmus-cni: %v\n%s", err, out)
		}
	})
	require.NoError(t, buildErr)
	return binPath
}

var envSeq atomic.Int32

// pod is one "pod" of the test node: a network namespace bind-mounted in
// the runtime's netns directory, a veth to the node, and (once created)
// its Pod object.
type pod struct {
	name, namespace string
	netnsPath       string
	ns              *os.File
	ip, gw          netip.Addr
	obj             *corev1.Pod
}

// env is a node: its namespace holds the node's address (on lo) and one
// veth per pod; the agent and the plugin's files live in temporary
// directories; the cluster is the real API server of the package.
type env struct {
	t          *testing.T
	c          *framework.Cluster
	nodeName   string
	mesh       string // the ambient namespace
	dir        string
	binDir     string
	confDir    string
	netnsDir   string
	nodeNSPath string
	node       *os.File
	nodeIP     netip.Addr
	zSock      string
	pSock      string
	stateDir   string
	cgDir      string // the test's kubepods cgroup, a directory of the cgroup2 mount
	cgRoot     string // that cgroup's path, as /proc/<pid>/cgroup shows it
	reg        *prometheus.Registry
	agent      *agent.Agent
	stopAgent  func()
}

func newEnv(t *testing.T) *env {
	t.Helper()
	n := envSeq.Add(1)
	e := &env{t: t, c: clusters.Clusters[0], nodeName: fmt.Sprintf("node-%d", n), mesh: fmt.Sprintf("mesh-%d", n)}
	// Unix socket paths are short; t.TempDir names are long.
	dir, err := os.MkdirTemp("", "cni-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	e.dir = dir
	e.binDir, e.confDir, e.netnsDir = filepath.Join(dir, "bin"), filepath.Join(dir, "net.d"), filepath.Join(dir, "netns")
	for _, d := range []string{e.binDir, e.confDir, e.netnsDir} {
		require.NoError(t, os.MkdirAll(d, 0o755))
	}
	e.zSock, e.pSock = filepath.Join(dir, "z.sock"), filepath.Join(dir, "p.sock")
	e.stateDir = filepath.Join(dir, "state")
	e.cgDir, e.cgRoot = kubepodsCgroup(t)
	e.nodeNSPath = filepath.Join(dir, "node-netns")
	e.node = netnstest.NewAt(t, e.nodeNSPath)
	e.nodeIP = netip.MustParseAddr("10.250.0.1")
	h := netnstest.Handle(t, e.node)
	lo, err := h.LinkByName("lo")
	require.NoError(t, err)
	netnstest.AddAddr(t, h, lo, netip.PrefixFrom(e.nodeIP, 32))
	netnstest.Sysctl(t, e.node, "net/ipv4/ip_forward", "1")
	conflist := `{"cniVersion": "1.0.0", "name": "test-net", "plugins": [{"type": "ptp", "ipam": {"type": "host-local"}}]}`
	require.NoError(t, os.WriteFile(filepath.Join(e.confDir, "10-test.conflist"), []byte(conflist), 0o644))

	ctx := context.Background()
	require.NoError(t, e.c.EnsureNamespace(ctx, e.mesh, map[string]string{"istio.io/dataplane-mode": "ambient"}))
	node, err := e.c.CreateNode(ctx, e.nodeName, nil)
	require.NoError(t, err)
	node.Status.Addresses = []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: e.nodeIP.String()}}
	_, err = e.c.Client.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{})
	require.NoError(t, err)
	e.reg = prometheus.NewRegistry()
	return e
}

// addPod makes pod i's namespace (10.250.i.2/24, gateway 10.250.i.1).
func (e *env) addPod(i int, namespace, name string) *pod {
	e.t.Helper()
	p := &pod{name: name, namespace: namespace, netnsPath: filepath.Join(e.netnsDir, "cni-"+name)}
	p.ns = netnstest.NewAt(e.t, p.netnsPath)
	p.ip = netip.AddrFrom4([4]byte{10, 250, byte(i), 2})
	p.gw = netip.AddrFrom4([4]byte{10, 250, byte(i), 1})
	netnstest.Veth(e.t, e.node, fmt.Sprintf("veth%d", i), netip.PrefixFrom(p.gw, 24), p.ns, "eth0", netip.PrefixFrom(p.ip, 24))
	netnstest.Route(e.t, p.ns, netip.MustParsePrefix("0.0.0.0/0"), p.gw)
	return p
}

// create makes the Pod object: pending without an address (as before the
// CNI ADD), or running with its address (as a pod that ran before the
// agent).
func (e *env) create(p *pod, labels map[string]string, running bool) {
	e.t.Helper()
	ctx := context.Background()
	opts := framework.PodOptions{Namespace: p.namespace, Name: p.name, Labels: labels, ServiceAccount: "sa-" + p.name, Node: e.nodeName}
	var err error
	if running {
		opts.IP, opts.Ready = p.ip, true
		p.obj, err = e.c.CreatePod(ctx, opts)
	} else {
		p.obj, err = e.c.Client.CoreV1().Pods(p.namespace).Create(ctx, framework.Pod(opts), metav1.CreateOptions{})
	}
	require.NoError(e.t, err)
}

// running reports the pod running with its address, as the kubelet does
// after the sandbox is set up.
func (e *env) running(p *pod) {
	e.t.Helper()
	var err error
	p.obj, err = e.c.SetPodStatus(context.Background(), p.obj, p.ip, true)
	require.NoError(e.t, err)
}

func (e *env) relabel(p *pod, labels map[string]string) {
	e.t.Helper()
	ctx := context.Background()
	cur, err := e.c.Client.CoreV1().Pods(p.namespace).Get(ctx, p.name, metav1.GetOptions{})
	require.NoError(e.t, err)
	cur.Labels = labels
	p.obj, err = e.c.Client.CoreV1().Pods(p.namespace).Update(ctx, cur, metav1.UpdateOptions{})
	require.NoError(e.t, err)
}

func (e *env) config() agent.Config {
	return agent.Config{
		NodeName: e.nodeName, CNIBinDir: e.binDir, CNIConfDir: e.confDir, PluginSource: pluginBinary(e.t),
		PluginSocket: e.pSock, ZtunnelSocket: e.zSock, NetnsDirs: []string{e.netnsDir}, ProcDir: "/proc",
		NodeNetNS: e.nodeNSPath, MonitoringAddr: agent.Disabled, InstallCheckInterval: time.Second,
		StateDir: e.stateDir, PodCgroupRoots: []string{e.cgRoot},
	}
}

// startAgent runs the agent in this process until the test ends.
func (e *env) startAgent(cfg agent.Config) {
	e.t.Helper()
	e.reg = prometheus.NewRegistry()
	log := slog.New(slog.NewTextHandler(testWriter{e.t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	a, err := agent.New(cfg, agent.Deps{Client: e.c.Client, Log: log, Registry: e.reg})
	require.NoError(e.t, err)
	e.agent = a
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	var once sync.Once
	e.stopAgent = func() {
		once.Do(func() {
			cancel()
			require.NoError(e.t, <-done)
		})
	}
	e.t.Cleanup(e.stopAgent)
	require.Eventually(e.t, a.Ready, 30*time.Second, 20*time.Millisecond, "agent ready (plugin installed, pods reconciled)")
}

// ztunnel is a running inpod.Client with a test handler.
type ztunnel struct {
	h      *inpodtest.Handler
	client *inpod.Client
	stop   func()
}

func (e *env) startZtunnel() *ztunnel {
	e.t.Helper()
	h := inpodtest.New(e.t)
	c, err := inpod.New(inpod.Config{SocketPath: e.zSock, InitialBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond},
		inpod.Deps{Handler: h})
	require.NoError(e.t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var once sync.Once
	z := &ztunnel{h: h, client: c}
	z.stop = func() {
		once.Do(func() {
			cancel()
			require.NoError(e.t, <-done)
			h.Close() // a dead ztunnel's listeners are gone
		})
	}
	e.t.Cleanup(z.stop)
	return z
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(b)))
	return len(b), nil
}

// cniResult is what the plugin printed and how it exited.
type cniResult struct {
	stdout []byte
	err    error
}

// cni runs the installed plugin binary as a runtime would.
func (e *env) cni(command string, p *pod, prevIP netip.Addr) cniResult {
	e.t.Helper()
	conf := e.pluginConf(prevIP, p.netnsPath)
	uid := ""
	if p.obj != nil {
		uid = string(p.obj.UID)
	}
	cmd := exec.Command(filepath.Join(e.binDir, plugin.Name))
	cmd.Env = []string{
		"CNI_COMMAND=" + command, "CNI_CONTAINERID=ctr-" + p.name, "CNI_NETNS=" + p.netnsPath,
		"CNI_IFNAME=eth0", "CNI_PATH=" + e.binDir,
		fmt.Sprintf("CNI_ARGS=IgnoreUnknown=1;K8S_POD_NAMESPACE=%s;K8S_POD_NAME=%s;K8S_POD_INFRA_CONTAINER_ID=ctr-%s;K8S_POD_UID=%s",
			p.namespace, p.name, p.name, uid),
	}
	cmd.Stdin = bytes.NewReader(conf)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		err = fmt.Errorf("%w: stdout %s stderr %s", err, out, stderr.String())
	}
	return cniResult{stdout: out, err: err}
}

// pluginConf is the network configuration the runtime hands the plugin:
// the plugin's entry from the installed conflist, with the list's name and
// version and the previous plugin's result.
func (e *env) pluginConf(ip netip.Addr, netnsPath string) []byte {
	e.t.Helper()
	b, err := os.ReadFile(filepath.Join(e.confDir, "10-test.conflist"))
	require.NoError(e.t, err)
	var list struct {
		CNIVersion string           `json:"cniVersion"`
		Name       string           `json:"name"`
		Plugins    []map[string]any `json:"plugins"`
	}
	require.NoError(e.t, json.Unmarshal(b, &list))
	entry := list.Plugins[len(list.Plugins)-1]
	require.Equal(e.t, plugin.Name, entry["type"], "the plugin is last in the chain")
	entry["cniVersion"], entry["name"] = list.CNIVersion, list.Name
	if ip.IsValid() {
		gw := ip.As4()
		gw[3] = 1
		entry["prevResult"] = map[string]any{
			"cniVersion": "1.0.0",
			"interfaces": []any{map[string]any{"name": "eth0", "sandbox": netnsPath}},
			"ips":        []any{map[string]any{"address": ip.String() + "/24", "gateway": netip.AddrFrom4(gw).String(), "interface": 0}},
		}
	}
	out, err := json.Marshal(entry)
	require.NoError(e.t, err)
	return out
}

// server is a named TCP listener in a namespace that answers each
// connection with its name and records the peer's address.
type server struct {
	name string
	got  chan netip.AddrPort
}

func serve(t *testing.T, ns *os.File, addr, name string) *server {
	t.Helper()
	ln, err := netns.Listen(context.Background(), ns, "tcp", addr, nil)
	require.NoError(t, err)
	s := &server{name: name, got: make(chan netip.AddrPort, 64)}
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			r := c.RemoteAddr().(*net.TCPAddr).AddrPort()
			select {
			case s.got <- netip.AddrPortFrom(r.Addr().Unmap(), r.Port()):
			default:
			}
			_, _ = c.Write([]byte(name + "\n"))
			c.Close()
		}
	})
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	return s
}

func (s *server) next(t *testing.T) netip.AddrPort {
	t.Helper()
	select {
	case a := <-s.got:
		return a
	case <-time.After(10 * time.Second):
		t.Fatalf("server %s accepted nothing", s.name)
		return netip.AddrPort{}
	}
}

// ask connects from inside ns (an unmodified client: no mark) to dst and
// returns the first line of the answer.
func ask(ns *os.File, dst netip.AddrPort) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := (&netns.Dialer{NetNS: ns}).DialContext(ctx, "tcp", dst.String())
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line), err
}

func mustAsk(t *testing.T, ns *os.File, dst netip.AddrPort) string {
	t.Helper()
	got, err := ask(ns, dst)
	require.NoError(t, err, "connect to %s", dst)
	return got
}

// metric returns the value of the sample of name whose labels include
// labels (0 if none).
func metric(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if hasLabels(m, labels) {
				if g := m.GetGauge(); g != nil {
					return g.GetValue()
				}
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

func hasLabels(m *dto.Metric, want map[string]string) bool {
	n := 0
	for _, lp := range m.GetLabel() {
		if v, ok := want[lp.GetName()]; ok && v == lp.GetValue() {
			n++
		}
	}
	return n == len(want)
}
