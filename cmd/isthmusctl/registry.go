package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/registry"
)

// errNoWorkloadz explains a pilot without /debug/workloadz.
var errNoWorkloadz = errors.New("pilot does not serve /debug/workloadz (it must return the registry's []*model.Workload as JSON)")

// registryConfig holds the flags of the registry subcommands.
type registryConfig struct {
	// Cluster keeps only the services or workloads of that cluster.
	Cluster string
	Output  string
}

func newRegistryCommand(pilot func() *pilotClient) *cobra.Command {
	cfg := &registryConfig{}
	cmd := &cobra.Command{
		Use:   "registry",
		Short: "Show pilot's federated registry",
	}
	cmd.PersistentFlags().StringVar(&cfg.Cluster, "cluster", "", "show only this cluster's services or workloads")
	cmd.PersistentFlags().StringVarP(&cfg.Output, "output", "o", outputTable, "output format: table, json or yaml")
	cmd.AddCommand(
		&cobra.Command{
			Use:   "services",
			Short: "Federated services with their clusters, ports and endpoint counts (/debug/registryz)",
			Args:  cobra.NoArgs,
			RunE: func(cmd *cobra.Command, _ []string) error {
				return registryServices(cmd.Context(), pilot(), *cfg, cmd.OutOrStdout())
			},
		},
		&cobra.Command{
			Use:   "workloads",
			Short: "Workloads of every cluster (/debug/workloadz)",
			Args:  cobra.NoArgs,
			RunE: func(cmd *cobra.Command, _ []string) error {
				return registryWorkloads(cmd.Context(), pilot(), *cfg, cmd.OutOrStdout())
			},
		},
	)
	return cmd
}

// registryServices prints the services of /debug/registryz.
func registryServices(ctx context.Context, p *pilotClient, cfg registryConfig, out io.Writer) error {
	if err := checkOutput(cfg.Output); err != nil {
		return err
	}
	var reg registryz
	if err := p.get(ctx, "/debug/registryz", &reg); err != nil {
		return fmt.Errorf("registry: %w", err)
	}
	services := []registry.ServiceSummary{}
	for _, s := range reg.Services {
		if cfg.Cluster == "" || containsCluster(s.Clusters, model.ClusterID(cfg.Cluster)) {
			services = append(services, s)
		}
	}
	if cfg.Output != outputTable {
		return printObject(out, cfg.Output, services)
	}
	t := newTable(out, "HOSTNAME", "SCOPE", "CLUSTERS", "PORTS", "ENDPOINTS")
	for _, s := range services {
		t.row(s.Hostname, s.Scope, joinIDs(s.Clusters), ports(s.Ports), endpointCounts(s.Endpoints, cfg.Cluster))
	}
	return t.flush()
}

// registryWorkloads prints the workloads of /debug/workloadz.
func registryWorkloads(ctx context.Context, p *pilotClient, cfg registryConfig, out io.Writer) error {
	if err := checkOutput(cfg.Output); err != nil {
		return err
	}
	var all []*model.Workload
	if err := p.get(ctx, "/debug/workloadz", &all); err != nil {
		if errors.Is(err, errNotServed) {
			return fmt.Errorf("%w: %w", errNoWorkloadz, err)
		}
		return fmt.Errorf("workloads: %w", err)
	}
	workloads := []*model.Workload{}
	for _, w := range all {
		if w != nil && (cfg.Cluster == "" || string(w.Cluster) == cfg.Cluster) {
			workloads = append(workloads, w)
		}
	}
	if cfg.Output != outputTable {
		return printObject(out, cfg.Output, workloads)
	}
	t := newTable(out, "UID", "CLUSTER", "NETWORK", "NODE", "ADDRESSES", "SERVICE ACCOUNT", "READY", "SERVICES")
	for _, w := range workloads {
		addrs := make([]string, len(w.Addresses))
		for i, a := range w.Addresses {
			addrs[i] = a.String()
		}
		ready := strconv.FormatBool(w.Ready)
		if w.Terminating {
			ready = "terminating"
		}
		t.row(w.UID, string(w.Cluster), string(w.Network), w.Node, strings.Join(addrs, ","),
			w.ServiceAccount, ready, strings.Join(slices.Sorted(maps.Keys(w.Services)), ","))
	}
	return t.flush()
}

func joinIDs(ids []model.ClusterID) string {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = string(id)
	}
	return strings.Join(s, ",")
}

// ports renders ports as name:port/protocol (name omitted when empty).
func ports(ps []model.Port) string {
	out := make([]string, len(ps))
	for i, p := range ps {
		s := strconv.Itoa(int(p.Port))
		if p.Name != "" {
			s = p.Name + ":" + s
		}
		if p.Protocol != "" && p.Protocol != model.TCP {
			s += "/" + string(p.Protocol)
		}
		out[i] = s
	}
	return strings.Join(out, ",")
}

// endpointCounts renders per-cluster endpoint counts as cluster=n, sorted,
// or only that cluster's count when one is selected.
func endpointCounts(m map[model.ClusterID]int, only string) string {
	if only != "" {
		return strconv.Itoa(m[model.ClusterID(only)])
	}
	ids := slices.Sorted(maps.Keys(m))
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = fmt.Sprintf("%s=%d", id, m[id])
	}
	return strings.Join(out, ",")
}
