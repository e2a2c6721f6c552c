package agent

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"path"
	"path/filepath"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/kubernetes"

	"github.com/isthmus-mesh/isthmus/cni/istiozds"
	"github.com/isthmus-mesh/isthmus/cni/plugin"
	"github.com/isthmus-mesh/isthmus/cni/selection"
	"github.com/isthmus-mesh/isthmus/cni/zds"
	"github.com/isthmus-mesh/isthmus/internal/defaults"
)

// Disabled as an address or directory turns that part off.
const Disabled = defaults.Disabled

// Config is one node agent. Zero fields take the defaults of DefaultConfig;
// withDefaults is the only place defaults are decided.
type Config struct {
	// NodeName is the node whose pods the agent enrols (required).
	NodeName string
	// SystemNamespace is the control plane's namespace, excluded from
	// enrolment by default.
	SystemNamespace string
	// ExcludedNamespaces are never enrolled; nil means kube-system and
	// SystemNamespace.
	ExcludedNamespaces []string

	// CNIBinDir and CNIConfDir are the node's CNI directories as mounted
	// in the agent's container. The plugin binary is installed into
	// CNIBinDir, its entry into the network configuration the runtime
	// uses: the first *.conf, *.conflist or *.json of CNIConfDir by name (a
	// single-plugin one is turned into a conflist).
	CNIBinDir  string
	CNIConfDir string
	// PluginSource is the binary installed as the plugin; default the
	// agent's own executable (one binary plays both roles).
	PluginSource string
	// UninstallOnExit releases every enrolled pod (removes its capture
	// rules) and removes the plugin and its conflist entry when Run
	// returns: the node leaves the mesh. Off by default: during a rolling
	// update the pods stay captured and the entry must stay, or pods
	// started in the gap would not be enrolled.
	UninstallOnExit bool
	// InstallCheckInterval is how often the installation is checked
	// besides file-change notifications.
	InstallCheckInterval time.Duration

	// PluginSocket is where the agent serves the plugin, a path the same
	// on the node and in the agent (the plugin runs on the node).
	PluginSocket string
	// ZtunnelSocket is where the agent serves ztunnel (cni/zds), mode
	// 0600; default /var/run/isthmus/cni/ztunnel.sock, or Istio's
	// /var/run/ztunnel/ztunnel.sock with ZtunnelProtocol "istio".
	ZtunnelSocket string
	// ZtunnelProtocol is what ZtunnelSocket speaks: "isthmus" (the
	// default, cni/zds's JSON protocol) or "istio" (Istio's ZDS protobuf,
	// cni/istiozds, for Istio's ztunnel). The peer checks are the same.
	// Istio's hello carries no cgroup id: the agent takes the cgroup of
	// the connecting process from the kernel through ProcDir (cni/zds
	// Config.PeerProcDir) and refuses a ztunnel whose cgroup it cannot
	// find, unless ZtunnelMarkOnly.
	ZtunnelProtocol string
	// ZtunnelMarkOnly, with ZtunnelProtocol "istio", accepts a ztunnel
	// whose cgroup cannot be found (no cgroup v2, a ztunnel in the node's
	// cgroup namespace, a kernel before 6.5) and exempts its sockets by
	// the mark alone, which any pod process with CAP_NET_RAW can set.
	ZtunnelMarkOnly bool
	// ZtunnelUIDs may connect to ZtunnelSocket besides the agent's own uid
	// (a ztunnel running as another user); every other peer is refused.
	ZtunnelUIDs []uint32
	// PluginTimeout is written into the conflist entry: the plugin's bound
	// on its exchange with the agent.
	PluginTimeout time.Duration
	// AckTimeout bounds ztunnel's ack of each message.
	AckTimeout time.Duration

	// NetnsDirs are searched for the network namespaces of pods that were
	// running before the agent started (container runtimes bind-mount them
	// there); Disabled entries are skipped.
	NetnsDirs []string
	// ProcDir is the node's /proc as mounted in the agent: /proc/<pid>/ns/net
	// finds namespaces that no runtime bind-mounted; Disabled skips it.
	ProcDir string
	// NodeCgroupNS is the node's initial cgroup namespace file, from which
	// the pods' rules are written so that their cgroup levels count from
	// the node's root, not the agent container's (cni/redirect
	// Options.CgroupNS); default <ProcDir>/1/ns/cgroup. Disabled, or a file
	// that cannot be opened (logged): the agent's own, where a ztunnel
	// whose cgroup is shallower than the agent's is not exempt.
	NodeCgroupNS string
	// StateDir holds one record per pod sandbox the runtime reported in
	// a CNI ADD (pod, sandbox ID, netns path and identity), so that after
	// a restart the agent finds each pod's namespace from the runtime's
	// own word; a directory of the node (hostPath), created 0700, its
	// files 0600. Disabled keeps no records: pods that ran before the
	// agent are then found by their cgroup only.
	StateDir string
	// PodCgroupRoots are the cgroup paths, as ProcDir/<pid>/cgroup shows
	// them to the agent, under which the kubelet creates pod cgroups
	// (<root>/[<qos>/]pod<uid> with the cgroupfs driver,
	// <root>/[kubepods-<qos>.slice/]kubepods[-<qos>]-pod<uid>.slice with
	// systemd). A pod that ran before the agent and has no record is
	// found through the processes in its cgroup; nil means /kubepods and
	// /kubepods.slice.
	PodCgroupRoots []string
	// NodeNetNS is the node's network namespace file, where the probe SNAT
	// rules go; empty means the agent's own (it runs with hostNetwork).
	NodeNetNS string
	// NodeAddresses are never captured on the way out of a pod (a pod's
	// traffic to its node is left alone); empty means the Node object's
	// InternalIP and ExternalIP addresses.
	NodeAddresses []netip.Addr
	// RedirectDNS sends enrolled pods' DNS to ztunnel's 15053.
	RedirectDNS bool

	// MonitoringAddr serves /metrics, /healthz and /readyz; Disabled turns
	// it off.
	MonitoringAddr string
	// ShutdownTimeout bounds the monitoring server's graceful stop.
	ShutdownTimeout time.Duration
}

// ZtunnelProtocol values.
const (
	ZtunnelProtocolIsthmus = "isthmus"
	ZtunnelProtocolIstio   = "istio"
)

// zds is the configuration of the ztunnel server.
func (c Config) zds() zds.Config {
	// Snapshots wait for the agent's first reconcile of the node's pods
	// (watch): a ztunnel that reconnects to a restarted agent keeps them.
	zc := zds.Config{SocketPath: c.ZtunnelSocket, AckTimeout: c.AckTimeout, AllowedUIDs: c.ZtunnelUIDs, WaitForSync: true}
	if c.ZtunnelProtocol == ZtunnelProtocolIstio {
		zc.Codec, zc.MarkOnlyFallback = istiozds.Codec{}, c.ZtunnelMarkOnly
		if c.ProcDir != Disabled {
			zc.PeerProcDir = c.ProcDir
		}
	}
	return zc
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{
		SystemNamespace:      defaults.Namespace,
		CNIBinDir:            "/host/opt/cni/bin",
		CNIConfDir:           "/host/etc/cni/net.d",
		InstallCheckInterval: time.Minute,
		PluginSocket:         "/var/run/isthmus/cni/plugin.sock",
		ZtunnelSocket:        "/var/run/isthmus/cni/ztunnel.sock",
		PluginTimeout:        plugin.DefaultTimeout,
		AckTimeout:           3 * time.Second,
		NetnsDirs:            []string{"/var/run/netns"},
		ProcDir:              "/host/proc",
		StateDir:             "/var/run/isthmus/cni-state",
		PodCgroupRoots:       []string{"/kubepods", "/kubepods.slice"},
		MonitoringAddr:       ":" + strconv.Itoa(defaults.MonitoringPort),
		ShutdownTimeout:      5 * time.Second,
	}
}

func (c Config) withDefaults() Config {
	d := DefaultConfig()
	or := func(v *string, def string) {
		if *v == "" {
			*v = def
		}
	}
	orDur := func(v *time.Duration, def time.Duration) {
		if *v <= 0 {
			*v = def
		}
	}
	or(&c.SystemNamespace, d.SystemNamespace)
	if c.ExcludedNamespaces == nil {
		c.ExcludedNamespaces = []string{"kube-system", c.SystemNamespace}
	}
	or(&c.CNIBinDir, d.CNIBinDir)
	or(&c.CNIConfDir, d.CNIConfDir)
	orDur(&c.InstallCheckInterval, d.InstallCheckInterval)
	or(&c.PluginSocket, d.PluginSocket)
	or(&c.ZtunnelProtocol, ZtunnelProtocolIsthmus)
	if c.ZtunnelProtocol == ZtunnelProtocolIstio {
		or(&c.ZtunnelSocket, istiozds.SocketPath)
	}
	or(&c.ZtunnelSocket, d.ZtunnelSocket)
	orDur(&c.PluginTimeout, d.PluginTimeout)
	orDur(&c.AckTimeout, d.AckTimeout)
	if c.NetnsDirs == nil {
		c.NetnsDirs = d.NetnsDirs
	}
	or(&c.ProcDir, d.ProcDir)
	if c.NodeCgroupNS == "" && c.ProcDir != Disabled {
		c.NodeCgroupNS = filepath.Join(c.ProcDir, "1", "ns", "cgroup")
	}
	or(&c.StateDir, d.StateDir)
	if c.PodCgroupRoots == nil {
		c.PodCgroupRoots = d.PodCgroupRoots
	}
	or(&c.MonitoringAddr, d.MonitoringAddr)
	orDur(&c.ShutdownTimeout, d.ShutdownTimeout)
	return c
}

func (c Config) validate() error {
	var errs []error
	if c.NodeName == "" {
		errs = append(errs, errors.New("NodeName is required"))
	}
	if c.PluginSocket == c.ZtunnelSocket {
		errs = append(errs, errors.New("PluginSocket and ZtunnelSocket must differ"))
	}
	if c.ZtunnelProtocol != ZtunnelProtocolIsthmus && c.ZtunnelProtocol != ZtunnelProtocolIstio {
		errs = append(errs, fmt.Errorf("ZtunnelProtocol: %q is neither %q nor %q", c.ZtunnelProtocol, ZtunnelProtocolIsthmus, ZtunnelProtocolIstio))
	}
	if c.ZtunnelProtocol == ZtunnelProtocolIstio && c.ProcDir == Disabled && !c.ZtunnelMarkOnly {
		errs = append(errs, errors.New("ZtunnelProtocol istio needs ProcDir to find the ztunnel's cgroup (or ZtunnelMarkOnly)"))
	}
	if c.AckTimeout >= c.PluginTimeout {
		errs = append(errs, errors.New("AckTimeout must be shorter than PluginTimeout, or a ztunnel ack outlives the plugin's wait"))
	}
	for _, r := range c.PodCgroupRoots {
		if !path.IsAbs(r) || path.Clean(r) != r || r == "/" {
			errs = append(errs, fmt.Errorf("PodCgroupRoots: %q is not a clean absolute cgroup path below /", r))
		}
	}
	if c.StateDir != Disabled && !filepath.IsAbs(c.StateDir) {
		errs = append(errs, fmt.Errorf("StateDir: %q is not an absolute path", c.StateDir))
	}
	return errors.Join(errs...)
}

func (c Config) selection() selection.Config {
	return selection.Config{ExcludedNamespaces: c.ExcludedNamespaces}
}

// Deps are the agent's collaborators.
type Deps struct {
	// Client reads pods, namespaces and the node, and writes Events on
	// pods whose sandbox cannot be trusted (required).
	Client kubernetes.Interface
	// Log defaults to a discarding logger.
	Log *slog.Logger
	// Registry receives the metrics and serves /metrics; a fresh registry
	// by default.
	Registry *prometheus.Registry
}
