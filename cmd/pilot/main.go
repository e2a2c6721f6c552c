// Command pilot is the Isthmus control plane: it federates every registered
// cluster, serves the federated registry and signs workload certificates.
// This file maps flags into server.Config and runs the server until SIGINT
// or SIGTERM; everything else lives in pilot/server.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"github.com/spf13/cobra"
	"k8s.io/apimachinery/pkg/labels"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/isthmus-mesh/isthmus/controller"
	"github.com/isthmus-mesh/isthmus/internal/cmdutil"
	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/internal/version"
	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/server"
)

type options struct {
	kubeconfig, kubeContext string
	log                     cmdutil.Log
	namespace, clusterID    string
	network                 string
	gatewaySelector         string
	discoverySelectors      string
	serviceScope            string
	serviceScopeRules       string
	execAllowlistFile       string
	execAllow               []string
	cfg                     server.Config
}

func main() {
	if err := newCommand().Execute(); err != nil {
		os.Exit(1)
	}
}

func newCommand() *cobra.Command {
	o := &options{}
	cmd := &cobra.Command{
		Use:           "pilot",
		Short:         "Isthmus control plane: multicluster federation, xDS and the mesh CA",
		Version:       version.String(),
		SilenceUsage:  true,
		SilenceErrors: false,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGINT, syscall.SIGTERM)
			defer stop()
			return o.run(ctx)
		},
	}
	cmd.SetVersionTemplate("pilot {{.Version}}\n")
	f := cmd.Flags()
	f.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig of the config cluster (default: $KUBECONFIG, ~/.kube/config, then in-cluster)")
	f.StringVar(&o.kubeContext, "context", "", "context in --kubeconfig")
	f.StringVar(&o.namespace, "namespace", defaults.Namespace, "control-plane namespace (remote secrets, CA secrets)")
	f.StringVar(&o.clusterID, "cluster-id", "primary", "ID of the config cluster")
	f.StringVar(&o.network, "network", "", "default network of the config cluster")
	f.StringVar(&o.cfg.GRPCAddr, "xds-addr", ":"+strconv.Itoa(defaults.XDSPort), "TLS gRPC address (CA and xDS); "+defaults.Disabled+" disables")
	f.StringVar(&o.cfg.XDSPlaintextAddr, "xds-plaintext-addr", defaults.Disabled, "plaintext xDS address (development only); "+defaults.Disabled+" disables")
	f.StringVar(&o.cfg.MonitoringAddr, "monitoring-addr", ":"+strconv.Itoa(defaults.MonitoringPort), "address of /metrics, /healthz and /readyz; "+defaults.Disabled+" disables")
	f.StringVar(&o.cfg.DebugAddr, "debug-addr", "127.0.0.1:8080", "address of /debug/*; "+defaults.Disabled+" disables")
	f.DurationVar(&o.cfg.Multicluster.SyncTimeout, "sync-timeout", 30*time.Second, "a remote not synced after this is reported timed out")
	f.StringSliceVar(&o.cfg.Multicluster.AllowedKubeconfigOptions, "allow-kubeconfig-option", nil,
		"kubeconfig options remote secrets may use although they read files or run auth providers (auth-provider[:name], tokenFile, clientCertificate, clientKey, certificateAuthority); exec plugins are allowed by --exec-allowlist and --exec-allow, and \"exec\" here is an error")
	f.StringVar(&o.execAllowlistFile, "exec-allowlist", "",
		"file (YAML or JSON) listing the exec credential plugins remote kubeconfigs may run: {commands: [{command: /abs/path, args: [pattern, ...], env: [NAME, ...]}]}; read at start")
	f.StringArrayVar(&o.execAllow, "exec-allow", nil,
		"one more allowed exec credential plugin, as a YAML flow mapping: '{command: /abs/path, args: [get-token, \"prod-*\"], env: [NAME]}' (repeatable)")
	f.DurationVar(&o.cfg.Multicluster.Exec.Timeout, "exec-timeout", 10*time.Second, "bound of one exec credential plugin run")
	f.BoolVar(&o.cfg.Registry.ExportMode, "export-mode", false, "federate only services with an MCS ServiceExport")
	f.DurationVar(&o.cfg.Registry.StaleGrace, "stale-grace", 0, "how long an unreachable cluster's last state is kept (0: forever)")
	f.DurationVar(&o.cfg.Registry.QuietPeriod, "debounce-quiet", 100*time.Millisecond, "changes closer than this are merged")
	f.DurationVar(&o.cfg.Registry.MaxDelay, "debounce-max", time.Second, "longest a change waits for a burst to end")
	f.StringSliceVar(&o.cfg.Discovery.GatewayNamespaces, "gateway-namespaces", nil,
		"namespaces whose Services may be east-west gateways (default: --namespace); a Service labelled with a network elsewhere is ignored and reported")
	f.StringVar(&o.gatewaySelector, "gateway-namespace-selector", "",
		"label selector of further namespaces whose Services may be east-west gateways (e.g. isthmus.io/gateways=trusted)")
	f.StringVar(&o.discoverySelectors, "discovery-selectors", "",
		"namespaces discovered in every cluster: a YAML or JSON list of label selectors, OR-ed, as Istio's MeshConfig discoverySelectors (e.g. '[{matchLabels: {isthmus.io/discovery: enabled}}]'); empty: all. A remote Secret's isthmus.io/discovery-selectors annotation replaces it for its clusters")
	f.StringVar(&o.serviceScope, "service-scope", "global",
		"scope of a service that neither its istio.io/global label, its namespace's, nor a --service-scope-rules entry decides: global (every cluster's endpoints are shared) or local (Istio's default: seen only in their own cluster)")
	f.StringVar(&o.serviceScopeRules, "service-scope-rules", "",
		"Istio's MeshConfig serviceScopeConfigs, a YAML or JSON list: '[{namespaceSelector: {matchLabels: {team: a}}, servicesSelector: {matchExpressions: [{key: istio.io/global, operator: Exists}]}, scope: GLOBAL}]'; a GLOBAL entry that selects a service wins over a LOCAL one")
	f.BoolVar(&o.cfg.NoGatewayClass, "no-gateway-class", false,
		"do not write the GatewayClass isthmus-east-west nor deploy east-west gateways from Gateways of that class")
	f.StringVar(&o.cfg.Gateways.Image, "gateway-image", "", "image of the east-west gateways deployed from Gateways (default docker.io/isthmus/ztunnel:<pilot's version>)")
	f.StringVar(&o.cfg.Gateways.XDSAddress, "gateway-xds-address", "",
		"pilot's CA and xDS address as the east-west gateways deployed from Gateways dial it, in every cluster (default isthmusd.<namespace>.svc:15012)")
	f.StringVar(&o.cfg.Gateways.XDSServerName, "gateway-xds-server-name", "",
		"name pilot's certificate is verified against by those gateways (default isthmusd.<namespace>.svc)")
	f.StringVar(&o.cfg.CA.TrustDomain, "trust-domain", defaults.TrustDomain,
		"the mesh's SPIFFE trust domain (a remote cluster may have its own: the remote Secret's security.isthmus.io/trust-domain annotation)")
	f.StringSliceVar(&o.cfg.TrustDomainAliases, "trust-domain-alias", nil,
		"trust domains whose identities count as the mesh's in AuthorizationPolicy principals (Istio's meshConfig trustDomainAliases; repeatable or comma separated)")
	f.StringSliceVar(&o.cfg.CA.ServingSANs, "serving-san", nil, "DNS names or IPs of pilot's serving certificate (default isthmusd.<namespace>.svc)")
	f.BoolVar(&o.cfg.NoLeaderElection, "no-leader-election", false, "write cluster status without a leader Lease (single replica only)")
	f.DurationVar(&o.cfg.ShutdownTimeout, "shutdown-timeout", 10*time.Second, "bound of the graceful shutdown")
	o.log = cmdutil.Log{Format: "text", Level: "info"}
	o.log.AddFlags(f)
	return cmd
}

func (o *options) run(ctx context.Context) error {
	logger, err := o.log.Logger(os.Stderr)
	if err != nil {
		return err
	}
	cmdutil.RouteKlog(logger)
	// controller-runtime's caches (pilot/eastwest) log through its own
	// process-wide logger.
	ctrllog.SetLogger(logr.FromSlogHandler(logger.With("source", "controller-runtime").Handler()))
	if o.cfg.Multicluster.Exec.Allowlist, err = execAllowlist(o.execAllowlistFile, o.execAllow); err != nil {
		return err
	}
	rc, err := cmdutil.RestConfig(o.kubeconfig, o.kubeContext)
	if err != nil {
		return err
	}
	o.cfg.Namespace, o.cfg.ClusterID, o.cfg.Network = o.namespace, model.ClusterID(o.clusterID), model.Network(o.network)
	if o.gatewaySelector != "" {
		sel, err := labels.Parse(o.gatewaySelector)
		if err != nil {
			return fmt.Errorf("--gateway-namespace-selector: %w", err)
		}
		o.cfg.Discovery.GatewayNamespaceSelector = sel
	}
	if o.discoverySelectors != "" {
		if o.cfg.Multicluster.DiscoverySelectors, err = multicluster.ParseDiscoverySelectors(o.discoverySelectors); err != nil {
			return fmt.Errorf("--discovery-selectors: %w", err)
		}
	}
	if o.cfg.Discovery.ServiceScope.Default, err = controller.ParseScope(o.serviceScope); err != nil {
		return fmt.Errorf("--service-scope: %w", err)
	}
	if o.serviceScopeRules != "" {
		if o.cfg.Discovery.ServiceScope.Rules, err = controller.ParseServiceScopeRules(o.serviceScopeRules); err != nil {
			return fmt.Errorf("--service-scope-rules: %w", err)
		}
	}
	o.cfg.Logger = logger
	srv, err := server.New(o.cfg, rc, nil)
	if err != nil {
		return err
	}
	logger.Info("starting pilot", "version", version.Version(), "commit", version.Commit())
	return srv.Run(ctx)
}

// execAllowlist reads the exec allowlist file (if any) and appends the
// rules given one by one.
func execAllowlist(path string, specs []string) ([]multicluster.ExecRule, error) {
	var rules []multicluster.ExecRule
	if path != "" {
		data, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("--exec-allowlist: %w", err)
		}
		if rules, err = multicluster.ParseExecAllowlist(data); err != nil {
			return nil, fmt.Errorf("--exec-allowlist %s: %w", path, err)
		}
	}
	for _, s := range specs {
		r, err := multicluster.ParseExecRule(s)
		if err != nil {
			return nil, fmt.Errorf("--exec-allow: %w", err)
		}
		rules = append(rules, r)
	}
	return rules, nil
}
