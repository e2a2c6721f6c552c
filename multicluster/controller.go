// Package multicluster turns remote-cluster Secrets into running, synced
// per-cluster clients, and tells registered components when a cluster comes,
// changes or goes.
//
// A remote cluster is registered by a Secret in the control plane's
// namespace of the config cluster, labelled istio/multiCluster=true or
// isthmus.io/multiCluster=true, whose data keys are cluster IDs and values
// kubeconfigs (Istio's remote-secret format). For each cluster the
// controller sanitizes the kubeconfig (an exec credential plugin runs only
// if the operator's allowlist names it, and then under the controller's
// own runner, not client-go's), builds a Client with the ClientBuilder, builds every registered Component with its own child
// context, starts the informers and reports the cluster synced when every
// component has synced, or timed out after Config.SyncTimeout (it keeps
// trying; a remote never blocks readiness or the other clusters).
//
// A changed kubeconfig (SHA-256) is swapped make-before-break: a new
// generation starts and syncs while the old one serves; then the old one is
// closed. A removed key or Secret closes the cluster and releases every
// goroutine and informer. A liveness probe marks a cluster unreachable when
// its API server stops answering, keeps its last state, and recovers without
// a restart.
package multicluster

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	listerscorev1 "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"

	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// Cluster is what a component is built for: one generation of one cluster.
type Cluster struct {
	ID model.ClusterID
	// Generation increases each time the cluster's client is rebuilt (a
	// changed kubeconfig); during a swap two generations run at once.
	Generation uint64
	Client     *Client
	// Network is the cluster's default network (the Secret's
	// topology.istio.io/network annotation, or ConfigClusterNetwork).
	Network model.Network
	// TrustDomain is the SPIFFE trust domain of the cluster's identities
	// (the Secret's security.isthmus.io/trust-domain annotation); empty:
	// the mesh's.
	TrustDomain string
	// IsConfig is set for the config cluster pilot runs in.
	IsConfig bool
	// Namespaces are the namespaces discovery covers: the Secret's
	// discovery-selectors annotation, else the mesh-wide selectors. A
	// change of them starts a new generation.
	Namespaces *NamespaceSelection
}

// Component is a per-cluster part of pilot (e.g. discovery). Close must
// release everything it started; it is called once, after the cluster's
// context is cancelled.
type Component interface {
	HasSynced() bool
	Close()
}

// ComponentBuilder builds a component for one cluster generation. It runs
// before the cluster's informers start, so it may register informers on
// c.Client's factories. ctx ends when the generation stops.
type ComponentBuilder func(ctx context.Context, c *Cluster) (Component, error)

type namedBuilder struct {
	name  string
	build ComponentBuilder
}

// Controller runs the remote clusters. It is safe for concurrent use.
type Controller struct {
	cfg           Config
	meshSelection *NamespaceSelection
	policy        KubeconfigPolicy
	configClient  *Client
	build         ClientBuilder
	log           *slog.Logger
	metrics       *metrics

	mu         sync.Mutex
	components []namedBuilder
	clusters   map[model.ClusterID]*entry
	refused    map[string]map[model.ClusterID]Status // by secret key
	listeners  []func(Status)
	nextGen    uint64
	started    bool

	queue    workqueue.TypedRateLimitingInterface[string]
	listers  []listerscorev1.SecretLister
	synced   []cache.InformerSynced
	recorder record.EventRecorder
	wg       sync.WaitGroup // cluster goroutines
}

// New makes a controller. configClient reaches the config cluster (it is
// also run as a cluster, with ID cfg.ConfigClusterID); build makes remote
// clients (DefaultClientBuilder when nil).
func New(cfg Config, configClient *Client, build ClientBuilder) (*Controller, error) {
	cfg = cfg.withDefaults()
	if configClient == nil {
		return nil, errors.New("multicluster: a config cluster client is required")
	}
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("multicluster: %w", err)
	}
	if build == nil {
		build = DefaultClientBuilder
	}
	mesh, err := NewNamespaceSelection(cfg.DiscoverySelectors)
	if err != nil {
		return nil, fmt.Errorf("multicluster: %w", err)
	}
	c := &Controller{
		cfg:           cfg,
		meshSelection: mesh,
		policy:        KubeconfigPolicy{AllowedOptions: cfg.AllowedKubeconfigOptions, Exec: cfg.Exec.Allowlist},
		configClient:  configClient,
		build:         build,
		log:           cfg.Logger.With("component", "multicluster"),
		metrics:       newMetrics(cfg.Registerer),
		clusters:      map[model.ClusterID]*entry{},
		refused:       map[string]map[model.ClusterID]Status{},
	}
	if cfg.Registerer != nil {
		cfg.Registerer.MustRegister(newClusterCollector(c))
	}
	return c, nil
}

// AddComponent registers a per-cluster component; call it before Run.
func (c *Controller) AddComponent(name string, b ComponentBuilder) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.started {
		panic("multicluster: AddComponent after Run")
	}
	c.components = append(c.components, namedBuilder{name, b})
}

// Subscribe registers fn to be called with a cluster's status each time the
// serving generation's status changes (including when it is removed, with
// State closing and Reason Removed). fn must not block.
func (c *Controller) Subscribe(fn func(Status)) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.listeners = append(c.listeners, fn)
}

// Run watches remote secrets and runs clusters until ctx ends, then stops
// every cluster and returns once all their goroutines are gone.
func (c *Controller) Run(ctx context.Context) error {
	c.mu.Lock()
	c.started = true
	c.mu.Unlock()

	broadcaster := record.NewBroadcaster(record.WithContext(ctx))
	broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: c.configClient.Kube.CoreV1().Events(c.cfg.Namespace)})
	defer broadcaster.Shutdown()
	c.recorder = broadcaster.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "isthmus-multicluster"})

	c.queue = workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.DefaultTypedControllerRateLimiter[string](),
		workqueue.TypedRateLimitingQueueConfig[string]{Name: "remote-secrets"})
	var factories []informers.SharedInformerFactory
	var listers []listerscorev1.SecretLister
	var synced []cache.InformerSynced
	for _, label := range []string{remotesecret.IstioLabel, remotesecret.IsthmusLabel} {
		f := informers.NewSharedInformerFactoryWithOptions(c.configClient.Kube, 0,
			informers.WithNamespace(c.cfg.Namespace),
			informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = label + "=true" }))
		inf := f.Core().V1().Secrets()
		if _, err := inf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
			AddFunc:    func(obj any) { c.enqueue(obj, "add") },
			UpdateFunc: func(_, obj any) { c.enqueue(obj, "update") },
			DeleteFunc: func(obj any) { c.enqueue(obj, "delete") },
		}); err != nil {
			return err
		}
		listers = append(listers, inf.Lister())
		synced = append(synced, inf.Informer().HasSynced)
		factories = append(factories, f)
	}

	// The config cluster runs the same components as remotes.
	c.mu.Lock()
	c.listers, c.synced = listers, synced
	e := &entry{id: c.cfg.ConfigClusterID, network: c.cfg.ConfigClusterNetwork, selection: c.meshSelection}
	c.clusters[e.id] = e
	c.startLocked(ctx, e, nil)
	c.mu.Unlock()

	for _, f := range factories {
		f.Start(ctx.Done())
	}
	var workerDone sync.WaitGroup
	workerDone.Go(func() {
		for c.processNext(ctx) {
		}
	})
	<-ctx.Done()
	c.queue.ShutDown()
	workerDone.Wait()
	for _, f := range factories {
		f.Shutdown()
	}
	c.mu.Lock()
	for _, e := range c.clusters {
		c.stopEntryLocked(e)
	}
	c.mu.Unlock()
	c.wg.Wait()
	return nil
}

func (c *Controller) enqueue(obj any, event string) {
	key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj)
	if err != nil {
		return
	}
	c.metrics.secretEvents.WithLabelValues(event).Inc()
	c.queue.Add(key)
}

func (c *Controller) processNext(ctx context.Context) bool {
	key, quit := c.queue.Get()
	if quit {
		return false
	}
	defer c.queue.Done(key)
	c.reconcile(ctx, key)
	c.queue.Forget(key)
	return true
}

// Ready reports whether the config cluster has synced and the remote
// secrets have been listed. Remote clusters never hold readiness back.
func (c *Controller) Ready() bool {
	c.mu.Lock()
	synced := c.synced
	e := c.clusters[c.cfg.ConfigClusterID]
	configSynced := e != nil && e.active != nil && e.active.isSynced()
	c.mu.Unlock()
	if len(synced) == 0 || !configSynced {
		return false
	}
	for _, s := range synced {
		if !s() {
			return false
		}
	}
	return true
}

// Statuses returns the status of every cluster, sorted by ID: registered
// ones and those whose registration was refused.
func (c *Controller) Statuses() []Status {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.statusesLocked()
}

func (c *Controller) statusesLocked() []Status {
	out := make([]Status, 0, len(c.clusters))
	for _, e := range c.clusters {
		out = append(out, e.status())
	}
	for _, byID := range c.refused {
		for _, s := range byID {
			out = append(out, s)
		}
	}
	sortStatuses(out)
	return out
}

// Status returns the status of cluster id.
func (c *Controller) Status(id model.ClusterID) (Status, bool) {
	for _, s := range c.Statuses() {
		if s.ID == id {
			return s, true
		}
	}
	return Status{}, false
}

// KubeClient returns the serving client of cluster id (for callers that act
// in a cluster, such as the CA's token reviews).
func (c *Controller) KubeClient(id string) (*Client, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.clusters[model.ClusterID(id)]
	if !ok || e.active == nil || e.active.cluster == nil || e.active.cluster.Client == nil {
		return nil, false
	}
	return e.active.cluster.Client, true
}

// Network returns the default network of cluster id: its Secret's
// topology.istio.io/network annotation, or ConfigClusterNetwork for the
// config cluster; ok=false when the cluster is not registered.
func (c *Controller) Network(id string) (model.Network, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.clusters[model.ClusterID(id)]
	if !ok {
		return "", false
	}
	return e.network, true
}

// SanitizedClient builds the client of a remote kubeconfig as pilot does
// (SanitizeKubeconfig with the allowed options, then build on the rebuilt
// kubeconfig), for tools: it runs no exec plugin, so a kubeconfig with one
// is refused. A refused kubeconfig is a *KubeconfigError.
func SanitizedClient(kubeconfig []byte, id model.ClusterID, allowed []string, build ClientBuilder) (*Client, error) {
	cfg, err := SanitizeKubeconfig(kubeconfig, allowed)
	if err != nil {
		return nil, err
	}
	clean, err := clientcmd.Write(*cfg)
	if err != nil {
		return nil, &KubeconfigError{ReasonInvalidKubeconfig, "cannot serialize sanitized kubeconfig"}
	}
	return build(clean, id)
}
