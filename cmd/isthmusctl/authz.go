package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"github.com/spf13/cobra"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/isthmus-mesh/isthmus/internal/spiffe"
	securityv1 "github.com/isthmus-mesh/isthmus/pilot/api/security/v1"
	"github.com/isthmus-mesh/isthmus/pilot/policy"
	"github.com/isthmus-mesh/isthmus/ztunnel/authz"
)

// authzCheckConfig holds the flags of `authz check`.
type authzCheckConfig struct {
	// Workload is the destination's uid, <cluster>/<namespace>/<pod>.
	Workload string
	// Source is the caller's principal (Istio's <td>/ns/<ns>/sa/<sa>, or
	// its spiffe:// form); empty with Plaintext, or to list only.
	Source string
	// Plaintext checks a connection without mutual TLS (the inbound
	// plaintext port): PeerAuthentication decides first.
	Plaintext bool
	// SourceIP is the caller's address ("" = unknown, as across networks).
	SourceIP string
	// Address and Port are the destination address (default: the
	// workload's first) and workload port.
	Address string
	Port    uint16
	Output  string
}

func newAuthzCommand(pilot func() *pilotClient) *cobra.Command {
	cmd := &cobra.Command{Use: "authz", Short: "Inspect authorization (AuthorizationPolicy, PeerAuthentication)"}
	cfg := &authzCheckConfig{}
	check := &cobra.Command{
		Use:   "check",
		Short: "Show which policies select a workload and why a source would be allowed or denied (/debug/authz)",
		Long: `Reads from pilot exactly the authorization resources the workload's ztunnel holds for it and
evaluates them with ztunnel's own check. Without --source or --plaintext it lists the policies
that select the workload and its effective PeerAuthentication.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return authzCheck(cmd.Context(), pilot(), *cfg, cmd.OutOrStdout())
		},
	}
	f := check.Flags()
	f.StringVar(&cfg.Workload, "workload", "", "destination workload, <cluster>/<namespace>/<pod> (required)")
	f.StringVar(&cfg.Source, "source", "", "source principal, <trust domain>/ns/<namespace>/sa/<service account>")
	f.BoolVar(&cfg.Plaintext, "plaintext", false, "check a plaintext connection (no identity) to the inbound plaintext port")
	f.StringVar(&cfg.SourceIP, "source-ip", "", "source address (unset: unknown, as for sources behind a gateway)")
	f.StringVar(&cfg.Address, "address", "", "destination address (default: the workload's first)")
	f.Uint16Var(&cfg.Port, "port", 0, "destination workload port (required with --source or --plaintext)")
	f.StringVarP(&cfg.Output, "output", "o", outputTable, "output format: table, json or yaml")
	cmd.AddCommand(check)
	return cmd
}

// authzCheckResult is what `authz check -o json` prints.
type authzCheckResult struct {
	Workload    policy.WorkloadInfo `json:"workload"`
	Connection  *authzConnection    `json:"connection,omitempty"`
	Explanation authz.Explanation   `json:"explanation"`
}

type authzConnection struct {
	Source    string `json:"source,omitempty"`
	Plaintext bool   `json:"plaintext,omitempty"`
	SourceIP  string `json:"sourceIP,omitempty"`
	Address   string `json:"address"`
	Port      uint16 `json:"port"`
}

// authzCheck fetches the workload's resources and explains the decision.
func authzCheck(ctx context.Context, p *pilotClient, cfg authzCheckConfig, out io.Writer) error {
	if err := checkOutput(cfg.Output); err != nil {
		return err
	}
	if cfg.Workload == "" {
		return errors.New("--workload <cluster>/<namespace>/<pod> is required")
	}
	conn, err := authzConn(cfg)
	if err != nil {
		return err
	}
	var wp struct {
		Workload  policy.WorkloadInfo `json:"workload"`
		Resources []json.RawMessage   `json:"resources"`
	}
	if err := p.get(ctx, "/debug/authz?workload="+url.QueryEscape(cfg.Workload), &wp); err != nil {
		if errors.Is(err, errNotServed) {
			return fmt.Errorf("authz check: no workload %s in pilot's registry, or pilot does not serve /debug/authz: %w", cfg.Workload, err)
		}
		return fmt.Errorf("authz check: %w", err)
	}
	res := make([]*securityv1.Authorization, 0, len(wp.Resources))
	for _, r := range wp.Resources {
		a := &securityv1.Authorization{}
		if err := protojson.Unmarshal(r, a); err != nil {
			return fmt.Errorf("authz check: decode resource: %w", err)
		}
		res = append(res, a)
	}
	snap, err := authz.NewSnapshot(res)
	if err != nil {
		return fmt.Errorf("authz check: %w", err)
	}
	result := authzCheckResult{Workload: wp.Workload}
	c := authz.Conn{Workload: wp.Workload.UID, DestinationPort: cfg.Port, Plaintext: cfg.Plaintext}
	if conn != nil {
		c.Peer, c.SourceIP = conn.peer, conn.ip
		c.DestinationIP = conn.addr
		if !c.DestinationIP.IsValid() && len(wp.Workload.Addresses) > 0 {
			c.DestinationIP = wp.Workload.Addresses[0]
		}
		result.Connection = &authzConnection{Source: cfg.Source, Plaintext: cfg.Plaintext, SourceIP: cfg.SourceIP, Address: c.DestinationIP.String(), Port: cfg.Port}
	}
	result.Explanation = snap.Explain(c)
	if cfg.Output != outputTable {
		return printObject(out, cfg.Output, result)
	}
	return printAuthzCheck(out, result)
}

// parsedConn is the connection the flags describe.
type parsedConn struct {
	peer spiffe.Identity
	ip   netip.Addr
	addr netip.Addr
}

// authzConn parses the connection flags; nil when none is to be decided.
func authzConn(cfg authzCheckConfig) (*parsedConn, error) {
	if cfg.Source == "" && !cfg.Plaintext {
		if cfg.SourceIP != "" || cfg.Port != 0 {
			return nil, errors.New("--source-ip and --port describe a connection: give --source or --plaintext too")
		}
		return nil, nil
	}
	if cfg.Source != "" && cfg.Plaintext {
		return nil, errors.New("a plaintext connection has no --source identity")
	}
	if cfg.Port == 0 {
		return nil, errors.New("--port is required to decide a connection")
	}
	c := &parsedConn{}
	if cfg.Source != "" {
		id, err := spiffe.Parse("spiffe://" + strings.TrimPrefix(cfg.Source, "spiffe://"))
		if err != nil {
			return nil, fmt.Errorf("--source %q: want <trust domain>/ns/<namespace>/sa/<service account>: %w", cfg.Source, err)
		}
		c.peer = id
	}
	for _, f := range []struct {
		name, v string
		into    *netip.Addr
	}{{"--source-ip", cfg.SourceIP, &c.ip}, {"--address", cfg.Address, &c.addr}} {
		if f.v == "" {
			continue
		}
		a, err := netip.ParseAddr(f.v)
		if err != nil {
			return nil, fmt.Errorf("%s %q: %w", f.name, f.v, err)
		}
		*f.into = a
	}
	return c, nil
}

func printAuthzCheck(out io.Writer, r authzCheckResult) error {
	ex := r.Explanation
	w := r.Workload
	fmt.Fprintf(out, "Workload:            %s (namespace %s, cluster %s, node %s)\n", w.UID, w.Namespace, w.Cluster, w.Node)
	if !w.Enforced {
		fmt.Fprintln(out, "                     not enforced by a node ztunnel (hostNetwork, or an address without a pod)")
	}
	pa := ex.PeerAuthentication.Mode
	if len(ex.PeerAuthentication.Sources) == 0 {
		pa += " (default)"
	} else {
		pa += " (from " + strings.Join(ex.PeerAuthentication.Sources, ", ") + ")"
	}
	if r.Connection != nil {
		pa += " for port " + strconv.Itoa(int(r.Connection.Port))
	}
	fmt.Fprintf(out, "PeerAuthentication:  %s\n\n", pa)
	cols := []string{"POLICY", "ACTION", "SCOPE", "SELECTOR"}
	if r.Connection != nil {
		cols = append(cols, "MATCHED")
	}
	t := newTable(out, append(cols, "NOT ENFORCED AS WRITTEN")...)
	for _, p := range ex.Policies {
		row := []string{p.Namespace + "/" + p.Name, p.Action, p.Scope, selectorString(p.Selector)}
		if r.Connection != nil {
			m := "no"
			if p.Matched {
				m = fmt.Sprintf("yes (rule %d)", p.Rule)
			}
			row = append(row, m)
		}
		t.row(append(row, problems(p.Problems))...)
	}
	if err := t.flush(); err != nil {
		return err
	}
	if len(ex.Policies) == 0 {
		fmt.Fprintln(out, "(no AuthorizationPolicy selects this workload)")
	}
	if r.Connection != nil {
		fmt.Fprintf(out, "\nDecision:            %s\n", decision(ex.Decision))
	}
	return nil
}

func selectorString(m map[string]string) string {
	if len(m) == 0 {
		return "-"
	}
	parts := make([]string, 0, len(m))
	for k, v := range m {
		parts = append(parts, k+"="+v)
	}
	slices.Sort(parts)
	return strings.Join(parts, ",")
}

func problems(ps []authz.Problem) string {
	if len(ps) == 0 {
		return "-"
	}
	parts := make([]string, 0, len(ps))
	for _, p := range ps {
		parts = append(parts, p.Field+" ("+p.Reason+")")
	}
	return strings.Join(parts, "; ")
}

func decision(d authz.Decision) string {
	if d.Allowed {
		if d.Policy() != "" {
			return "ALLOWED by " + d.Policy()
		}
		return "ALLOWED (no ALLOW policy applies, no DENY policy matches)"
	}
	switch d.Reason {
	case authz.ReasonDenyPolicy:
		return "DENIED by " + d.Policy() + " (deny_policy)"
	case authz.ReasonAllowUnmatched:
		return "DENIED: ALLOW policies apply and none matches (allow_unmatched)"
	case authz.ReasonMTLSRequired:
		if d.Policy() != "" {
			return "DENIED: mutual TLS required by " + d.Policy() + " (mtls_required)"
		}
		return "DENIED: mutual TLS required, STRICT by default (mtls_required)"
	default:
		return "DENIED (" + d.Reason + ")"
	}
}
