package ca

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/kubernetes"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/internal/spiffe"
)

// Defaults applied by Config.withDefaults; exported so cmd/ can show them in flag help.
const (
	DefaultNamespace        = defaults.Namespace
	DefaultTrustDomain      = defaults.TrustDomain
	DefaultSelfSignedSecret = "isthmus-ca-secret"
	DefaultPluginSecret     = "cacerts"
	DefaultRootConfigMap    = "isthmus-ca-root-cert"
	DefaultTTL              = 24 * time.Hour
	DefaultMaxTTL           = 90 * 24 * time.Hour
	DefaultRootTTL          = 10 * 365 * 24 * time.Hour
	DefaultServingTTL       = 24 * time.Hour
	DefaultReviewTimeout    = 10 * time.Second
	DefaultReviewCacheTTL   = 30 * time.Second
	DefaultReviewRate       = 50
	DefaultReviewBurst      = 100
	// Per source address and per claimed ServiceAccount: well under the cluster's, so that a
	// few sources or one account cannot spend it. A ztunnel reviews one token per rotation
	// (its verdict is cached), so these are far above what honest callers use.
	DefaultReviewSourceRate   = 5
	DefaultReviewSourceBurst  = 10
	DefaultReviewAccountRate  = 10
	DefaultReviewAccountBurst = 20
)

// RootCertKey is the key of the root bundle in the published ConfigMap and in the CA Secrets.
const RootCertKey = "root-cert.pem"

// TrustBundleKey is the key of the root ConfigMap holding the trust bundle:
// every trusted trust domain with its own roots, as a SPIFFE trust bundle
// map (JSON). ztunnel verifies peers against it (--trust-bundle).
const TrustBundleKey = "trust-bundle.json"

// Config holds the CA's settings. The zero value of every field means "use the default".
type Config struct {
	// ClusterID is the config cluster: where the CA Secrets live, and the cluster a request
	// without "clusterid" metadata is authenticated against. Required.
	ClusterID string
	// Namespace is the control-plane namespace (default isthmus-system).
	Namespace string
	// TrustDomain is the SPIFFE trust domain (default cluster.local).
	TrustDomain string
	// SelfSignedSecret names the Secret holding the generated root and intermediate.
	SelfSignedSecret string
	// PluginSecret names the operator-provided Secret (Istio's "cacerts"); it wins when present.
	PluginSecret string
	// RootConfigMap names the ConfigMap the publishers write the root bundle to.
	RootConfigMap string
	// Audiences are the token audiences accepted (default Istio's ["istio-ca"]).
	Audiences []string
	// TrustedNodeAccounts are the "namespace/serviceaccount" pairs allowed to impersonate
	// (default "<Namespace>/ztunnel"). Use NoTrustedNodeAccounts to allow none.
	TrustedNodeAccounts []string
	// NoTrustedNodeAccounts turns impersonation off entirely.
	NoTrustedNodeAccounts bool
	// DefaultTTL is the leaf lifetime when a request asks for none (default 24 h).
	DefaultTTL time.Duration
	// MaxTTL caps the lifetime a request may ask for (default 90 days).
	MaxTTL time.Duration
	// RootTTL is the lifetime of a generated root and intermediate (default 10 years).
	RootTTL time.Duration
	// ServingSANs are the DNS names (or IP literals) of the control plane's own serving
	// certificate (default isthmusd.<Namespace>.svc).
	ServingSANs []string
	// ServingTTL is the lifetime of the serving certificate (default 24 h).
	ServingTTL time.Duration
	// ReviewTimeout bounds one TokenReview or pod lookup (default 10 s).
	ReviewTimeout time.Duration
	// ReviewCacheTTL is how long a TokenReview's verdict on a token is
	// reused (default 30 s; never past the token's expiry; refusals are
	// kept a sixth of it). Negative turns the cache off.
	ReviewCacheTTL time.Duration
	// ReviewRate and ReviewBurst bound the TokenReviews sent to one
	// cluster's API server (defaults 50 per second, bursts of 100): past
	// them a request is refused as review_rate_limited, so unauthenticated
	// callers cannot turn pilot into a load generator against a cluster.
	ReviewRate  float64
	ReviewBurst int
	// ReviewSourceRate and ReviewSourceBurst bound the TokenReviews asked
	// for from one source address (IPv4 address or IPv6 /64; defaults 5
	// per second, bursts of 10); past them a request is refused as
	// review_rate_limited_source.
	ReviewSourceRate  float64
	ReviewSourceBurst int
	// ReviewAccountRate and ReviewAccountBurst bound the TokenReviews of
	// tokens claiming one ServiceAccount of one cluster (defaults 10 per
	// second, bursts of 20); past them: review_rate_limited_account.
	ReviewAccountRate  float64
	ReviewAccountBurst int
}

// withDefaults returns cfg with every unset field given its default; it is the only place
// defaults are decided.
func (cfg Config) withDefaults() Config {
	if cfg.Namespace == "" {
		cfg.Namespace = DefaultNamespace
	}
	if cfg.TrustDomain == "" {
		cfg.TrustDomain = DefaultTrustDomain
	}
	if cfg.SelfSignedSecret == "" {
		cfg.SelfSignedSecret = DefaultSelfSignedSecret
	}
	if cfg.PluginSecret == "" {
		cfg.PluginSecret = DefaultPluginSecret
	}
	if cfg.RootConfigMap == "" {
		cfg.RootConfigMap = DefaultRootConfigMap
	}
	if len(cfg.Audiences) == 0 {
		cfg.Audiences = []string{"istio-ca"}
	}
	if len(cfg.TrustedNodeAccounts) == 0 && !cfg.NoTrustedNodeAccounts {
		cfg.TrustedNodeAccounts = []string{cfg.Namespace + "/ztunnel"}
	}
	if cfg.NoTrustedNodeAccounts {
		cfg.TrustedNodeAccounts = nil
	}
	if cfg.DefaultTTL <= 0 {
		cfg.DefaultTTL = DefaultTTL
	}
	if cfg.MaxTTL <= 0 {
		cfg.MaxTTL = DefaultMaxTTL
	}
	if cfg.RootTTL <= 0 {
		cfg.RootTTL = DefaultRootTTL
	}
	if len(cfg.ServingSANs) == 0 {
		cfg.ServingSANs = []string{"isthmusd." + cfg.Namespace + ".svc"}
	}
	if cfg.ServingTTL <= 0 {
		cfg.ServingTTL = DefaultServingTTL
	}
	if cfg.ReviewTimeout <= 0 {
		cfg.ReviewTimeout = DefaultReviewTimeout
	}
	if cfg.ReviewCacheTTL == 0 {
		cfg.ReviewCacheTTL = DefaultReviewCacheTTL
	}
	if cfg.ReviewRate <= 0 {
		cfg.ReviewRate = DefaultReviewRate
	}
	if cfg.ReviewBurst <= 0 {
		cfg.ReviewBurst = DefaultReviewBurst
	}
	if cfg.ReviewSourceRate <= 0 {
		cfg.ReviewSourceRate = DefaultReviewSourceRate
	}
	if cfg.ReviewSourceBurst <= 0 {
		cfg.ReviewSourceBurst = DefaultReviewSourceBurst
	}
	if cfg.ReviewAccountRate <= 0 {
		cfg.ReviewAccountRate = DefaultReviewAccountRate
	}
	if cfg.ReviewAccountBurst <= 0 {
		cfg.ReviewAccountBurst = DefaultReviewAccountBurst
	}
	return cfg
}

func (cfg Config) validate() error {
	var errs []error
	if cfg.ClusterID == "" {
		errs = append(errs, errors.New("ClusterID is required"))
	}
	if cfg.DefaultTTL > cfg.MaxTTL {
		errs = append(errs, fmt.Errorf("DefaultTTL %s exceeds MaxTTL %s", cfg.DefaultTTL, cfg.MaxTTL))
	}
	for _, a := range cfg.TrustedNodeAccounts {
		if _, _, err := splitAccount(a); err != nil {
			errs = append(errs, err)
		}
	}
	if err := spiffe.ValidateTrustDomain(cfg.TrustDomain); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// Clusters gives the client of a federated cluster. Implementations must be safe for concurrent
// use; the multicluster controller implements it.
type Clusters interface {
	// KubeClient returns the client of clusterID and true, or false when the cluster is not
	// federated (unknown, removed, or not yet synced).
	KubeClient(clusterID string) (kubernetes.Interface, bool)
}

// NodeIndex tells whether a ServiceAccount has a pod on a node. Implementations must be safe for
// concurrent use; the federated registry implements it.
type NodeIndex interface {
	// ServiceAccountOnNode reports whether a pod of namespace/serviceAccount is scheduled on node
	// in cluster.
	ServiceAccountOnNode(cluster, node, namespace, serviceAccount string) bool
}

// Authenticator turns the credentials of an incoming request into a Caller. It must be safe for
// concurrent use. A refusal should be a *RefusalError so that the reason is counted and the
// right gRPC status reaches the caller; any other error is reported as Unauthenticated.
type Authenticator interface {
	Authenticate(ctx context.Context) (*Caller, error)
}

// Deps are the CA's collaborators. ConfigClient and Clusters are required; the rest have defaults.
type Deps struct {
	// ConfigClient is the config cluster's client: CA Secrets are read and written there.
	ConfigClient kubernetes.Interface
	// Clusters resolves the cluster a caller names; used by the default authenticator and for
	// the caller's pod lookup during impersonation.
	Clusters Clusters
	// Nodes answers impersonation checks; without it every impersonation is refused.
	Nodes NodeIndex
	// Authenticator replaces the TokenReview authenticator (benchmarks, other credential kinds).
	Authenticator Authenticator
	// Logger defaults to a logger that discards.
	Logger *slog.Logger
	// Registerer receives the CA's metrics; nil keeps them in a private registry.
	Registerer prometheus.Registerer
	// Now is the clock (default time.Now).
	Now func() time.Time
	// Leading reports whether this replica writes shared state: the root
	// publishers write the published roots only while it is true (nil:
	// always). Call CA.Republish when it becomes true.
	Leading func() bool
}
