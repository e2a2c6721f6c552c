package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/yaml"

	"github.com/isthmus-mesh/isthmus/internal/cmdutil"
	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/internal/spiffe"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
)

// createRemoteSecretConfig holds the flags of create-remote-secret.
type createRemoteSecretConfig struct {
	// Kubeconfig and Context select the remote cluster (default: the
	// standard kubeconfig loading rules and its current context).
	Kubeconfig string
	Context    string
	// Name is the remote cluster's ID: the Secret's key.
	Name string
	// Namespace is the control-plane namespace: where the reader
	// ServiceAccount lives in the remote and the Secret in the primary.
	Namespace string
	// GatewayNamespaces are where pilot may deploy east-west gateways in
	// the remote (default: Namespace).
	GatewayNamespaces []string
	// Network, when set, annotates the Secret with the cluster's default
	// network.
	Network string
	// TrustDomain, when set, annotates the Secret with the SPIFFE trust
	// domain of the cluster's identities (docs/trust-domains.md).
	TrustDomain string
	// Server overrides the API server URL written into the kubeconfig
	// (default: the remote kubeconfig's server).
	Server string
	// Apply writes the Secret to the primary instead of printing it.
	Apply             bool
	PrimaryKubeconfig string
	PrimaryContext    string
	// TokenWait bounds the wait for the token controller before the
	// TokenRequest API is used.
	TokenWait time.Duration
	// Timeout bounds the whole command.
	Timeout time.Duration
	// Rotate replaces the token of an existing remote Secret: a new token,
	// the Secret updated, pilot synced with it, then the old token revoked
	// (remotesecret_rotate.go). Needs Apply.
	Rotate bool
	// Pilot is the base URL of pilot's debug server, and PilotTimeout
	// bounds each request to it (the root command's --pilot and
	// --request-timeout).
	Pilot        string
	PilotTimeout time.Duration
}

func newCreateRemoteSecretCommand(logger func() *slog.Logger) *cobra.Command {
	cfg := &createRemoteSecretConfig{}
	cmd := &cobra.Command{
		Use:   "create-remote-secret",
		Short: "Create pilot's reader identity in a remote cluster and print (or apply) the remote Secret",
		Long: `Creates the reader ServiceAccount, ClusterRole and binding that pilot needs in
the remote cluster, with the admission policy confining its EndpointSlice writes
to imported ones (or adopts those of the remote chart), issues a token for
it, and renders the remote Secret: label istio/multiCluster=true, key = the
cluster ID, value = a kubeconfig with the remote's server, its CA inline and
the token. The Secret is printed as YAML on stdout, or with --apply created
or updated in the primary cluster. The token appears nowhere else.

With --rotate (and --apply) the existing remote Secret gets a new token:
a new token Secret is made for the reader in the remote cluster, the remote
Secret is updated, the command waits until pilot (--pilot) serves the
cluster with it (make-before-break: the old credential serves until then),
and only then revokes the old token by deleting its token Secret.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if f := cmd.Flag("pilot"); f != nil {
				cfg.Pilot = f.Value.String()
			}
			if f := cmd.Flag("request-timeout"); f != nil {
				cfg.PilotTimeout, _ = time.ParseDuration(f.Value.String())
			}
			return createRemoteSecret(cmd.Context(), *cfg, cmd.OutOrStdout(), logger())
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.Kubeconfig, "kubeconfig", "", "kubeconfig of the remote cluster (default: $KUBECONFIG or ~/.kube/config)")
	f.StringVar(&cfg.Context, "context", "", "context of the remote cluster in --kubeconfig (default: its current context)")
	f.StringVar(&cfg.Name, "name", "", "ID of the remote cluster (a DNS-1123 label); required")
	f.StringVar(&cfg.Namespace, "namespace", defaults.Namespace, "control-plane namespace, in the remote and in the primary")
	f.StringSliceVar(&cfg.GatewayNamespaces, "gateway-namespaces", nil,
		"namespaces of the remote where pilot may deploy east-west gateways from Gateways (a Role in each; default: --namespace); pilot's trusted gateway namespaces")
	f.StringVar(&cfg.Network, "network", "", "default network of the remote cluster's workloads (annotation topology.istio.io/network)")
	f.StringVar(&cfg.TrustDomain, "trust-domain", "", "trust domain of the remote cluster's identities, when not the mesh's (annotation security.isthmus.io/trust-domain; see docs/trust-domains.md)")
	f.StringVar(&cfg.Server, "server", "", "API server URL pilot should use (default: the server in --kubeconfig)")
	f.BoolVar(&cfg.Apply, "apply", false, "create or update the Secret in the primary cluster instead of printing it")
	f.StringVar(&cfg.PrimaryKubeconfig, "primary-kubeconfig", "", "kubeconfig of the primary cluster, with --apply")
	f.StringVar(&cfg.PrimaryContext, "primary-context", "", "context of the primary cluster, with --apply")
	f.DurationVar(&cfg.TokenWait, "token-wait", 5*time.Second, "how long to wait for the token controller before using the TokenRequest API")
	f.DurationVar(&cfg.Timeout, "timeout", time.Minute, "timeout of the whole command")
	f.BoolVar(&cfg.Rotate, "rotate", false,
		"replace the token of the existing remote Secret: new token, Secret updated, wait until pilot (--pilot) has synced the cluster with it, then revoke the old token; needs --apply")
	_ = cmd.MarkFlagRequired("name")
	return cmd
}

// createRemoteSecret runs create-remote-secret with cfg.
func createRemoteSecret(ctx context.Context, cfg createRemoteSecretConfig, out io.Writer, log *slog.Logger) error {
	if err := cfg.validate(); err != nil {
		return err
	}
	if cfg.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, cfg.Timeout)
		defer cancel()
	}

	if cfg.Rotate {
		return rotateRemoteSecret(ctx, cfg, out, log)
	}
	remote, secret, _, err := readerSecret(ctx, cfg, log, func(ctx context.Context, c kubernetes.Interface, opts remotesecret.ReaderOptions) (remotesecret.Token, error) {
		tok, err := remotesecret.EnsureReader(ctx, c, opts)
		return remotesecret.Token{Value: tok}, err
	})
	if err != nil {
		return err
	}

	if !cfg.Apply {
		b, err := secretYAML(secret)
		if err != nil {
			return err
		}
		_, err = out.Write(b)
		return err
	}
	primary, pc, err := primaryClient(cfg, remote)
	if err != nil {
		return err
	}
	verb, _, err := applySecret(ctx, pc, secret)
	if err != nil {
		return fmt.Errorf("write Secret %s/%s to the primary cluster: %w", secret.Namespace, secret.Name, err)
	}
	_, err = fmt.Fprintf(out, "secret/%s %s in namespace %s of the primary cluster (%s)\n", secret.Name, verb, secret.Namespace, primary.Host)
	return err
}

// primaryClient returns the primary cluster's configuration and client,
// refusing the remote's own API server.
func primaryClient(cfg createRemoteSecretConfig, remote *rest.Config) (*rest.Config, kubernetes.Interface, error) {
	primary, err := cmdutil.RestConfig(cfg.PrimaryKubeconfig, cfg.PrimaryContext)
	if err != nil {
		return nil, nil, fmt.Errorf("primary cluster: %w", err)
	}
	if primary.Host == remote.Host {
		return nil, nil, fmt.Errorf("the primary and the remote are the same API server (%s): a cluster is not its own remote", primary.Host)
	}
	pc, err := kubernetes.NewForConfig(primary)
	if err != nil {
		return nil, nil, fmt.Errorf("primary cluster client: %w", err)
	}
	return primary, pc, nil
}

// validate checks the flags before anything is read or written.
func (cfg createRemoteSecretConfig) validate() error {
	if errs := validation.IsDNS1123Label(cfg.Name); len(errs) > 0 {
		return fmt.Errorf("--name %q is not a valid cluster ID: %s", cfg.Name, strings.Join(errs, "; "))
	}
	if cfg.TrustDomain != "" {
		if err := spiffe.ValidateTrustDomain(cfg.TrustDomain); err != nil {
			return fmt.Errorf("--trust-domain: %w", err)
		}
	}
	if !cfg.Apply && (cfg.PrimaryKubeconfig != "" || cfg.PrimaryContext != "") {
		return errors.New("--primary-kubeconfig and --primary-context need --apply")
	}
	if cfg.Rotate && !cfg.Apply {
		return errors.New("--rotate needs --apply: it updates the remote Secret in the primary and revokes the old token")
	}
	if cfg.Apply && cfg.PrimaryKubeconfig == "" && cfg.PrimaryContext == "" {
		return errors.New("--apply needs --primary-kubeconfig or --primary-context: name the primary cluster explicitly")
	}
	return nil
}

// mintFunc makes the reader identity in the remote cluster and issues a
// token for it.
type mintFunc func(ctx context.Context, c kubernetes.Interface, opts remotesecret.ReaderOptions) (remotesecret.Token, error)

// readerSecret makes the reader identity in the remote cluster with mint
// and returns the remote's client configuration, the Secret that registers
// it, and a client of the remote.
func readerSecret(ctx context.Context, cfg createRemoteSecretConfig, log *slog.Logger, mint mintFunc) (*rest.Config, *corev1.Secret, kubernetes.Interface, error) {
	remote, err := cmdutil.RestConfig(cfg.Kubeconfig, cfg.Context)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("remote cluster: %w", err)
	}
	server := cfg.Server
	if server == "" {
		server = remote.Host
	}
	if _, err := url.Parse(server); err != nil || server == "" {
		return nil, nil, nil, fmt.Errorf("remote API server URL %q: invalid", server)
	}
	ca, err := caData(remote)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("remote cluster: %w", err)
	}
	if len(ca) == 0 && strings.HasPrefix(server, "https://") {
		log.Warn("the remote kubeconfig has no CA; pilot will verify the API server with its system roots", "server", server)
	}

	client, err := kubernetes.NewForConfig(remote)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("remote cluster client: %w", err)
	}
	log.Debug("creating the reader identity", "server", remote.Host, "namespace", cfg.Namespace)
	token, err := mint(ctx, client, remotesecret.ReaderOptions{Namespace: cfg.Namespace, TokenWait: cfg.TokenWait, GatewayNamespaces: cfg.GatewayNamespaces})
	if err != nil {
		return nil, nil, nil, fmt.Errorf("reader identity in the remote cluster: %w", err)
	}
	kubeconfig, err := remotesecret.Kubeconfig(cfg.Name, server, ca, token.Value)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("render kubeconfig: %w", err)
	}
	secret := remotesecret.Secret(cfg.Name, cfg.Namespace, kubeconfig)
	if cfg.Network != "" {
		secret.Annotations[remotesecret.NetworkAnnotation] = cfg.Network
	}
	if cfg.TrustDomain != "" {
		secret.Annotations[remotesecret.TrustDomainAnnotation] = cfg.TrustDomain
	}
	return remote, secret, client, nil
}

// caData returns the PEM CA of cfg's server, inline or read from its file.
func caData(cfg *rest.Config) ([]byte, error) {
	if len(cfg.CAData) > 0 {
		return cfg.CAData, nil
	}
	if cfg.CAFile == "" {
		return nil, nil
	}
	b, err := os.ReadFile(cfg.CAFile)
	if err != nil {
		return nil, fmt.Errorf("read certificate-authority: %w", err)
	}
	return b, nil
}

// secretYAML renders the Secret as a YAML document for kubectl apply.
func secretYAML(s *corev1.Secret) ([]byte, error) {
	b, err := yaml.Marshal(s)
	if err != nil {
		return nil, fmt.Errorf("encode Secret: %w", err)
	}
	// Drop the empty creationTimestamp client-go types always marshal.
	var m map[string]any
	if err := yaml.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("encode Secret: %w", err)
	}
	if md, ok := m["metadata"].(map[string]any); ok {
		delete(md, "creationTimestamp")
	}
	b, err = yaml.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("encode Secret: %w", err)
	}
	return append([]byte("---\n"), b...), nil
}

// applySecret creates s, or updates the existing Secret's data, labels and
// annotations (keeping others). It returns "created", "updated" or
// "unchanged", and the resourceVersion of the Secret as written.
func applySecret(ctx context.Context, c kubernetes.Interface, s *corev1.Secret) (string, string, error) {
	secrets := c.CoreV1().Secrets(s.Namespace)
	created, err := secrets.Create(ctx, s, metav1.CreateOptions{FieldManager: "isthmusctl"})
	if err == nil {
		return "created", created.ResourceVersion, nil
	}
	if apierrors.IsNotFound(err) {
		return "", "", fmt.Errorf("namespace %s does not exist in the primary (install the base chart): %w", s.Namespace, err)
	}
	if !apierrors.IsAlreadyExists(err) {
		return "", "", err
	}
	cur, err := secrets.Get(ctx, s.Name, metav1.GetOptions{})
	if err != nil {
		return "", "", err
	}
	changed := false
	set := func(m *map[string]string, k, v string) {
		if *m == nil {
			*m = map[string]string{}
		}
		if (*m)[k] != v {
			(*m)[k] = v
			changed = true
		}
	}
	for k, v := range s.Labels {
		set(&cur.Labels, k, v)
	}
	for k, v := range s.Annotations {
		set(&cur.Annotations, k, v)
	}
	for k, v := range s.Data {
		if string(cur.Data[k]) != string(v) {
			changed = true
		}
	}
	if len(cur.Data) != len(s.Data) {
		changed = true
	}
	if !changed {
		return "unchanged", cur.ResourceVersion, nil
	}
	cur.Data = s.Data
	updated, err := secrets.Update(ctx, cur, metav1.UpdateOptions{FieldManager: "isthmusctl"})
	if err != nil {
		return "", "", err
	}
	return "updated", updated.ResourceVersion, nil
}
