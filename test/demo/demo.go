//go:build linux

// Package demo runs a whole federation on one machine: two real clusters
// (kube-apiserver + etcd from test/framework) on two networks, pilot, a
// ztunnel per node and an east-west gateway per network, with an echo
// service that runs only in cluster-2 and a sleep client in cluster-1. It
// is what `make demo` runs, and the end-to-end tests run the same topology.
//
// By default the networks are real: every network is a set of Linux
// network namespaces (a router, a node, the gateway), joined by a "wan"
// namespace whose nftables filter passes only traffic to and from the
// east-west gateways' addresses. Every pod is a namespace of its own on its
// node's bridge, enrolled by the node's CNI agent through the real plugin
// binary (the demo plays the container runtime); the ztunnels run in
// namespaces of their own and serve the pods inside the pods' namespaces;
// sleep resolves the service name over DNS and connects with a plain
// socket. Pilot and the API servers stay on the host's loopback, which
// processes in namespaces reach through forwarders the demo runs. This
// needs root, or a user namespace of one's own (cmd isthmus-demo re-executes
// itself into one, see Isolate).
//
// Config.Loopback runs the older, unprivileged topology instead: every pod,
// node proxy and gateway on its own loopback address of the host, networks
// separated by policy only, and a client that speaks SOCKS5 to its node's
// ztunnel.
package demo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"time"

	"github.com/isthmus-mesh/isthmus/test/framework"
)

// Config configures a demo run.
type Config struct {
	// BinDir holds the pilot, ztunnel, isthmusctl and isthmus-cni binaries,
	// and isthmus-demo (its hidden netns-exec command starts processes in
	// network namespaces).
	BinDir string
	// AssetsDir holds kube-apiserver and etcd (default $KUBEBUILDER_ASSETS).
	AssetsDir string
	// WorkDir receives kubeconfigs and process logs (default: the run's
	// temporary folder, removed at the end).
	WorkDir string
	// Out receives the demo's narration (default os.Stdout).
	Out io.Writer
	// Loopback runs every pod and proxy on a loopback address of the
	// host, with a SOCKS5 client: no namespaces, no privilege.
	Loopback bool
	// Expose, when set, serves pilot and the API servers on listeners made
	// elsewhere (the host's namespace, when the demo runs in a user
	// namespace of its own).
	Expose *Exposed
	// AgentArgs, when set, rewrites each CNI agent's arguments before it
	// starts: the version-skew test runs an agent of the previous release
	// with the flags that release knew.
	AgentArgs func(args []string) []string
}

// Exposed are listeners, opened in another network namespace, that the demo
// forwards to pilot's debug (8080) and monitoring (15014) ports and to the
// clusters' API servers; <WorkDir>/<cluster>.kubeconfig then names the
// exposed API server.
type Exposed struct {
	PilotDebug, PilotMonitoring net.Listener
	APIServers                  map[string]net.Listener
}

// dataplane is what differs between the isolated demo and the loopback one.
type dataplane interface {
	// setUp builds the networks; it runs before anything else, so that a
	// missing privilege fails fast.
	setUp(ctx context.Context) error
	// startNode starts the node's agent (isolated) and ztunnel.
	startNode(ctx context.Context, s *site) error
	// startGateway starts the network's east-west gateway.
	startGateway(ctx context.Context, s *site) error
	// addPod makes the pod's sandbox, enrols it, writes its Pod object
	// (running, ready, with its address) and starts its application.
	addPod(ctx context.Context, c *framework.Cluster, p podSpec) error
	// dialEcho connects sleep to echo.demo:80.
	dialEcho(ctx context.Context) (net.Conn, error)
	// proxyHTTP returns a client and base URL (no trailing slash) for a
	// proxy's port: a node's ztunnel by node name, a gateway by network.
	proxyHTTP(name string, port int) (*http.Client, string)
	// close undoes setUp and everything added since (processes are
	// already stopped).
	close() error
}

// Demo is a running federation.
type Demo struct {
	cfg        Config
	out        io.Writer
	plan       *plan
	dp         dataplane
	run        string   // sockets, tokens, mounts: swept if the runner dies
	runLock    *os.File // flocked while the run lives
	work       string
	clusters   *framework.ClusterSet
	procs      procSet
	fwd        forwarders
	apps       apps
	kc         map[string]string // process-facing admin kubeconfigs by cluster
	clusterLog *os.File          // the API servers' and etcd's output
}

// Start builds the federation and returns once the request path is ready.
// Call Stop to tear everything down.
func Start(ctx context.Context, cfg Config) (d *Demo, err error) {
	if cfg.Out == nil {
		cfg.Out = os.Stdout
	}
	d = &Demo{cfg: cfg, out: cfg.Out, kc: map[string]string{}}
	defer func() {
		if err != nil {
			d.Stop()
			d = nil
		}
	}()
	if d.run, d.runLock, err = newRunDir(); err != nil {
		return d, err
	}
	if d.work = cfg.WorkDir; d.work == "" {
		d.work = d.run
	}
	if cfg.Loopback {
		d.plan = loopbackPlan()
		d.dp = &loopback{d: d}
	} else {
		d.plan = isolatedPlan()
		d.dp = newIsolated(d)
	}
	if err := d.dp.setUp(ctx); err != nil {
		return d, err
	}
	if cfg.WorkDir != "" {
		if err := d.writeRunInfo(); err != nil {
			return d, err
		}
	}
	if err := d.controlPlane(ctx); err != nil {
		return d, err
	}
	if err := d.objects(ctx); err != nil {
		return d, err
	}
	if err := d.startProxies(ctx); err != nil {
		return d, err
	}
	d.say("creating workloads: echo (cluster-2 only, %s) and sleep (cluster-1, %s)", d.plan.echo.ip, d.plan.sleep.ip)
	if err := d.dp.addPod(ctx, d.Cluster("cluster-2"), d.plan.echo); err != nil {
		return d, err
	}
	if err := d.dp.addPod(ctx, d.Cluster("cluster-1"), d.plan.sleep); err != nil {
		return d, err
	}
	if cfg.WorkDir != "" {
		return d, d.writeRunInfo() // now with the pods' namespaces
	}
	return d, nil
}

// controlPlane starts the clusters, writes their kubeconfigs, starts pilot
// and registers cluster-2 as a remote cluster.
func (d *Demo) controlPlane(ctx context.Context) error {
	d.say("starting two real clusters (kube-apiserver + etcd each; a few seconds)")
	start := time.Now()
	clog, err := os.OpenFile(d.logOf("clusters"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	d.clusterLog = clog
	if d.clusters, err = framework.Start(framework.Options{Names: []string{"cluster-1", "cluster-2"}, AssetsDir: d.cfg.AssetsDir, Output: clog}); err != nil {
		return fmt.Errorf("%w (log: %s)", err, d.logOf("clusters"))
	}
	d.say("clusters up in %v", time.Since(start).Round(100*time.Millisecond))
	if err := d.kubeconfigs(); err != nil {
		return err
	}
	if e := d.cfg.Expose; e != nil {
		for _, x := range []struct {
			ln   net.Listener
			port int
		}{{e.PilotDebug, 8080}, {e.PilotMonitoring, 15014}} {
			if x.ln != nil {
				d.fwd.start(x.ln, fmt.Sprintf("%s:%d", pilotIP, x.port))
			}
		}
	}
	for _, c := range d.clusters.Clusters {
		if err := c.EnsureNamespace(ctx, ns, nil); err != nil {
			return err
		}
	}
	d.say("starting pilot on %s (config cluster: cluster-1, network-1)", pilotIP)
	if err := d.StartPilot(ctx); err != nil {
		return err
	}
	d.say("registering cluster-2 (network-2) with isthmusctl create-remote-secret --apply")
	// No token controller runs in these clusters: TokenRequest at once.
	if out, err := exec.CommandContext(ctx, d.bin("isthmusctl"), "create-remote-secret", "--kubeconfig", d.kc["cluster-2"],
		"--name", "cluster-2", "--network", "network-2", "--apply", "--primary-kubeconfig", d.kc["cluster-1"], "--token-wait", "200ms").CombinedOutput(); err != nil {
		return fmt.Errorf("create-remote-secret: %w: %s", err, out)
	}
	return nil
}

// startProxies starts every site's node proxy and gateway in parallel and
// waits until all are ready.
func (d *Demo) startProxies(ctx context.Context) error {
	what := "a ztunnel per node and an east-west gateway per network"
	if !d.cfg.Loopback {
		what = "a CNI agent and a ztunnel (in a namespace of its own) per node, an east-west gateway per network"
	}
	d.say("starting %s", what)
	errs := make([]error, 4)
	var wg sync.WaitGroup
	for i, s := range d.plan.sites {
		wg.Go(func() { errs[2*i] = d.dp.startNode(ctx, s) })
		wg.Go(func() { errs[2*i+1] = d.dp.startGateway(ctx, s) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return err
	}
	for _, s := range d.plan.sites {
		for _, name := range []string{s.node, s.network} {
			client, base := d.dp.proxyHTTP(name, 15021)
			if err := waitHTTP(ctx, client, base+"/healthz/ready", time.Minute); err != nil {
				return fmt.Errorf("ztunnel %s not ready: %w (log: %s)", name, err, d.logOf(proxyName(name)))
			}
		}
	}
	return nil
}

// StartPilot starts the pilot process (again, after StopPilot) and waits
// until it is ready.
func (d *Demo) StartPilot(ctx context.Context) error {
	if err := d.procs.spawn(d, "pilot", nil, "pilot", "--kubeconfig", d.kc["cluster-1"], "--cluster-id", "cluster-1", "--network", "network-1",
		"--xds-addr", pilotIP+":15012", "--monitoring-addr", pilotIP+":15014", "--debug-addr", pilotIP+":8080",
		"--serving-san", pilotIP+","+pilotSAN, "--sync-timeout", "30s", "--no-leader-election"); err != nil {
		return err
	}
	if err := waitHTTP(ctx, http.DefaultClient, PilotURL(15014)+"/readyz", time.Minute); err != nil {
		return fmt.Errorf("pilot not ready: %w (log: %s)", err, d.logOf("pilot"))
	}
	return nil
}

// StopPilot stops the pilot process (SIGTERM) and waits for it to exit.
func (d *Demo) StopPilot() { d.procs.stop("pilot") }

// Cluster returns the demo's cluster of that name ("cluster-1",
// "cluster-2"), for tests that change objects in it.
func (d *Demo) Cluster(name string) *framework.Cluster { return d.clusters.Cluster(name) }

// PilotURL returns the base URL of pilot's port (8080 debug, 15014
// monitoring).
func PilotURL(port int) string { return fmt.Sprintf("http://%s:%d", pilotIP, port) }

// EchoWho is how echo-0 introduces itself in its replies:
// "echo-0 (cluster-2, network-2, <address>)".
func (d *Demo) EchoWho() string { return d.plan.echo.who() }

// LocalEchoWho is how AddLocalEcho's pod introduces itself.
func (d *Demo) LocalEchoWho() string { return d.plan.localEcho.who() }

// AddLocalEcho runs a second echo instance in cluster-1 (network-1), on
// node-1a, behind the same federated service.
func (d *Demo) AddLocalEcho(ctx context.Context) error {
	c1 := d.Cluster("cluster-1")
	if err := d.echoService(ctx, c1); err != nil {
		return err
	}
	return d.dp.addPod(ctx, c1, d.plan.localEcho)
}

// SetLocalEchoReady flips the Ready condition of cluster-1's echo pod.
func (d *Demo) SetLocalEchoReady(ctx context.Context, ready bool) error {
	return d.setReady(ctx, d.Cluster("cluster-1"), d.plan.localEcho, ready)
}

// Request sends msg from the sleep pod (cluster-1) to echo.demo:80 and
// returns the reply.
func (d *Demo) Request(ctx context.Context, msg string) (string, error) {
	conn, err := d.Dial(ctx)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	return Exchange(conn, msg)
}

// Dial opens a connection from the sleep pod to echo.demo:80: isolated, a
// plain socket in sleep's namespace to the address DNS gave for the name;
// loopback, through its node's ztunnel's SOCKS5 port.
func (d *Demo) Dial(ctx context.Context) (net.Conn, error) { return d.dp.dialEcho(ctx) }

// RemoteClusters returns `isthmusctl remote-clusters` output.
func (d *Demo) RemoteClusters(ctx context.Context) (string, error) {
	out, err := exec.CommandContext(ctx, d.bin("isthmusctl"), "remote-clusters", "--pilot", PilotURL(8080)).CombinedOutput()
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
  kubeconfigs: %[4]s/cluster-1.kubeconfig, %[4]s/cluster-2.kubeconfig   logs: %[4]s/*.log
Ctrl-C stops everything.`, ctl, pilotIP, EchoHost, d.work)
}

// Stop stops every process, forwarder and application, removes the
// namespaces and mounts, and stops the clusters. It is idempotent.
func (d *Demo) Stop() {
	if d.dp != nil {
		if iso, ok := d.dp.(*isolated); ok {
			iso.releasePods() // CNI DEL while the agents still run
		}
	}
	d.procs.stopAll()
	d.fwd.closeAll()
	d.apps.closeAll()
	if d.dp != nil {
		if err := d.dp.close(); err != nil {
			fmt.Fprintln(d.out, "==> cleanup:", err)
		}
		d.dp = nil
	}
	if d.clusters != nil {
		_ = d.clusters.Stop()
	}
	if d.clusterLog != nil {
		d.clusterLog.Close()
	}
	if d.run != "" {
		if err := removeRunDir(d.run, d.runLock); err != nil {
			fmt.Fprintln(d.out, "==> cleanup:", err)
		}
		d.run = ""
	}
}

func (d *Demo) say(format string, args ...any) {
	fmt.Fprintf(d.out, "==> "+format+"\n", args...)
}

func (d *Demo) bin(name string) string { return filepath.Join(d.cfg.BinDir, name) }

func (d *Demo) logOf(name string) string { return filepath.Join(d.work, name+".log") }

// proxyName is the process name of a node's ztunnel or a network's gateway.
func proxyName(name string) string {
	if len(name) > 8 && name[:8] == "network-" {
		return "gateway-" + name
	}
	return "ztunnel-" + name
}

func waitHTTP(ctx context.Context, client *http.Client, url string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var last error
	for time.Now().Before(deadline) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		resp, err := client.Do(req.WithContext(rctx))
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				cancel()
				return nil
			}
			err = errors.New(resp.Status)
		}
		cancel()
		last = err
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	return last
}
