// Package cli is the ztunnel command line: the flags the Helm charts and
// pilot's east-west gateway Deployments pass, parsed into a node.Config. The
// ztunnel binary (cmd/ztunnel) runs it; tests run it in-process with a
// Deployment's arguments, as a kubelet would start the container.
package cli

import (
	"context"
	"fmt"
	"io"
	"net/netip"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/isthmus-mesh/isthmus/internal/cmdutil"
	"github.com/isthmus-mesh/isthmus/internal/version"
	"github.com/isthmus-mesh/isthmus/ztunnel/node"
)

// RunFunc runs a configured ztunnel; tests replace it.
type RunFunc func(ctx context.Context, cfg node.Config, deps node.Deps) error

// RunNode builds a node.Node from cfg and deps and runs it until ctx ends.
func RunNode(ctx context.Context, cfg node.Config, deps node.Deps) error {
	n, err := node.New(cfg, deps)
	if err != nil {
		return err
	}
	return n.Run(ctx)
}

// NewCommand returns the ztunnel command: its flags (what the Helm charts
// and pilot's east-west Deployments pass) parsed into a node.Config, logs
// written to stderr, and run called with the result.
func NewCommand(stderr io.Writer, run RunFunc) *cobra.Command {
	d := node.DefaultConfig()
	cfg := node.Config{}
	lc := cmdutil.Log{Format: "json", Level: "info"}
	var mode string
	var podDNS, accessLog bool
	var nodeIPs []string
	cmd := &cobra.Command{
		Use:           "ztunnel",
		Short:         "Isthmus node proxy and east-west gateway",
		Version:       version.String(),
		Args:          cobra.NoArgs,
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := lc.Logger(stderr)
			if err != nil {
				return err
			}
			cfg.Mode = node.Mode(mode)
			log.Info("starting ztunnel", "version", version.Version(), "commit", version.Commit())
			for _, ip := range nodeIPs {
				a, err := netip.ParseAddr(strings.TrimSpace(ip))
				if err != nil {
					return fmt.Errorf("--node-ip %q: %w", ip, err)
				}
				cfg.NodeIPs = append(cfg.NodeIPs, a.Unmap())
			}
			cfg.DisablePodDNS = !podDNS
			cfg.NoAccessLog = !accessLog
			return run(cmd.Context(), cfg, node.Deps{Log: log})
		},
	}
	cmd.SetErr(stderr)
	cmd.SetVersionTemplate("ztunnel {{.Version}}\n")
	f := cmd.Flags()
	f.StringVar(&mode, "mode", string(d.Mode), "node (node proxy) or gateway (east-west gateway)")
	f.StringVar(&cfg.NodeName, "node", os.Getenv("NODE_NAME"), "Kubernetes node this ztunnel runs on (default $NODE_NAME)")
	f.StringSliceVar(&nodeIPs, "node-ip", cmdutil.SplitEnv("HOST_IPS"), "the node's addresses, never a source identity or destination (default $HOST_IPS, comma separated)")
	f.StringVar(&cfg.ClusterID, "cluster-id", "", "ID of the cluster this ztunnel runs in")
	f.StringVar(&cfg.Network, "network", "", "network this ztunnel is on")
	f.StringVar(&cfg.TrustDomain, "trust-domain", d.TrustDomain, "trust domain of this cluster (the ztunnel's own identity)")
	f.StringVar(&cfg.Namespace, "namespace", cmdutil.EnvOr("POD_NAMESPACE", d.Namespace), "namespace of the ztunnel's ServiceAccount (default $POD_NAMESPACE)")
	f.StringVar(&cfg.ServiceAccount, "service-account", d.ServiceAccount, "the ztunnel's ServiceAccount")
	f.StringVar(&cfg.PodName, "pod-name", os.Getenv("POD_NAME"), "this ztunnel's pod (default $POD_NAME)")
	f.StringVar(&cfg.NodeID, "xds-node-id", "", "xDS node id (default ztunnel~<node>.<namespace>; a gateway in a pod: gateway~<pod-name>.<namespace>)")
	f.StringVar(&cfg.XDSAddress, "xds-address", "", "pilot's xDS address, host:port")
	f.BoolVar(&cfg.XDSPlaintext, "xds-plaintext", false, "plaintext xDS (pilot's 15010; development only)")
	f.StringVar(&cfg.XDSServerName, "xds-server-name", "", "name pilot's xDS certificate must carry (default: host of --xds-address)")
	f.StringVar(&cfg.CAAddress, "ca-address", "", "pilot's CA address, host:port")
	f.StringVar(&cfg.CAServerName, "ca-server-name", "", "name the CA's certificate must carry (default: host of --ca-address)")
	f.StringVar(&cfg.TokenFile, "ca-token", d.TokenFile, "projected ServiceAccount token file, re-read for each certificate request")
	f.StringVar(&cfg.RootCertFile, "root-cert", d.RootCertFile, "control plane root certificates (PEM), re-read when they change")
	f.StringVar(&cfg.TrustBundleFile, "trust-bundle", d.TrustBundleFile,
		"SPIFFE trust bundle map (each trusted trust domain and its roots), re-read when it changes; absent: --root-cert is --trust-domain's only roots")
	f.DurationVar(&cfg.RootsReloadInterval, "root-cert-reload", d.RootsReloadInterval, "how often --root-cert and --trust-bundle are checked for new roots")
	f.DurationVar(&cfg.CertTTL, "cert-ttl", 0, "certificate lifetime to ask for (0: the CA's default)")
	f.Uint16Var(&cfg.HBONEPort, "hbone-port", d.HBONEPort, "HBONE port on each local workload address (inbound) and of the gateway")
	f.StringVar(&cfg.OutboundListen, "outbound-addr", d.OutboundListen, `outbound capture listen address ("none" disables)`)
	f.StringVar(&cfg.SOCKS5Listen, "socks5-addr", d.SOCKS5Listen, `SOCKS5 listen address ("none" disables)`)
	f.StringVar(&cfg.InPodSocket, "inpod-socket", "", "the CNI node agent's socket for ztunnel: serve enrolled pods inside their network namespaces (empty: serve them on their addresses in ztunnel's own)")
	f.StringVar(&cfg.InPodProtocol, "inpod-protocol", "isthmus", `what --inpod-socket speaks: "isthmus" (the Isthmus CNI agent) or "istio" (Istio's ZDS, from istio-cni at /var/run/ztunnel/ztunnel.sock)`)
	f.BoolVar(&podDNS, "pod-dns", true, "serve DNS on 15053 inside each enrolled pod")
	f.StringVar(&cfg.DNSListen, "dns-addr", d.DNSListen, `node address of the DNS proxy, UDP and TCP ("none" disables)`)
	f.StringSliceVar(&cfg.DNSUpstreams, "dns-upstream", nil, "resolvers for names outside the mesh (default: the nameservers of /etc/resolv.conf)")
	f.StringVar(&cfg.DNSDomain, "dns-domain", "", "cluster domain of service names (default cluster.local)")
	f.StringVar(&cfg.AdminListen, "admin-addr", d.AdminListen, `admin listen address ("none" disables)`)
	f.StringVar(&cfg.ReadinessListen, "readiness-addr", d.ReadinessListen, `readiness listen address ("none" disables)`)
	f.StringVar(&cfg.MetricsListen, "metrics-addr", d.MetricsListen, `metrics listen address ("none" disables)`)
	f.StringVar(&cfg.GatewayListen, "gateway-addr", "", "gateway mode: HBONE listen address (default 0.0.0.0:<hbone-port>)")
	f.StringVar(&cfg.GatewayTLSListen, "gateway-tls-addr", "", `gateway mode: Istio's SNI passthrough (15443) listen address, e.g. 0.0.0.0:15443; off unless set: the gateway forwards those clients as its own identity, so serve it only when every exported endpoint requires mesh client certificates itself`)
	f.DurationVar(&cfg.ShutdownTimeout, "shutdown-timeout", d.ShutdownTimeout, "time allowed for a graceful stop")
	f.DurationVar(&cfg.InPodSyncWait, "inpod-sync-wait", d.InPodSyncWait,
		"in-pod mode: how long to wait for pilot's state before taking the pods from the CNI agent (a ztunnel that replaces another takes them only once it knows the mesh)")
	f.DurationVar(&cfg.HandoffWait, "handoff-wait", d.HandoffWait,
		"on SIGTERM, how long to keep serving until a newer ztunnel has taken every enrolled pod (the CNI agent says when) before draining anyway")
	f.DurationVar(&cfg.DrainGrace, "drain-grace", d.DrainGrace,
		"on SIGTERM, once handed over: how long established connections may run on before they are closed (the DaemonSet's terminationGracePeriodSeconds follows it)")
	f.BoolVar(&accessLog, "access-log", true, "write one access log line per connection (refused or carried) to the log")
	f.Float64Var(&cfg.AccessLogRate, "access-log-rate", d.AccessLogRate, "access log lines per second on average; lines over it are dropped and counted (isthmus_access_log_dropped_total)")
	f.IntVar(&cfg.AccessLogBurst, "access-log-burst", d.AccessLogBurst, "access log lines written at once above --access-log-rate")
	lc.AddFlags(f)
	return cmd
}
