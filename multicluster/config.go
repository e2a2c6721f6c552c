package multicluster

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/prometheus/client_golang/prometheus"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
)

// Config configures the Controller. The zero value of each field takes the
// default written beside it.
type Config struct {
	// Namespace watched for remote secrets (default "isthmus-system").
	Namespace string
	// ConfigClusterID is the ID of the cluster pilot runs in (default
	// "primary"); a remote secret key equal to it is refused.
	ConfigClusterID model.ClusterID
	// ConfigClusterNetwork is the config cluster's default network.
	ConfigClusterNetwork model.Network
	// SyncTimeout after which a cluster that has not synced is reported
	// timed out (default 30 s).
	SyncTimeout time.Duration
	// AllowedKubeconfigOptions names kubeconfig options that read files or
	// run auth providers which remote kubeconfigs may use (see the Allow*
	// constants). "exec" is refused: exec plugins are allowed one by one
	// in Exec.Allowlist.
	AllowedKubeconfigOptions []string
	// Exec says which exec credential plugins remote kubeconfigs may run
	// and bounds their runs (default timeout 10 s).
	Exec ExecConfig
	// LivenessInterval between probes of each cluster's API server (default 5 s).
	LivenessInterval time.Duration
	// LivenessTimeout bounds one probe (default 5 s).
	LivenessTimeout time.Duration
	// UnreachableAfter consecutive failed probes mark a synced cluster
	// unreachable (default 3).
	UnreachableAfter int
	// RetryBackoff is the first delay before retrying a cluster whose client
	// or components failed to build; it doubles up to five minutes (default 1 s).
	RetryBackoff time.Duration
	// Registerer receives the controller's metrics (nil: not registered).
	Registerer prometheus.Registerer
	// Logger (default: discards).
	Logger *slog.Logger
	// DiscoverySelectors are the mesh-wide namespace selectors (as Istio's
	// MeshConfig discoverySelectors: OR-ed; none selects every namespace).
	// A remote Secret's discovery-selectors annotation replaces them for
	// its clusters. Handed to components in Cluster.Namespaces.
	DiscoverySelectors []metav1.LabelSelector
	// RecordEvents reports whether this replica writes Events on remote
	// Secrets (nil: always). With several replicas only the leader does, so
	// that every transition is one Event.
	RecordEvents func() bool
}

// withDefaults fills what c leaves empty.
func (c Config) withDefaults() Config {
	if c.Namespace == "" {
		c.Namespace = defaults.Namespace
	}
	if c.ConfigClusterID == "" {
		c.ConfigClusterID = "primary"
	}
	if c.SyncTimeout == 0 {
		c.SyncTimeout = 30 * time.Second
	}
	if c.LivenessInterval == 0 {
		c.LivenessInterval = 5 * time.Second
	}
	if c.LivenessTimeout == 0 {
		c.LivenessTimeout = 5 * time.Second
	}
	if c.UnreachableAfter == 0 {
		c.UnreachableAfter = 3
	}
	if c.RetryBackoff == 0 {
		c.RetryBackoff = time.Second
	}
	if c.Exec.Timeout == 0 {
		c.Exec.Timeout = 10 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

// validate rejects what withDefaults cannot fix.
func (c Config) validate() error {
	if errs := validation.IsDNS1123Label(string(c.ConfigClusterID)); len(errs) > 0 {
		return fmt.Errorf("config cluster ID %q: %v", c.ConfigClusterID, errs)
	}
	if c.Exec.Timeout < 0 {
		return fmt.Errorf("exec timeout %s is negative", c.Exec.Timeout)
	}
	return errors.Join(validateKubeconfigOptions(c.AllowedKubeconfigOptions), validateExecRules(c.Exec.Allowlist),
		ValidateDiscoverySelectors(c.DiscoverySelectors))
}
