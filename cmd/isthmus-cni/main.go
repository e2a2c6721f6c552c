//go:build linux

// Command isthmus-cni is one binary with two roles. Run by a container
// runtime (CNI_COMMAND set) it is the chained CNI plugin (cni/plugin): it
// reports the pod to the node agent and passes the previous result through.
// Run as `isthmus-cni agent` it is the node agent (cni/agent), a hostNetwork
// DaemonSet that installs this same binary as the plugin. It parses flags
// into an agent.Config, sets up slog, and runs the agent until SIGINT or
// SIGTERM.
package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/netip"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
	"k8s.io/client-go/kubernetes"

	"github.com/isthmus-mesh/isthmus/cni/agent"
	"github.com/isthmus-mesh/isthmus/cni/istiozds"
	"github.com/isthmus-mesh/isthmus/cni/plugin"
	"github.com/isthmus-mesh/isthmus/internal/cmdutil"
	"github.com/isthmus-mesh/isthmus/internal/version"
)

func main() {
	if os.Getenv("CNI_COMMAND") != "" {
		plugin.Main() // exits
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := newCommand(os.Stderr, runAgent).ExecuteContext(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "Error:", err)
		os.Exit(1)
	}
}

// runFunc runs a configured agent; tests replace it.
type runFunc func(ctx context.Context, cfg agent.Config, kubeconfig string, log *slog.Logger) error

func runAgent(ctx context.Context, cfg agent.Config, kubeconfig string, log *slog.Logger) error {
	cmdutil.RouteKlog(log)
	rc, err := cmdutil.RestConfig(kubeconfig, "")
	if err != nil {
		return err
	}
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return err
	}
	a, err := agent.New(cfg, agent.Deps{Client: client, Log: log})
	if err != nil {
		return err
	}
	return a.Run(ctx)
}

func newCommand(stderr io.Writer, run runFunc) *cobra.Command {
	root := &cobra.Command{
		Use:     "isthmus-cni",
		Short:   "Isthmus pod enrolment: the chained CNI plugin (when run with CNI_COMMAND) and its node agent",
		Args:    cobra.NoArgs,
		Version: version.String(),
	}
	root.SetVersionTemplate("isthmus-cni {{.Version}}\n")
	root.SetErr(stderr)
	root.AddCommand(newAgentCommand(stderr, run))
	return root
}

func newAgentCommand(stderr io.Writer, run runFunc) *cobra.Command {
	d := agent.DefaultConfig()
	cfg := agent.Config{}
	var (
		kubeconfig    string
		excluded      []string
		nodeAddresses []string
		ztunnelUIDs   []uint
		lc            = cmdutil.Log{Format: "json", Level: "info"}
	)
	cmd := &cobra.Command{
		Use:           "agent",
		Short:         "Run the node agent (a hostNetwork DaemonSet)",
		Args:          cobra.NoArgs,
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := lc.Logger(stderr)
			if err != nil {
				return err
			}
			if cmd.Flags().Changed("excluded-namespaces") {
				cfg.ExcludedNamespaces = append([]string{}, excluded...)
			}
			for _, s := range nodeAddresses {
				a, err := netip.ParseAddr(s)
				if err != nil {
					return fmt.Errorf("--node-addresses: %w", err)
				}
				cfg.NodeAddresses = append(cfg.NodeAddresses, a)
			}
			for _, u := range ztunnelUIDs {
				if u > math.MaxUint32 {
					return fmt.Errorf("--ztunnel-uids: %d is not a uid", u)
				}
				cfg.ZtunnelUIDs = append(cfg.ZtunnelUIDs, uint32(u))
			}
			return run(cmd.Context(), cfg, kubeconfig, log)
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.NodeName, "node", os.Getenv("NODE_NAME"), "Kubernetes node this agent runs on (default $NODE_NAME)")
	f.StringVar(&cfg.SystemNamespace, "system-namespace", cmdutil.EnvOr("POD_NAMESPACE", d.SystemNamespace), "the control plane's namespace, excluded by default (default $POD_NAMESPACE)")
	f.StringSliceVar(&excluded, "excluded-namespaces", nil, "namespaces never enrolled (default kube-system and --system-namespace)")
	f.StringVar(&cfg.CNIBinDir, "cni-bin-dir", d.CNIBinDir, "the node's CNI bin directory as mounted here")
	f.StringVar(&cfg.CNIConfDir, "cni-conf-dir", d.CNIConfDir, "the node's CNI configuration directory as mounted here")
	f.StringVar(&cfg.PluginSource, "plugin-source", "", "binary installed as the plugin (default: this executable)")
	f.BoolVar(&cfg.UninstallOnExit, "uninstall-on-exit", false, "remove the plugin and its conflist entry on exit")
	f.DurationVar(&cfg.InstallCheckInterval, "install-check-interval", d.InstallCheckInterval, "how often the installation is checked besides file notifications")
	f.StringVar(&cfg.PluginSocket, "plugin-socket", d.PluginSocket, "the plugin's socket (same path on the node and here)")
	f.StringVar(&cfg.ZtunnelSocket, "ztunnel-socket", "", "ztunnel's socket (default "+d.ZtunnelSocket+", or Istio's "+istiozds.SocketPath+" with --ztunnel-protocol=istio)")
	f.StringVar(&cfg.ZtunnelProtocol, "ztunnel-protocol", agent.ZtunnelProtocolIsthmus, `what --ztunnel-socket speaks: "isthmus" (the Isthmus ztunnel) or "istio" (Istio's ZDS, for Istio's ztunnel; its cgroup is found through --proc-dir)`)
	f.BoolVar(&cfg.ZtunnelMarkOnly, "ztunnel-mark-only", false, "with --ztunnel-protocol=istio: accept a ztunnel whose cgroup cannot be found, exempting its sockets by the mark alone")
	f.UintSliceVar(&ztunnelUIDs, "ztunnel-uids", nil, "uids besides this process' own that may connect to --ztunnel-socket")
	f.DurationVar(&cfg.PluginTimeout, "plugin-timeout", d.PluginTimeout, "the plugin's bound on its exchange with the agent")
	f.DurationVar(&cfg.AckTimeout, "ack-timeout", d.AckTimeout, "bound on ztunnel's ack of each message")
	f.StringSliceVar(&cfg.NetnsDirs, "netns-dir", d.NetnsDirs, `directories where the runtime bind-mounts pod network namespaces ("none" skips)`)
	f.StringVar(&cfg.ProcDir, "proc-dir", d.ProcDir, `the node's /proc as mounted here ("none" skips)`)
	f.StringVar(&cfg.NodeCgroupNS, "node-cgroupns", "", `the node's initial cgroup namespace file, where the pods' rules are written from (default <proc-dir>/1/ns/cgroup; "none": this process' own)`)
	f.StringVar(&cfg.StateDir, "state-dir", d.StateDir, `directory (on the node) where the sandbox of every CNI ADD is recorded ("none" keeps no records)`)
	f.StringSliceVar(&cfg.PodCgroupRoots, "pod-cgroup-root", d.PodCgroupRoots, "cgroup paths (as the node's /proc/<pid>/cgroup shows them) under which the kubelet creates pod cgroups")
	f.StringVar(&cfg.NodeNetNS, "node-netns", "", "the node's network namespace file (default: this process' own)")
	f.StringSliceVar(&nodeAddresses, "node-addresses", nil, "addresses of the node never captured from pods (default: the Node's InternalIP and ExternalIP)")
	f.BoolVar(&cfg.RedirectDNS, "redirect-dns", false, "send enrolled pods' DNS (port 53) to ztunnel's 15053")
	f.StringVar(&cfg.MonitoringAddr, "monitoring-addr", d.MonitoringAddr, `/metrics, /healthz and /readyz listen address ("none" disables)`)
	f.DurationVar(&cfg.ShutdownTimeout, "shutdown-timeout", d.ShutdownTimeout, "time allowed for a graceful stop")
	f.StringVar(&kubeconfig, "kubeconfig", "", "kubeconfig file (default: $KUBECONFIG, ~/.kube/config, then in-cluster)")
	lc.AddFlags(f)
	return cmd
}
