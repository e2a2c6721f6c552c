package main

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/registry"
)

// registryz is the part of /debug/registryz isthmusctl reads.
type registryz struct {
	Services []registry.ServiceSummary `json:"services"`
}

// clusterRow is one cluster of remote-clusters: its status and what it
// contributes to the registry.
type clusterRow struct {
	multicluster.Status
	// Services counts the registry's services that have the cluster.
	Services int `json:"services"`
	// Endpoints counts the cluster's endpoints over every service.
	Endpoints int `json:"endpoints"`
}

// remoteClustersConfig holds the flags of remote-clusters.
type remoteClustersConfig struct {
	Output string
	// Now is the clock for the LAST SYNC column.
	Now func() time.Time
}

func newRemoteClustersCommand(pilot func() *pilotClient) *cobra.Command {
	cfg := &remoteClustersConfig{Now: time.Now}
	cmd := &cobra.Command{
		Use:   "remote-clusters",
		Short: "Show every cluster pilot knows, its state and what it contributes (/debug/clusterz, /debug/registryz)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return remoteClusters(cmd.Context(), pilot(), *cfg, cmd.OutOrStdout())
		},
	}
	cmd.Flags().StringVarP(&cfg.Output, "output", "o", outputTable, "output format: table, json or yaml")
	return cmd
}

// remoteClusters prints the clusters of /debug/clusterz with their service
// and endpoint counts from /debug/registryz.
func remoteClusters(ctx context.Context, p *pilotClient, cfg remoteClustersConfig, out io.Writer) error {
	if err := checkOutput(cfg.Output); err != nil {
		return err
	}
	var statuses []multicluster.Status
	if err := p.get(ctx, "/debug/clusterz", &statuses); err != nil {
		return fmt.Errorf("cluster statuses: %w", err)
	}
	var reg registryz
	if err := p.get(ctx, "/debug/registryz", &reg); err != nil {
		return fmt.Errorf("registry: %w", err)
	}
	rows := make([]clusterRow, 0, len(statuses))
	for _, s := range statuses {
		r := clusterRow{Status: s}
		for _, svc := range reg.Services {
			if n, ok := svc.Endpoints[s.ID]; ok {
				r.Endpoints += n
			}
			if containsCluster(svc.Clusters, s.ID) {
				r.Services++
			}
		}
		rows = append(rows, r)
	}
	if cfg.Output != outputTable {
		return printObject(out, cfg.Output, rows)
	}
	now := cfg.Now()
	t := newTable(out, "ID", "STATE", "REASON", "SECRET", "GENERATION", "LAST SYNC", "SERVICES", "ENDPOINTS")
	for _, r := range rows {
		gen := strconv.FormatUint(r.Generation, 10)
		if r.Pending != nil {
			// Make-before-break: a new generation is starting while this
			// one serves.
			gen += fmt.Sprintf(" (%d %s)", r.Pending.Generation, r.Pending.State)
		}
		t.row(string(r.ID), string(r.State), r.Reason, r.Secret, gen, age(now, r.LastSynced), strconv.Itoa(r.Services), strconv.Itoa(r.Endpoints))
	}
	return t.flush()
}

func containsCluster(list []model.ClusterID, id model.ClusterID) bool {
	for _, c := range list {
		if c == id {
			return true
		}
	}
	return false
}
