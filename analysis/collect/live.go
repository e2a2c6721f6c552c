package collect

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/rest"

	"github.com/isthmus-mesh/isthmus/analysis"
	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// LiveConfig configures Live. Zero values take the defaults beside them.
type LiveConfig struct {
	// Mesh is the control plane's configuration (Namespace default
	// "isthmus-system", ConfigCluster "primary", TrustDomain "cluster.local").
	Mesh analysis.Mesh
	// ConfigNetwork is the config cluster's default network (pilot's --network).
	ConfigNetwork model.Network
	// AllowedKubeconfigOptions are passed to the sanitizer, as pilot's
	// --allow-kubeconfig-option.
	AllowedKubeconfigOptions []string
	// Timeout bounds the reading of each cluster (default 30 s).
	Timeout time.Duration
	// Parallel clusters are read at once (default 8).
	Parallel int
	// Logger (default: discard).
	Logger *slog.Logger
}

// LiveDeps are Live's dependencies.
type LiveDeps struct {
	// ConfigCluster is an admin configuration of the config cluster.
	ConfigCluster *rest.Config
	// Build makes a remote cluster's client from its sanitized kubeconfig
	// (default multicluster.DefaultClientBuilder).
	Build multicluster.ClientBuilder
}

func (c LiveConfig) withDefaults() LiveConfig {
	c.Mesh = meshDefaults(c.Mesh)
	if c.Timeout == 0 {
		c.Timeout = 30 * time.Second
	}
	if c.Parallel == 0 {
		c.Parallel = 8
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

func (c *LiveConfig) validate(d LiveDeps) error {
	if d.ConfigCluster == nil {
		return errors.New("collect: no config cluster")
	}
	if c.Timeout < 0 || c.Parallel < 0 {
		return errors.New("collect: negative timeout or parallelism")
	}
	return nil
}

func meshDefaults(m analysis.Mesh) analysis.Mesh {
	m.Namespace = cmp.Or(m.Namespace, defaults.Namespace)
	m.ConfigCluster = cmp.Or(m.ConfigCluster, "primary")
	m.TrustDomain = cmp.Or(m.TrustDomain, defaults.TrustDomain)
	return m
}

// Live reads the config cluster and every remote cluster its remote
// Secrets register, each with the kubeconfig pilot would use (sanitized by
// multicluster.SanitizedClient). A cluster ID claimed twice is read with
// the oldest Secret's kubeconfig; IDs pilot refuses (the config cluster's
// own, or not DNS-1123 labels) are not read. A remote that cannot be read
// is reported in Snapshot.Remotes, never as an error: only a config
// cluster that cannot be read is.
func Live(ctx context.Context, cfg LiveConfig, deps LiveDeps) (*analysis.Snapshot, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(deps); err != nil {
		return nil, err
	}
	if deps.Build == nil {
		deps.Build = multicluster.DefaultClientBuilder
	}
	configClient, err := multicluster.NewClient(deps.ConfigCluster)
	if err != nil {
		return nil, fmt.Errorf("config cluster client: %w", err)
	}
	defer configClient.Close()

	snap := &analysis.Snapshot{Mesh: cfg.Mesh}
	home := &analysis.Cluster{ID: cfg.Mesh.ConfigCluster, Network: cfg.ConfigNetwork}
	rctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	secrets, err := remoteSecrets(rctx, configClient, cfg.Mesh.Namespace)
	if err == nil {
		readCluster(rctx, configClient, home, cfg.Mesh.Namespace)
		if reason, bad := home.Unread[analysis.KindNamespaces]; bad {
			err = fmt.Errorf("cannot list namespaces: %s", reason)
		}
	}
	cancel()
	if err != nil {
		return nil, fmt.Errorf("config cluster %s: %w", cfg.Mesh.ConfigCluster, err)
	}
	snap.Clusters = append(snap.Clusters, home)
	for _, s := range secrets {
		snap.RemoteSecrets = append(snap.RemoteSecrets, s.RemoteSecret)
	}

	claims := firstClaims(secrets, cfg.Mesh.ConfigCluster)
	var mu sync.Mutex
	var wg sync.WaitGroup
	sem := make(chan struct{}, cfg.Parallel)
	for _, cl := range claims {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			remote, c := readRemote(ctx, cfg, deps.Build, cl)
			cfg.Logger.Debug("read remote cluster", "cluster", cl.id, "secret", cl.secret.Key(), "reason", remote.Reason)
			mu.Lock()
			defer mu.Unlock()
			snap.Remotes = append(snap.Remotes, remote)
			if c != nil {
				snap.Clusters = append(snap.Clusters, c)
			}
		})
	}
	wg.Wait()
	slices.SortFunc(snap.Clusters, func(a, b *analysis.Cluster) int { return cmp.Compare(a.ID, b.ID) })
	slices.SortFunc(snap.Remotes, func(a, b analysis.Remote) int { return cmp.Compare(a.ID, b.ID) })
	return snap, nil
}

// secret is a remote Secret with its kubeconfigs, kept only while
// collecting.
type secret struct {
	analysis.RemoteSecret
	kubeconfigs map[string][]byte
}

// remoteSecrets lists the remote Secrets of ns under either label.
func remoteSecrets(ctx context.Context, cl *multicluster.Client, ns string) ([]secret, error) {
	byName := map[string]corev1.Secret{}
	for _, label := range []string{remotesecret.IstioLabel, remotesecret.IsthmusLabel} {
		l, err := cl.Kube.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{LabelSelector: label + "=true"})
		if err != nil {
			return nil, fmt.Errorf("list remote secrets: %w", err)
		}
		for _, s := range l.Items {
			byName[s.Name] = s
		}
	}
	var out []secret
	for _, name := range slices.Sorted(maps.Keys(byName)) {
		s := byName[name]
		out = append(out, secret{RemoteSecret: toRemoteSecret(&s), kubeconfigs: s.Data})
	}
	return out, nil
}

// toRemoteSecret keeps what the checks need of a remote Secret: never its
// kubeconfigs.
func toRemoteSecret(s *corev1.Secret) analysis.RemoteSecret {
	r := analysis.RemoteSecret{Namespace: s.Namespace, Name: s.Name, Created: s.CreationTimestamp.Time,
		Network: model.Network(s.Annotations[remotesecret.NetworkAnnotation])}
	keys := slices.Sorted(maps.Keys(s.Data))
	if len(keys) == 0 {
		keys = slices.Sorted(maps.Keys(s.StringData))
	}
	for _, k := range keys {
		r.Clusters = append(r.Clusters, model.ClusterID(k))
	}
	return r
}

// claim is the Secret whose kubeconfig a cluster ID is read with.
type claim struct {
	id         model.ClusterID
	secret     analysis.RemoteSecret
	kubeconfig []byte
}

// firstClaims returns, per cluster ID pilot would accept, the claim of the
// oldest Secret, sorted by ID.
func firstClaims(secrets []secret, configCluster model.ClusterID) []claim {
	byKey := map[string]secret{}
	var plain []analysis.RemoteSecret
	for _, s := range secrets {
		byKey[s.Key()] = s
		plain = append(plain, s.RemoteSecret)
	}
	seen := map[model.ClusterID]bool{}
	var out []claim
	for _, rs := range analysis.SortSecrets(plain) {
		for _, id := range rs.Clusters {
			if seen[id] || id == configCluster || len(validation.IsDNS1123Label(string(id))) > 0 {
				continue
			}
			seen[id] = true
			out = append(out, claim{id: id, secret: rs, kubeconfig: byKey[rs.Key()].kubeconfigs[string(id)]})
		}
	}
	slices.SortFunc(out, func(a, b claim) int { return cmp.Compare(a.id, b.id) })
	return out
}

// readRemote contacts one remote cluster as pilot would and reads it. The
// cluster is nil when it could not be contacted (Remote.Reason says why).
func readRemote(ctx context.Context, cfg LiveConfig, build multicluster.ClientBuilder, cl claim) (analysis.Remote, *analysis.Cluster) {
	remote := analysis.Remote{ID: cl.id, Secret: cl.secret.Key()}
	client, err := multicluster.SanitizedClient(cl.kubeconfig, cl.id, cfg.AllowedKubeconfigOptions, build)
	if err != nil {
		var ke *multicluster.KubeconfigError
		if errors.As(err, &ke) {
			remote.Reason, remote.Detail = ke.Reason, ke.Detail
		} else {
			remote.Reason, remote.Detail = multicluster.ReasonClientError, firstLine(err.Error(), 200)
		}
		return remote, nil
	}
	defer client.Close()
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	// The probe pilot's liveness check makes: server up, CA right,
	// credentials accepted.
	if _, err := client.Kube.CoreV1().Namespaces().List(ctx, metav1.ListOptions{Limit: 1}); err != nil {
		remote.Reason = multicluster.ProbeFailure(err)
		remote.Detail = firstLine(err.Error(), 200)
		return remote, nil
	}
	c := &analysis.Cluster{ID: cl.id, Network: cl.secret.Network, Secret: cl.secret.Key()}
	readCluster(ctx, client, c, cfg.Mesh.Namespace)
	return remote, c
}
