package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/isthmus-mesh/isthmus/analysis"
	"github.com/isthmus-mesh/isthmus/analysis/analyzers"
	"github.com/isthmus-mesh/isthmus/analysis/collect"
	"github.com/isthmus-mesh/isthmus/analysis/msg"
	"github.com/isthmus-mesh/isthmus/internal/cmdutil"
	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// exitAnalyzeIssues is analyze's exit code when it found issues at or above
// the failure threshold (istioctl's).
const exitAnalyzeIssues = 79

// analyzeConfig holds the flags of analyze.
type analyzeConfig struct {
	// Kubeconfig and Context select the config cluster.
	Kubeconfig, Context string
	// Files, when set, is a folder with one folder of manifests per cluster.
	Files string
	// Pilot's settings that the checks depend on.
	Namespace, ClusterID, Network, TrustDomain string
	GatewayNamespaces                          []string
	GatewayNamespaceSelector                   string
	AllowedKubeconfigOptions                   []string
	// Output is text, json or yaml.
	Output           string
	FailureThreshold string
	Suppress         []string
	Timeout          time.Duration
}

func newAnalyzeCommand(logger func() *slog.Logger) *cobra.Command {
	cfg := &analyzeConfig{}
	cmd := &cobra.Command{
		Use:   "analyze",
		Short: "Diagnose misconfigurations across every registered cluster (coded messages, see docs/analyzers.md)",
		Long: `Reads the config cluster and every remote cluster its remote Secrets register
(with the kubeconfigs pilot uses), or folders of manifests (-f DIR, one folder per
cluster ID), and reports cross-cluster misconfigurations as coded messages
(ISM0001...). Exits 79 when a message is at or above --failure-threshold.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return analyze(cmd.Context(), *cfg, cmd.OutOrStdout(), logger())
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.Kubeconfig, "kubeconfig", "", "kubeconfig of the config cluster (default: standard loading rules)")
	f.StringVar(&cfg.Context, "context", "", "kubeconfig context of the config cluster")
	f.StringVarP(&cfg.Files, "files", "f", "", "analyze manifests instead of live clusters: a folder with one folder per cluster ID")
	f.StringVar(&cfg.Namespace, "namespace", defaults.Namespace, "control-plane namespace (pilot's --namespace)")
	f.StringVar(&cfg.ClusterID, "cluster-id", "primary", "ID of the config cluster (pilot's --cluster-id)")
	f.StringVar(&cfg.Network, "network", "", "default network of the config cluster (pilot's --network)")
	f.StringVar(&cfg.TrustDomain, "trust-domain", defaults.TrustDomain, "SPIFFE trust domain (pilot's --trust-domain)")
	f.StringSliceVar(&cfg.GatewayNamespaces, "gateway-namespaces", nil, "namespaces whose Services may be east-west gateways (default: --namespace), as pilot's flag")
	f.StringVar(&cfg.GatewayNamespaceSelector, "gateway-namespace-selector", "", "label selector of further gateway namespaces, as pilot's flag")
	f.StringSliceVar(&cfg.AllowedKubeconfigOptions, "allow-kubeconfig-option", nil, "kubeconfig options remote secrets may use, as pilot's flag")
	f.StringVarP(&cfg.Output, "output", "o", "text", "output format: text, json or yaml")
	f.StringVar(&cfg.FailureThreshold, "failure-threshold", "Error", "exit 79 when a message is at this level or above: Info, Warning or Error")
	f.StringArrayVar(&cfg.Suppress, "suppress", nil, "silence a message: CODE=Kind/namespace/name (Kind/name without a namespace; * matches within a segment, a lone * everything); repeatable")
	f.DurationVar(&cfg.Timeout, "timeout", 30*time.Second, "bound of reading each cluster")
	return cmd
}

// analyze collects the snapshot, runs every analyzer and prints the
// messages; it fails with exit code 79 when one reaches the threshold.
func analyze(ctx context.Context, cfg analyzeConfig, out io.Writer, log *slog.Logger) error {
	if cfg.Output != "text" && cfg.Output != outputJSON && cfg.Output != outputYAML {
		return fmt.Errorf("unknown output format %q: want text, json or yaml", cfg.Output)
	}
	threshold, err := msg.ParseLevel(cfg.FailureThreshold)
	if err != nil {
		return fmt.Errorf("--failure-threshold: %w", err)
	}
	var suppress []analysis.Suppression
	for _, s := range cfg.Suppress {
		sup, err := analysis.ParseSuppression(s)
		if err != nil {
			return fmt.Errorf("--suppress: %w", err)
		}
		suppress = append(suppress, sup)
	}
	mesh := analysis.Mesh{Namespace: cfg.Namespace, ConfigCluster: model.ClusterID(cfg.ClusterID), TrustDomain: cfg.TrustDomain,
		GatewayNamespaces: cfg.GatewayNamespaces}
	if cfg.GatewayNamespaceSelector != "" {
		if mesh.GatewayNamespaceSelector, err = labels.Parse(cfg.GatewayNamespaceSelector); err != nil {
			return fmt.Errorf("--gateway-namespace-selector: %w", err)
		}
	}
	snap, err := snapshot(ctx, cfg, mesh, log)
	if err != nil {
		return err
	}
	msgs, runErr := analysis.Run(snap, analyzers.All(), suppress)
	if err := printMessages(out, cfg.Output, snap, msgs); err != nil {
		return err
	}
	if runErr != nil {
		return runErr
	}
	if analysis.Fails(msgs, threshold) {
		return &exitError{code: exitAnalyzeIssues, msg: fmt.Sprintf("analyze found issues at level %s or above", threshold)}
	}
	return nil
}

func snapshot(ctx context.Context, cfg analyzeConfig, mesh analysis.Mesh, log *slog.Logger) (*analysis.Snapshot, error) {
	if cfg.Files != "" {
		return collect.Files(cfg.Files, collect.FilesConfig{Mesh: mesh, ConfigNetwork: model.Network(cfg.Network)})
	}
	rc, err := cmdutil.RestConfig(cfg.Kubeconfig, cfg.Context)
	if err != nil {
		return nil, err
	}
	return collect.Live(ctx, collect.LiveConfig{Mesh: mesh, ConfigNetwork: model.Network(cfg.Network),
		AllowedKubeconfigOptions: cfg.AllowedKubeconfigOptions, Timeout: cfg.Timeout, Logger: log},
		collect.LiveDeps{ConfigCluster: rc})
}

func printMessages(out io.Writer, format string, snap *analysis.Snapshot, msgs []msg.Message) error {
	if format != "text" {
		if msgs == nil {
			msgs = []msg.Message{}
		}
		return printObject(out, format, msgs)
	}
	if len(msgs) == 0 {
		ids := make([]string, 0, len(snap.Clusters))
		for _, c := range snap.Clusters {
			ids = append(ids, string(c.ID))
		}
		_, err := fmt.Fprintf(out, "No issues found in %d clusters (%s).\n", len(ids), strings.Join(ids, ", "))
		return err
	}
	for _, m := range msgs {
		if _, err := fmt.Fprintln(out, m.String()); err != nil {
			return err
		}
	}
	return nil
}
