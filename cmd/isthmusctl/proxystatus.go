package main

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"

	"github.com/spf13/cobra"
)

// proxyStatusConfig holds the flags of proxy-status.
type proxyStatusConfig struct {
	Output string
}

func newProxyStatusCommand(pilot func() *pilotClient) *cobra.Command {
	cfg := &proxyStatusConfig{}
	cmd := &cobra.Command{
		Use:   "proxy-status",
		Short: "Show the xDS clients connected to pilot and what each has acknowledged (/debug/syncz)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return proxyStatus(cmd.Context(), pilot(), *cfg, cmd.OutOrStdout())
		},
	}
	cmd.Flags().StringVarP(&cfg.Output, "output", "o", outputTable, "output format: table, json or yaml")
	return cmd
}

// proxyStatus prints one row per connected client and type URL. The
// /debug/syncz document is decoded generically (a list of objects), so
// fields it gains or loses do not break isthmusctl.
func proxyStatus(ctx context.Context, p *pilotClient, cfg proxyStatusConfig, out io.Writer) error {
	if err := checkOutput(cfg.Output); err != nil {
		return err
	}
	var clients []map[string]any
	if err := p.get(ctx, "/debug/syncz", &clients); err != nil {
		return fmt.Errorf("xDS clients: %w", err)
	}
	if cfg.Output != outputTable {
		return printObject(out, cfg.Output, clients)
	}
	slices.SortStableFunc(clients, func(a, b map[string]any) int { return cmp.Compare(str(a, "nodeId"), str(b, "nodeId")) })
	t := newTable(out, "NODE ID", "CLUSTER", "NETWORK", "PROTOCOL", "TYPE", "SENT", "ACKED", "STATUS")
	for _, c := range clients {
		types, _ := c["types"].(map[string]any)
		if len(types) == 0 {
			t.row(str(c, "nodeId"), str(c, "cluster"), str(c, "network"), str(c, "protocol"), "", "", "", "CONNECTED")
			continue
		}
		for _, url := range slices.Sorted(maps.Keys(types)) {
			ts, _ := types[url].(map[string]any)
			t.row(str(c, "nodeId"), str(c, "cluster"), str(c, "network"), str(c, "protocol"),
				shortType(url), str(ts, "sentVersion"), str(ts, "ackedVersion"), syncState(ts))
		}
	}
	return t.flush()
}

// syncState summarizes one type's status: SYNCED (the last response sent is
// acknowledged), NACKED (rejected; the client runs an older version), STALE
// (waiting for an answer) or NOT SENT.
func syncState(ts map[string]any) string {
	sent, acked := str(ts, "sentVersion"), str(ts, "ackedVersion")
	pending, _ := ts["pending"].(bool)
	switch {
	case sent == "" && str(ts, "sent_nonce") == "":
		return "NOT SENT"
	case ts["lastNack"] != nil && acked != sent && !pending:
		return "NACKED"
	case pending:
		return "STALE"
	case acked == sent:
		return "SYNCED"
	}
	return "STALE"
}

// shortType trims a type URL to its message name.
func shortType(url string) string {
	url = strings.TrimPrefix(url, "type.googleapis.com/")
	if i := strings.LastIndexByte(url, '.'); i >= 0 && i < len(url)-1 {
		return url[i+1:]
	}
	return url
}

// str returns m[key] rendered as a string ("" when absent or null).
func str(m map[string]any, key string) string {
	switch v := m[key].(type) {
	case nil:
		return ""
	case string:
		return v
	case float64, bool, json.Number:
		return fmt.Sprint(v)
	default:
		b, _ := json.Marshal(v)
		return string(b)
	}
}
