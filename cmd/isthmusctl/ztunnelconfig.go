package main

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/isthmus-mesh/isthmus/internal/cmdutil"
	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/ztunnel/admin"
)

// ztunnelConfigConfig holds the flags of ztunnel-config.
type ztunnelConfigConfig struct {
	// Kubeconfig and Context select the cluster of the ztunnel.
	Kubeconfig, Context string
	// Namespace and Selector find ztunnel pods; Pod names one, Node picks
	// the one on a node. Neither: the first running one by name.
	Namespace, Selector, Pod, Node string
	// AdminPort is the ztunnel's admin port (15000).
	AdminPort uint16
	// Timeout bounds the whole command.
	Timeout time.Duration
	Output  string
}

// ztunnelConfigDeps are what ztunnel-config reaches the cluster with.
type ztunnelConfigDeps struct {
	// RestConfig returns the cluster's config (default: from the flags).
	RestConfig func() (*rest.Config, error)
	// Dialer reaches the pod's admin port (default: port-forward through
	// the API server).
	Dialer func(*rest.Config) podDialer
	Log    *slog.Logger
}

// ztunnelSections are the subcommands: what each reads and prints.
var ztunnelSections = []struct {
	use, short string
	print      func(out io.Writer, format string, d *ztunnelDump) error
}{
	{"workloads", "Workloads the ztunnel knows: pods, and the split-horizon workloads of remote networks with their gateways", printWorkloads},
	{"services", "Services the ztunnel knows, with their addresses, ports and endpoint counts", printServices},
	{"policies", "Authorization resources the ztunnel holds (policies and workload bindings)", printPolicies},
	{"certificates", "Certificates the ztunnel holds: identity, serial, validity (never keys)", printCertificates},
	{"connections", "Connections the ztunnel carries now", printConnections},
}

func newZtunnelConfigCommand(logger func() *slog.Logger, dialer func(*rest.Config) podDialer) *cobra.Command {
	cfg := &ztunnelConfigConfig{}
	cmd := &cobra.Command{
		Use:   "ztunnel-config",
		Short: "Show the state of one ztunnel (workloads, services, policies, certificates, connections) from its admin endpoint",
		Long: `Reads one ztunnel's admin endpoint (/config_dump, /connections on port 15000,
which listens on the pod's loopback only) through the API server: the command
port-forwards to the pod itself, as kubectl port-forward does.

The ztunnel is the pod given as argument (<name> or <name>.<namespace>), else
the one on --node, else the first running pod matching --selector in
--namespace.`,
	}
	f := cmd.PersistentFlags()
	f.StringVar(&cfg.Kubeconfig, "kubeconfig", "", "kubeconfig of the ztunnel's cluster (default: $KUBECONFIG or ~/.kube/config)")
	f.StringVar(&cfg.Context, "context", "", "context in --kubeconfig (default: its current context)")
	f.StringVarP(&cfg.Namespace, "namespace", "n", defaults.Namespace, "namespace of the ztunnel pods")
	f.StringVarP(&cfg.Selector, "selector", "l", "app=ztunnel", "label selector of the ztunnel pods")
	f.StringVar(&cfg.Node, "node", "", "the ztunnel of this node")
	f.Uint16Var(&cfg.AdminPort, "admin-port", defaults.AdminPort, "the ztunnel's admin port")
	f.DurationVar(&cfg.Timeout, "timeout", 30*time.Second, "time allowed for the whole command")
	f.StringVarP(&cfg.Output, "output", "o", outputTable, "output format: table, json or yaml")
	for _, sec := range ztunnelSections {
		cmd.AddCommand(&cobra.Command{
			Use:   sec.use + " [pod]",
			Short: sec.short,
			Args:  cobra.MaximumNArgs(1),
			RunE: func(cmd *cobra.Command, args []string) error {
				c := *cfg
				if len(args) == 1 {
					c.Pod = args[0]
				}
				deps := ztunnelConfigDeps{Log: logger(), Dialer: dialer}
				return ztunnelConfig(cmd.Context(), c, deps, cmd.OutOrStdout(), sec.print)
			},
		})
	}
	return cmd
}

// ztunnelDump is what the admin endpoint serves.
type ztunnelDump struct {
	Pod         *corev1.Pod
	Config      admin.ConfigDump
	Connections admin.Connections
	Now         time.Time
}

// ztunnelConfig finds the ztunnel pod, reads its admin endpoint and
// prints one section of it.
func ztunnelConfig(ctx context.Context, cfg ztunnelConfigConfig, deps ztunnelConfigDeps, out io.Writer, print func(io.Writer, string, *ztunnelDump) error) error {
	if err := checkOutput(cfg.Output); err != nil {
		return err
	}
	if deps.RestConfig == nil {
		deps.RestConfig = func() (*rest.Config, error) { return cmdutil.RestConfig(cfg.Kubeconfig, cfg.Context) }
	}
	if deps.Dialer == nil {
		deps.Dialer = func(rc *rest.Config) podDialer { return portForwardDialer{cfg: rc, log: deps.Log} }
	}
	if deps.Log == nil {
		deps.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, cfg.Timeout)
		defer cancel()
	}
	rc, err := deps.RestConfig()
	if err != nil {
		return err
	}
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return fmt.Errorf("kubernetes client: %w", err)
	}
	pod, err := findZtunnel(ctx, client, cfg)
	if err != nil {
		return err
	}
	deps.Log.Debug("reading ztunnel", "pod", pod.Namespace+"/"+pod.Name, "node", pod.Spec.NodeName)
	dial, stop, err := deps.Dialer(rc).open(ctx, pod, cfg.AdminPort)
	if err != nil {
		return err
	}
	defer stop()
	a := &adminClient{dial: dial, what: fmt.Sprintf("ztunnel %s/%s admin", pod.Namespace, pod.Name)}
	defer a.close()
	d := &ztunnelDump{Pod: pod, Now: time.Now()}
	if err := a.get(ctx, "/config_dump", &d.Config); err != nil {
		return err
	}
	if err := a.get(ctx, "/connections", &d.Connections); err != nil {
		return err
	}
	return print(out, cfg.Output, d)
}

// findZtunnel returns the pod cfg names, or the one on cfg.Node, or the
// first running one of cfg.Selector by name.
func findZtunnel(ctx context.Context, c kubernetes.Interface, cfg ztunnelConfigConfig) (*corev1.Pod, error) {
	if cfg.Pod != "" {
		name, ns := cfg.Pod, cfg.Namespace
		if n, s, ok := strings.Cut(cfg.Pod, "."); ok {
			name, ns = n, s
		}
		pod, err := c.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("ztunnel pod %s/%s: %w", ns, name, err)
		}
		return pod, nil
	}
	pods, err := runningPods(ctx, c, "ztunnel", cfg.Namespace, cfg.Selector, cfg.Node)
	if err != nil {
		return nil, err
	}
	return &pods[0], nil
}

// runningPods returns the running pods of what (ztunnel, pilot) that
// selector finds in namespace, on node unless it is empty, sorted by name;
// none is an error.
func runningPods(ctx context.Context, c kubernetes.Interface, what, namespace, selector, node string) ([]corev1.Pod, error) {
	list, err := c.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{LabelSelector: selector})
	if err != nil {
		return nil, fmt.Errorf("list %s pods (%s in %s): %w", what, selector, namespace, err)
	}
	pods := slices.DeleteFunc(list.Items, func(p corev1.Pod) bool {
		return p.Status.Phase != corev1.PodRunning || (node != "" && p.Spec.NodeName != node)
	})
	if len(pods) == 0 {
		where := ""
		if node != "" {
			where = " on node " + node
		}
		return nil, fmt.Errorf("no running %s pod (%s) in namespace %s%s", what, selector, namespace, where)
	}
	slices.SortFunc(pods, func(a, b corev1.Pod) int { return cmp.Compare(a.Name, b.Name) })
	return pods, nil
}

// adminClient reads JSON from a ztunnel's admin endpoint over dial.
type adminClient struct {
	dial func(context.Context) (net.Conn, error)
	what string
	hc   *http.Client
}

func (a *adminClient) client() *http.Client {
	if a.hc == nil {
		a.hc = &http.Client{Transport: &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) { return a.dial(ctx) },
		}}
	}
	return a.hc
}

func (a *adminClient) close() {
	if a.hc != nil {
		a.hc.CloseIdleConnections()
	}
}

// get fetches path and decodes its JSON body into out.
func (a *adminClient) get(ctx context.Context, path string, out any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://ztunnel-admin"+path, nil)
	if err != nil {
		return err
	}
	resp, err := a.client().Do(req)
	if err != nil {
		return fmt.Errorf("%s: GET %s: %w", a.what, path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		if resp.StatusCode == http.StatusNotFound {
			return fmt.Errorf("%s: GET %s: not served (a ztunnel older than this isthmusctl?)", a.what, path)
		}
		return fmt.Errorf("%s: GET %s: %s: %s", a.what, path, resp.Status, strings.TrimSpace(string(msg)))
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return fmt.Errorf("%s: GET %s: decode JSON: %w", a.what, path, err)
	}
	return nil
}
