package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/isthmus-mesh/isthmus/internal/cmdutil"
	"github.com/isthmus-mesh/isthmus/internal/defaults"
)

// proxyStatusConfig holds the flags of proxy-status.
type proxyStatusConfig struct {
	Output string
	// Kubeconfig and Context, when either is set, select the cluster whose
	// pilot pods (Selector in Namespace) are each read through the API
	// server's port-forward to DebugPort, in place of --pilot.
	Kubeconfig, Context string
	Namespace, Selector string
	DebugPort           uint16
}

// podMode reports whether proxy-status reads the pilot pods of a cluster.
func (c proxyStatusConfig) podMode() bool { return c.Kubeconfig != "" || c.Context != "" }

// proxyStatusDeps are what proxy-status reaches pilot pods with (tests
// replace the port-forward).
type proxyStatusDeps struct {
	RestConfig func() (*rest.Config, error)
	Dialer     func(*rest.Config) podDialer
	Log        *slog.Logger
	// Timeout bounds each request to a pilot.
	Timeout time.Duration
}

func newProxyStatusCommand(pilot func() *pilotClient, logger func() *slog.Logger, dialer func(*rest.Config) podDialer, timeout func() time.Duration) *cobra.Command {
	cfg := &proxyStatusConfig{}
	cmd := &cobra.Command{
		Use:   "proxy-status",
		Short: "Show the xDS clients connected to pilot and what each has acknowledged (/debug/syncz)",
		Long: `Reads pilot's /debug/syncz: one row per connected xDS client and type URL.

By default the pilot at --pilot is read. With --kubeconfig or --context, every
running pilot pod of that cluster is read through the API server (the command
port-forwards to each pod's debug port, which listens on the pod's loopback
only), and a PILOT column says which replica each client streams from.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			deps := proxyStatusDeps{Log: logger(), Dialer: dialer, Timeout: timeout()}
			return proxyStatus(cmd.Context(), pilot(), *cfg, deps, cmd.OutOrStdout())
		},
	}
	f := cmd.Flags()
	f.StringVarP(&cfg.Output, "output", "o", outputTable, "output format: table, json or yaml")
	f.StringVar(&cfg.Kubeconfig, "kubeconfig", "", "kubeconfig of pilot's cluster: read every pilot pod in place of --pilot")
	f.StringVar(&cfg.Context, "context", "", "context in the kubeconfig ($KUBECONFIG or ~/.kube/config without --kubeconfig): read every pilot pod")
	f.StringVarP(&cfg.Namespace, "namespace", "n", defaults.Namespace, "namespace of the pilot pods")
	f.StringVarP(&cfg.Selector, "selector", "l", "app=isthmusd", "label selector of the pilot pods")
	f.Uint16Var(&cfg.DebugPort, "debug-port", 8080, "pilot's debug port in its pods (--debug-addr)")
	return cmd
}

// proxyStatus prints one row per connected client and type URL. The
// /debug/syncz document is decoded generically (a list of objects), so
// fields it gains or loses do not break isthmusctl. In pod mode each
// client gains a "pilot" field, the pod it streams from; a pilot pod that
// cannot be read is named in the error, after the others are printed.
func proxyStatus(ctx context.Context, p *pilotClient, cfg proxyStatusConfig, deps proxyStatusDeps, out io.Writer) error {
	if err := checkOutput(cfg.Output); err != nil {
		return err
	}
	var clients []map[string]any
	var readErr error
	if cfg.podMode() {
		clients, readErr = pilotPodsSyncz(ctx, cfg, deps)
		if clients == nil {
			return readErr
		}
	} else if err := p.get(ctx, "/debug/syncz", &clients); err != nil {
		return fmt.Errorf("xDS clients: %w", err)
	}
	if cfg.Output != outputTable {
		return errors.Join(printObject(out, cfg.Output, clients), readErr)
	}
	slices.SortStableFunc(clients, func(a, b map[string]any) int {
		return cmp.Or(cmp.Compare(str(a, "nodeId"), str(b, "nodeId")), cmp.Compare(str(a, "pilot"), str(b, "pilot")))
	})
	head := []string{"NODE ID", "CLUSTER", "NETWORK", "PROTOCOL", "TYPE", "SENT", "ACKED", "STATUS"}
	if cfg.podMode() {
		head = slices.Insert(head, 1, "PILOT")
	}
	t := newTable(out, head...)
	row := func(c map[string]any, cells ...string) {
		cells = append([]string{str(c, "nodeId")}, cells...)
		if cfg.podMode() {
			cells = slices.Insert(cells, 1, str(c, "pilot"))
		}
		t.row(cells...)
	}
	for _, c := range clients {
		types, _ := c["types"].(map[string]any)
		if len(types) == 0 {
			row(c, str(c, "cluster"), str(c, "network"), str(c, "protocol"), "", "", "", "CONNECTED")
			continue
		}
		for _, url := range slices.Sorted(maps.Keys(types)) {
			ts, _ := types[url].(map[string]any)
			row(c, str(c, "cluster"), str(c, "network"), str(c, "protocol"),
				shortType(url), str(ts, "sentVersion"), str(ts, "ackedVersion"), syncState(ts))
		}
	}
	return errors.Join(t.flush(), readErr)
}

// pilotPodsSyncz reads /debug/syncz of every running pilot pod and tags
// each client with its pod's name. It returns what it could read (nil if
// nothing) and an error naming each pod it could not.
func pilotPodsSyncz(ctx context.Context, cfg proxyStatusConfig, deps proxyStatusDeps) ([]map[string]any, error) {
	if deps.RestConfig == nil {
		deps.RestConfig = func() (*rest.Config, error) { return cmdutil.RestConfig(cfg.Kubeconfig, cfg.Context) }
	}
	if deps.Log == nil {
		deps.Log = slog.New(slog.DiscardHandler)
	}
	if deps.Dialer == nil {
		deps.Dialer = func(rc *rest.Config) podDialer { return portForwardDialer{cfg: rc, log: deps.Log} }
	}
	rc, err := deps.RestConfig()
	if err != nil {
		return nil, err
	}
	kc, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	pods, err := runningPods(ctx, kc, "pilot", cfg.Namespace, cfg.Selector, "")
	if err != nil {
		return nil, err
	}
	dialer := deps.Dialer(rc)
	var all []map[string]any
	var errs []error
	for i := range pods {
		clients, err := podSyncz(ctx, dialer, &pods[i], cfg.DebugPort, deps.Timeout)
		if err != nil {
			errs = append(errs, fmt.Errorf("pilot pod %s/%s: %w", pods[i].Namespace, pods[i].Name, err))
			continue
		}
		for _, c := range clients {
			c["pilot"] = pods[i].Name
		}
		all = append(all, clients...)
	}
	if all == nil && len(errs) == 0 {
		all = []map[string]any{}
	}
	return all, errors.Join(errs...)
}

// podSyncz reads one pilot pod's /debug/syncz through dialer.
func podSyncz(ctx context.Context, dialer podDialer, pod *corev1.Pod, port uint16, timeout time.Duration) ([]map[string]any, error) {
	dial, stop, err := dialer.open(ctx, pod, port)
	if err != nil {
		return nil, err
	}
	defer stop()
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) { return dial(ctx) }}
	defer tr.CloseIdleConnections()
	p := &pilotClient{base: "http://" + pod.Name, http: &http.Client{Timeout: timeout, Transport: tr}}
	var clients []map[string]any
	if err := p.get(ctx, "/debug/syncz", &clients); err != nil {
		return nil, err
	}
	return clients, nil
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
