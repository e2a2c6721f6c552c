// Package demo runs a whole federation on one machine: two real clusters
// (kube-apiserver + etcd from test/framework) on two networks, pilot, a
// ztunnel per node and an east-west gateway per network, all as processes
// on their own loopback addresses, with an echo service that runs only in
// cluster-2 and a sleep client in cluster-1. It is what `make demo` runs,
// and the end-to-end test runs the same topology.
package demo

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/net/proxy"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/isthmus-mesh/isthmus/test/framework"
)

// Config configures a demo run.
type Config struct {
	// BinDir holds the pilot, ztunnel and isthmusctl binaries.
	BinDir string
	// AssetsDir holds kube-apiserver and etcd (default $KUBEBUILDER_ASSETS).
	AssetsDir string
	// WorkDir receives kubeconfigs, tokens and process logs (default: a
	// temporary folder, removed at the end).
	WorkDir string
	// Out receives the demo's narration (default os.Stdout).
	Out io.Writer
}

// Addresses of the topology (every pod, node proxy and gateway has its own
// loopback address).
const (
	pilotIP     = "127.0.50.1"
	node1IP     = "127.10.0.1"   // ztunnel of node-1a (cluster-1, network-1)
	sleepIP     = "127.10.0.10"  // the sleep pod on node-1a
	gateway1IP  = "127.10.255.1" // east-west gateway of network-1
	node2IP     = "127.20.0.1"   // ztunnel of node-2a (cluster-2, network-2)
	echoIP      = "127.20.0.10"  // the echo pod on node-2a
	localEchoIP = "127.10.0.20"  // a second echo pod, on node-1a (AddLocalEcho)
	gateway2IP  = "127.20.255.1" // east-west gateway of network-2
	EchoHost    = "echo.demo.svc.cluster.local"
	ns          = "isthmus-system"
)

// Demo is a running federation.
type Demo struct {
	cfg      Config
	out      io.Writer
	work     string
	ownWork  bool
	clusters *framework.ClusterSet
	procs    []*proc
	echoLn   net.Listener
	localLn  net.Listener
	kc1      string
	wg       sync.WaitGroup
}

type proc struct {
	name string
	cmd  *exec.Cmd
	log  string
	done chan struct{}
}

// Start builds the federation and returns once the request path is ready.
// Call Stop to tear everything down.
func Start(ctx context.Context, cfg Config) (d *Demo, err error) {
	if cfg.Out == nil {
		cfg.Out = os.Stdout
	}
	d = &Demo{cfg: cfg, out: cfg.Out, work: cfg.WorkDir}
	defer func() {
		if err != nil {
			d.Stop()
			d = nil
		}
	}()
	if d.work == "" {
		if d.work, err = os.MkdirTemp("", "isthmus-demo-"); err != nil {
			return d, err
		}
		d.ownWork = true
	}
	d.say("starting two real clusters (kube-apiserver + etcd each; a few seconds)")
	start := time.Now()
	if d.clusters, err = framework.Start(framework.Options{Names: []string{"cluster-1", "cluster-2"}, AssetsDir: cfg.AssetsDir}); err != nil {
		return d, err
	}
	d.say("clusters up in %v", time.Since(start).Round(100*time.Millisecond))
	c1, c2 := d.clusters.Cluster("cluster-1"), d.clusters.Cluster("cluster-2")
	kc1, err := d.writeAdminKubeconfig(c1)
	if err != nil {
		return d, err
	}
	kc2, err := d.writeAdminKubeconfig(c2)
	if err != nil {
		return d, err
	}
	for _, c := range []*framework.Cluster{c1, c2} {
		if err := c.EnsureNamespace(ctx, ns, nil); err != nil {
			return d, err
		}
	}

	d.say("starting pilot on %s (config cluster: cluster-1, network-1)", pilotIP)
	d.kc1 = kc1
	if err := d.StartPilot(ctx); err != nil {
		return d, err
	}

	d.say("registering cluster-2 (network-2) with isthmusctl create-remote-secret --apply")
	if out, err := exec.CommandContext(ctx, filepath.Join(cfg.BinDir, "isthmusctl"), "create-remote-secret", "--kubeconfig", kc2,
		"--name", "cluster-2", "--network", "network-2", "--apply", "--primary-kubeconfig", kc1, "--token-wait", "1s").CombinedOutput(); err != nil {
		return d, fmt.Errorf("create-remote-secret: %w: %s", err, out)
	}

	d.say("creating workloads: echo (cluster-2 only, %s) and sleep (cluster-1, %s)", echoIP, sleepIP)
	if err := d.workloads(ctx, c1, c2); err != nil {
		return d, err
	}
	if err := d.startEcho(); err != nil {
		return d, err
	}

	d.say("starting a ztunnel per node and an east-west gateway per network")
	for _, z := range []struct {
		name, cluster, network, node, ip, mode, sa string
		c                                          *framework.Cluster
	}{
		{"ztunnel-node-1a", "cluster-1", "network-1", "node-1a", node1IP, "node", "ztunnel", c1},
		{"ztunnel-node-2a", "cluster-2", "network-2", "node-2a", node2IP, "node", "ztunnel", c2},
		{"gateway-network-1", "cluster-1", "network-1", "gw-node-1", gateway1IP, "gateway", "eastwest-gateway", c1},
		{"gateway-network-2", "cluster-2", "network-2", "gw-node-2", gateway2IP, "gateway", "eastwest-gateway", c2},
	} {
		token, roots, err := d.ztunnelCredentials(ctx, z.c, z.name, z.node, z.sa, netip.MustParseAddr(z.ip))
		if err != nil {
			return d, fmt.Errorf("%s credentials: %w", z.name, err)
		}
		args := []string{"--mode", z.mode, "--node", z.node, "--cluster-id", z.cluster, "--network", z.network,
			"--namespace", ns, "--service-account", z.sa, "--xds-address", pilotIP + ":15012", "--ca-address", pilotIP + ":15012",
			"--ca-token", token, "--root-cert", roots, "--admin-addr", z.ip + ":15000", "--readiness-addr", z.ip + ":15021",
			"--metrics-addr", z.ip + ":15020", "--log-level", "info"}
		if z.mode == "node" {
			args = append(args, "--socks5-addr", z.ip+":15080", "--outbound-addr", z.ip+":15001", "--node-ip", z.ip)
		} else {
			args = append(args, "--gateway-addr", z.ip+":15008")
		}
		if err := d.spawn(ctx, z.name, "ztunnel", args...); err != nil {
			return d, err
		}
	}
	for _, ip := range []string{node1IP, node2IP, gateway1IP, gateway2IP} {
		if err := waitHTTP(ctx, "http://"+ip+":15021/healthz/ready", time.Minute); err != nil {
			return d, fmt.Errorf("ztunnel on %s not ready: %w", ip, err)
		}
	}
	return d, nil
}

// StartPilot starts the pilot process (again, after StopPilot) and waits
// until it is ready.
func (d *Demo) StartPilot(ctx context.Context) error {
	if err := d.spawn(ctx, "pilot", "pilot", "--kubeconfig", d.kc1, "--cluster-id", "cluster-1", "--network", "network-1",
		"--xds-addr", pilotIP+":15012", "--monitoring-addr", pilotIP+":15014", "--debug-addr", pilotIP+":8080",
		"--serving-san", pilotIP, "--sync-timeout", "30s", "--no-leader-election"); err != nil {
		return err
	}
	if err := waitHTTP(ctx, "http://"+pilotIP+":15014/readyz", time.Minute); err != nil {
		return fmt.Errorf("pilot not ready: %w (log: %s)", err, d.logOf("pilot"))
	}
	return nil
}

// StopPilot stops the pilot process (SIGTERM) and waits for it to exit.
func (d *Demo) StopPilot() {
	for i, p := range d.procs {
		if p.name == "pilot" {
			stopProc(p)
			d.procs = append(d.procs[:i], d.procs[i+1:]...)
			return
		}
	}
}

// Cluster returns the demo's cluster of that name ("cluster-1",
// "cluster-2"), for tests that change objects in it.
func (d *Demo) Cluster(name string) *framework.Cluster { return d.clusters.Cluster(name) }

// PilotURL returns the base URL of pilot's port (8080 debug, 15014
// monitoring).
func PilotURL(port int) string { return fmt.Sprintf("http://%s:%d", pilotIP, port) }

// AddLocalEcho runs a second echo instance in cluster-1 (network-1), on
// node-1a at 127.10.0.20, behind the same federated service.
func (d *Demo) AddLocalEcho(ctx context.Context) error {
	c1 := d.clusters.Cluster("cluster-1")
	if _, err := c1.CreateService(ctx, "demo", "echo", map[string]string{"app": "echo"}, framework.ServicePort{Name: "tcp-echo", Port: 80, TargetPort: 8080}); err != nil {
		return err
	}
	if _, err := c1.CreatePod(ctx, framework.PodOptions{Namespace: "demo", Name: "echo-local", Labels: map[string]string{"app": "echo"},
		ServiceAccount: "echo", Node: "node-1a", IP: mustAddr(localEchoIP), Ready: true}); err != nil {
		return err
	}
	ln, err := d.serveEcho(localEchoIP+":8080", "echo-local (cluster-1, network-1, "+localEchoIP+")")
	d.localLn = ln
	return err
}

// SetLocalEchoReady flips the Ready condition of cluster-1's echo pod.
func (d *Demo) SetLocalEchoReady(ctx context.Context, ready bool) error {
	c1 := d.clusters.Cluster("cluster-1")
	pod, err := c1.Client.CoreV1().Pods("demo").Get(ctx, "echo-local", metav1.GetOptions{})
	if err != nil {
		return err
	}
	_, err = c1.SetPodStatus(ctx, pod, mustAddr(localEchoIP), ready)
	return err
}

// Request sends msg from the sleep pod (cluster-1) to echo.demo:80 through
// its node's ztunnel (SOCKS5) and returns the reply.
func (d *Demo) Request(ctx context.Context, msg string) (string, error) {
	conn, err := d.Dial(ctx)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	return Exchange(conn, msg)
}

// Dial opens a connection from the sleep pod to echo.demo:80 through its
// node's ztunnel (SOCKS5).
func (d *Demo) Dial(ctx context.Context) (net.Conn, error) {
	src := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(sleepIP)}, Timeout: 5 * time.Second}
	socks, err := proxy.SOCKS5("tcp", node1IP+":15080", nil, src)
	if err != nil {
		return nil, err
	}
	conn, err := socks.(proxy.ContextDialer).DialContext(ctx, "tcp", EchoHost+":80")
	if err != nil {
		return nil, fmt.Errorf("dial %s through the ztunnel of node-1a: %w", EchoHost, err)
	}
	return conn, nil
}

// Exchange sends one line on conn and reads one line back.
func Exchange(conn net.Conn, msg string) (string, error) {
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(conn, msg+"\n"); err != nil {
		return "", err
	}
	reply, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		return "", fmt.Errorf("read reply: %w", err)
	}
	return strings.TrimSpace(reply), nil
}

// Path counts what each hop's proxy reported: connections opened by the
// client's and the server's ztunnel, and bytes received by network-2's
// gateway (inner tunnels through it are pooled, so a new connection need
// not open a new gateway stream).
type Path struct {
	ClientZtunnel, Gateway, GatewayBytes, ServerZtunnel float64
}

// Path reads the connection counters of the client's ztunnel, network-2's
// gateway and echo's ztunnel.
func (d *Demo) Path(ctx context.Context) (Path, error) {
	var p Path
	var err error
	if p.ClientZtunnel, err = opened(ctx, node1IP); err != nil {
		return p, err
	}
	if p.Gateway, err = opened(ctx, gateway2IP); err != nil {
		return p, err
	}
	if p.GatewayBytes, err = metricSum(ctx, gateway2IP, "isthmus_tcp_received_bytes_total"); err != nil {
		return p, err
	}
	p.ServerZtunnel, err = opened(ctx, node2IP)
	return p, err
}

// RemoteClusters returns `isthmusctl remote-clusters` output.
func (d *Demo) RemoteClusters(ctx context.Context) (string, error) {
	out, err := exec.CommandContext(ctx, filepath.Join(d.cfg.BinDir, "isthmusctl"), "remote-clusters", "--pilot", "http://"+pilotIP+":8080").CombinedOutput()
	return string(out), err
}

// Instructions tells a person what to try while the demo runs.
func (d *Demo) Instructions() string {
	ctl := filepath.Join(d.cfg.BinDir, "isthmusctl")
	return fmt.Sprintf(`Try:
  %[1]s remote-clusters --pilot http://%[2]s:8080
  %[1]s registry services --pilot http://%[2]s:8080
  %[1]s registry workloads --pilot http://%[2]s:8080
  %[1]s proxy-status --pilot http://%[2]s:8080
  curl -s http://%[2]s:8080/debug/endpointz?host=%[3]s
  curl -s http://%[4]s:15020/metrics | grep isthmus_tcp     (network-2 gateway)
  kubeconfigs: %[5]s/cluster-1.kubeconfig, %[5]s/cluster-2.kubeconfig   logs: %[5]s/*.log
Ctrl-C stops everything.`, ctl, pilotIP, EchoHost, gateway2IP, d.work)
}

// Stop stops every process, the echo servers and the clusters.
func (d *Demo) Stop() {
	for i := len(d.procs) - 1; i >= 0; i-- {
		stopProc(d.procs[i])
	}
	d.procs = nil
	for _, ln := range []net.Listener{d.echoLn, d.localLn} {
		if ln != nil {
			_ = ln.Close()
		}
	}
	d.wg.Wait()
	if d.clusters != nil {
		_ = d.clusters.Stop()
	}
	if d.ownWork {
		_ = os.RemoveAll(d.work)
	}
}

func stopProc(p *proc) {
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.done
	}
}

func (d *Demo) say(format string, args ...any) {
	fmt.Fprintf(d.out, "==> "+format+"\n", args...)
}

func (d *Demo) logOf(name string) string { return filepath.Join(d.work, name+".log") }

func (d *Demo) spawn(ctx context.Context, name, bin string, args ...string) error {
	f, err := os.OpenFile(d.logOf(name), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command(filepath.Join(d.cfg.BinDir, bin), args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		return fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, log: f.Name(), done: make(chan struct{})}
	go func() { _ = cmd.Wait(); f.Close(); close(p.done) }()
	d.procs = append(d.procs, p)
	return nil
}

func (d *Demo) writeAdminKubeconfig(c *framework.Cluster) (string, error) {
	path := filepath.Join(d.work, c.Name+".kubeconfig")
	return path, c.WriteAdminKubeconfig(path)
}

func (d *Demo) workloads(ctx context.Context, c1, c2 *framework.Cluster) error {
	for _, c := range []*framework.Cluster{c1, c2} {
		if err := c.EnsureNamespace(ctx, "demo", nil); err != nil {
			return err
		}
	}
	if _, err := c2.CreateService(ctx, "demo", "echo", map[string]string{"app": "echo"}, framework.ServicePort{Name: "tcp-echo", Port: 80, TargetPort: 8080}); err != nil {
		return err
	}
	if _, err := c2.CreatePod(ctx, framework.PodOptions{Namespace: "demo", Name: "echo-0", Labels: map[string]string{"app": "echo"},
		ServiceAccount: "echo", Node: "node-2a", IP: mustAddr(echoIP), Ready: true}); err != nil {
		return err
	}
	if _, err := c1.CreatePod(ctx, framework.PodOptions{Namespace: "demo", Name: "sleep-0", Labels: map[string]string{"app": "sleep"},
		ServiceAccount: "sleep", Node: "node-1a", IP: mustAddr(sleepIP), Ready: true}); err != nil {
		return err
	}
	// One east-west gateway Service per network.
	for _, g := range []struct {
		c       *framework.Cluster
		network string
		ip      string
	}{{c1, "network-1", gateway1IP}, {c2, "network-2", gateway2IP}} {
		svc := &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: "eastwest-gateway", Namespace: ns, Labels: map[string]string{"topology.istio.io/network": g.network}},
			Spec: corev1.ServiceSpec{Type: corev1.ServiceTypeLoadBalancer, Selector: map[string]string{"app": "eastwest-gateway"},
				Ports: []corev1.ServicePort{{Name: "tls-hbone", Port: 15008, TargetPort: intstr.FromInt32(15008)}}},
		}
		created, err := g.c.Client.CoreV1().Services(ns).Create(ctx, svc, metav1.CreateOptions{})
		if err != nil {
			return err
		}
		created.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{{IP: g.ip}}
		if _, err := g.c.Client.CoreV1().Services(ns).UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
			return err
		}
	}
	return nil
}

// startEcho runs echo's "container" on its pod address.
func (d *Demo) startEcho() error {
	ln, err := d.serveEcho(echoIP+":8080", "echo-0 (cluster-2, network-2, "+echoIP+")")
	d.echoLn = ln
	return err
}

// serveEcho answers each line with who answered it.
func (d *Demo) serveEcho(addr, who string) (net.Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("echo listener: %w", err)
	}
	d.wg.Go(func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			d.wg.Go(func() {
				defer conn.Close()
				r := bufio.NewReader(conn)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					fmt.Fprintf(conn, "%s got %q from %s\n", who, strings.TrimSpace(line), conn.RemoteAddr())
				}
			})
		}
	})
	return ln, nil
}

// ztunnelCredentials makes the pod object of a ztunnel: a hostNetwork pod
// with the address ip on its node, so that its token is bound to a pod on
// its node (as the CA requires for impersonation) and the registry places
// its identity there (as xDS authorization requires). It also makes a token
// for it with the CA's audience and fetches the mesh root from the
// ConfigMap pilot publishes; it returns the two file paths.
func (d *Demo) ztunnelCredentials(ctx context.Context, c *framework.Cluster, name, node, sa string, ip netip.Addr) (token, roots string, err error) {
	if _, err := c.Client.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa, Namespace: ns}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return "", "", err
	}
	// The gateway Service selects its pods by app=<service account>: their
	// service account is the identity clients verify the gateway by.
	pod, err := c.CreatePod(ctx, framework.PodOptions{Namespace: ns, Name: name, ServiceAccount: sa, Node: node, IP: ip, HostNetwork: true, Ready: true,
		Labels: map[string]string{"app": sa}})
	if err != nil {
		return "", "", err
	}
	ttl := int64(24 * 3600)
	tr, err := c.Client.CoreV1().ServiceAccounts(ns).CreateToken(ctx, sa, &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{
		Audiences: []string{"istio-ca"}, ExpirationSeconds: &ttl,
		BoundObjectRef: &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
	}}, metav1.CreateOptions{})
	if err != nil {
		return "", "", err
	}
	token = filepath.Join(d.work, name+".token")
	if err := os.WriteFile(token, []byte(tr.Status.Token), 0o600); err != nil {
		return "", "", err
	}
	var root string
	deadline := time.Now().Add(time.Minute)
	for root == "" {
		cm, err := c.Client.CoreV1().ConfigMaps(ns).Get(ctx, "isthmus-ca-root-cert", metav1.GetOptions{})
		if err == nil {
			root = cm.Data["root-cert.pem"]
		}
		if root == "" && time.Now().After(deadline) {
			return "", "", fmt.Errorf("pilot did not publish the root certificate in %s", c.Name)
		}
		if root == "" {
			time.Sleep(100 * time.Millisecond)
		}
	}
	roots = filepath.Join(d.work, name+".root-cert.pem")
	return token, roots, os.WriteFile(roots, []byte(root), 0o644)
}

func waitHTTP(ctx context.Context, url string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	client := &http.Client{Timeout: 2 * time.Second}
	var last error
	for time.Now().Before(deadline) {
		resp, err := client.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			err = errors.New(resp.Status)
		}
		last = err
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	return last
}

// opened sums isthmus_tcp_connections_opened_total on the proxy at ip.
func opened(ctx context.Context, ip string) (float64, error) {
	return metricSum(ctx, ip, "isthmus_tcp_connections_opened_total")
}

// metricSum sums a metric's series on the proxy at ip.
func metricSum(ctx context.Context, ip, name string) (float64, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+ip+":15020/metrics", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	var sum float64
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, name+"{") || strings.HasPrefix(line, name+" ") {
			f := strings.Fields(line)
			v, err := strconv.ParseFloat(f[len(f)-1], 64)
			if err == nil {
				sum += v
			}
		}
	}
	return sum, sc.Err()
}
