//go:build linux

// Package agent is the Isthmus CNI node agent, one per node (a hostNetwork
// DaemonSet). It
//
//   - installs the chained plugin (cni/plugin) into the node's CNI bin
//     directory and its entry at the end of the node's conflist (turning
//     a single-plugin *.conf into one), and
//     repairs both when they change or disappear;
//   - serves the plugin's ADD, DEL and CHECK over a unix socket: an ADD of a
//     pod the selection (cni/selection) enrols gets the redirect rules
//     (cni/redirect) in its namespace before the ADD returns, and fails if
//     that fails or a connected ztunnel refuses the pod;
//   - records every sandbox a CNI ADD names (pod, sandbox ID, netns path
//     and identity) in its state directory, and forgets it on DEL;
//   - watches the node's pods and all namespaces, so that label changes
//     enrol or release running pods, and pods that ran before the agent
//     started are enrolled: each through its own sandbox, named by the
//     runtime's record or by the kubelet's cgroup of its processes, never
//     guessed from an address (discover.go); a pod whose sandbox is not
//     found or not trusted gets an Event and is not enrolled;
//   - keeps the node's probe SNAT set equal to the enrolled addresses;
//   - tells ztunnel which pods are enrolled, each with its namespace
//     (cni/zds).
//
// When the agent stops, enrolled pods keep their rules: while no agent or
// no ztunnel runs, their captured traffic fails closed.
package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sync/errgroup"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"

	"github.com/isthmus-mesh/isthmus/cni/zds"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
)

// Agent is one node's agent. Create it with New and run it with Run, once.
type Agent struct {
	cfg  Config
	deps Deps
	log  *slog.Logger
	m    *metrics
	zds  *zds.Server
	inst *installer

	nodeNS   *os.File // nil: the agent's own namespace
	cgroupNS *os.File // the node's cgroup namespace; nil: the agent's own
	excluded []netip.Prefix

	discMu sync.Mutex
	disc   *discoverer
	store  *sandboxStore // nil: StateDir disabled

	recorder record.EventRecorder // set in Run
	repMu    sync.Mutex
	reported map[string]*reportState // by pod UID

	mu      sync.Mutex
	pods    map[string]*enrolment // by pod UID
	capture zds.Capture           // what the pods' rules exempt (capture.go)
	toldOf  bool                  // capture came from zds (else: not since the agent started)

	podInf, nsInf cache.SharedIndexInformer
	queue         workqueue.TypedRateLimitingInterface[string]
	synced        atomic.Bool
}

// New checks the configuration and prepares the agent.
func New(cfg Config, deps Deps) (*Agent, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	if deps.Client == nil {
		return nil, errors.New("agent: Deps.Client is required")
	}
	if deps.Log == nil {
		deps.Log = slog.New(slog.DiscardHandler)
	}
	if deps.Registry == nil {
		deps.Registry = prometheus.NewRegistry()
	}
	m, err := newMetrics(deps.Registry)
	if err != nil {
		return nil, fmt.Errorf("agent: metrics: %w", err)
	}
	a := &Agent{cfg: cfg, deps: deps, log: deps.Log, m: m, pods: map[string]*enrolment{}, reported: map[string]*reportState{}}
	a.zds, err = zds.New(cfg.zds(), zds.Deps{
		Log:           deps.Log.With("component", "zds"),
		OnFailure:     func(r zds.FailureReason) { a.fail(string(r)) },
		OnConnections: func(n int) { m.ztunnels.Set(float64(n)) },
		OnRefused:     func(r zds.RefusalReason) { m.ztunnelRefused.WithLabelValues(string(r)).Inc() },
		OnCapture:     a.setCapture,
	})
	if err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	a.inst, err = newInstaller(cfg, deps.Log.With("component", "install"),
		func(what string) { m.installations.WithLabelValues(what).Inc() })
	if err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	a.newInformers()
	return a, nil
}

// Ready reports whether the plugin is installed and the pods that ran
// before the agent started have been reconciled.
func (a *Agent) Ready() bool { return a.synced.Load() && a.inst.Installed() }

// Run serves until ctx ends. Enrolled pods keep their rules when it
// returns (a restart or an upgrade leaves the data path alone), unless
// Config.UninstallOnExit is set: then every enrolled pod is released (its
// rules removed, ztunnel told) before the plugin is removed, so that
// after an uninstall pods keep their plain networking instead of being
// captured to a ztunnel that goes next.
func (a *Agent) Run(ctx context.Context) error {
	if err := a.openNamespaces(); err != nil {
		return err
	}
	defer a.closeNamespaces()
	defer a.startEvents(ctx)()
	a.excluded = a.nodeAddresses(ctx)
	for _, p := range []string{a.cfg.PluginSocket, a.cfg.ZtunnelSocket} {
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			return fmt.Errorf("agent: socket directory: %w", err)
		}
	}
	pluginLn, err := listenPlugin(a.cfg.PluginSocket)
	if err != nil {
		return err
	}
	var monLn net.Listener
	if a.cfg.MonitoringAddr != Disabled {
		if monLn, err = net.Listen("tcp", a.cfg.MonitoringAddr); err != nil {
			pluginLn.Close()
			return fmt.Errorf("agent: monitoring listener: %w", err)
		}
	}
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return a.zds.Run(gctx) })
	g.Go(func() error { return a.servePlugin(gctx, pluginLn) })
	g.Go(func() error { return a.inst.run(gctx) })
	g.Go(func() error { return a.watch(gctx) })
	if monLn != nil {
		g.Go(func() error { return a.serveMonitoring(gctx, monLn) })
	}
	err = g.Wait()
	if a.cfg.UninstallOnExit {
		a.releaseWhere(context.WithoutCancel(ctx), func(*enrolment) bool { return true }, "uninstall")
		err = errors.Join(err, a.inst.uninstall())
	}
	a.closeAll()
	return err
}

func (a *Agent) openNamespaces() error {
	own, err := netns.Current()
	if err != nil {
		return fmt.Errorf("agent: own network namespace: %w", err)
	}
	defer own.Close()
	if a.cfg.NodeNetNS != "" {
		if a.nodeNS, err = netns.Open(a.cfg.NodeNetNS); err != nil {
			return fmt.Errorf("agent: node network namespace: %w", err)
		}
	}
	if a.cfg.StateDir != Disabled {
		if a.store, err = openSandboxStore(a.cfg.StateDir, a.cfg.ProcDir, a.log.With("component", "sandboxes")); err != nil {
			if a.nodeNS != nil {
				a.nodeNS.Close()
			}
			return err
		}
	}
	a.disc = newDiscoverer(a.cfg, a.store, own, a.nodeNS)
	a.cgroupNS = a.openCgroupNS()
	return nil
}

func (a *Agent) closeNamespaces() {
	if a.nodeNS != nil {
		a.nodeNS.Close()
	}
	if a.cgroupNS != nil {
		a.cgroupNS.Close()
	}
}

// nodeAddresses returns the addresses pods reach their node at, exempt
// from capture: Config.NodeAddresses, else the Node's InternalIP and
// ExternalIP.
func (a *Agent) nodeAddresses(ctx context.Context) []netip.Prefix {
	addrs := a.cfg.NodeAddresses
	if len(addrs) == 0 {
		node, err := a.deps.Client.CoreV1().Nodes().Get(ctx, a.cfg.NodeName, metav1.GetOptions{})
		if err != nil {
			a.log.Warn("node addresses unknown: a pod's traffic to its node is captured like any other", "error", err)
		} else {
			for _, na := range node.Status.Addresses {
				if na.Type != corev1.NodeInternalIP && na.Type != corev1.NodeExternalIP {
					continue
				}
				if ip, err := netip.ParseAddr(na.Address); err == nil {
					addrs = append(addrs, ip.Unmap())
				}
			}
		}
	}
	out := make([]netip.Prefix, 0, len(addrs))
	for _, ip := range addrs {
		out = append(out, netip.PrefixFrom(ip, ip.BitLen()))
	}
	return out
}

func (a *Agent) serveMonitoring(ctx context.Context, ln net.Listener) error {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(a.deps.Registry, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !a.Ready() {
			http.Error(w, "not ready: plugin not installed or pods not reconciled yet", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok\n"))
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: a.cfg.ShutdownTimeout}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return fmt.Errorf("agent: monitoring: %w", err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), a.cfg.ShutdownTimeout)
	defer cancel()
	_ = srv.Shutdown(sctx)
	<-errc
	return nil
}
