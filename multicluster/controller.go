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
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/go-multierror"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/validation"
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
	// Logger (default slog.Default()).
	Logger *slog.Logger
	// RecordEvents reports whether this replica writes Events on remote
	// Secrets (nil: always). With several replicas only the leader does, so
	// that every transition is one Event.
	RecordEvents func() bool
}

func (c *Config) defaults() {
	if c.Namespace == "" {
		c.Namespace = "isthmus-system"
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
		c.Logger = slog.Default()
	}
}

func (c *Config) validate() error {
	if errs := validation.IsDNS1123Label(string(c.ConfigClusterID)); len(errs) > 0 {
		return fmt.Errorf("config cluster ID %q: %v", c.ConfigClusterID, errs)
	}
	if c.Exec.Timeout < 0 {
		return fmt.Errorf("exec timeout %s is negative", c.Exec.Timeout)
	}
	return errors.Join(validateKubeconfigOptions(c.AllowedKubeconfigOptions), validateExecRules(c.Exec.Allowlist))
}

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
	cfg          Config
	policy       KubeconfigPolicy
	configClient *Client
	build        ClientBuilder
	log          *slog.Logger
	metrics      *metrics

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

// entry is one registered cluster: the serving generation and, during a
// swap, the one replacing it.
type entry struct {
	id      model.ClusterID
	secret  string
	ref     *corev1.ObjectReference
	network model.Network
	// trustDomain is the Secret's trust-domain annotation.
	trustDomain string
	hash        [32]byte
	active      *instance
	pending     *instance
}

// New makes a controller. configClient reaches the config cluster (it is
// also run as a cluster, with ID cfg.ConfigClusterID); build makes remote
// clients (DefaultClientBuilder when nil).
func New(cfg Config, configClient *Client, build ClientBuilder) (*Controller, error) {
	cfg.defaults()
	if configClient == nil {
		return nil, errors.New("multicluster: a config cluster client is required")
	}
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("multicluster: %w", err)
	}
	if build == nil {
		build = DefaultClientBuilder
	}
	return &Controller{
		cfg:          cfg,
		policy:       KubeconfigPolicy{AllowedOptions: cfg.AllowedKubeconfigOptions, Exec: cfg.Exec.Allowlist},
		configClient: configClient,
		build:        build,
		log:          cfg.Logger.With("component", "multicluster"),
		metrics:      newMetrics(cfg.Registerer),
		clusters:     map[model.ClusterID]*entry{},
		refused:      map[string]map[model.ClusterID]Status{},
	}, nil
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
	e := &entry{id: c.cfg.ConfigClusterID, network: c.cfg.ConfigClusterNetwork}
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

func (e *entry) status() Status {
	if e.active == nil {
		return Status{ID: e.id, Secret: e.secret, State: StatePending}
	}
	s := e.active.getStatus()
	if e.pending != nil {
		p := e.pending.getStatus()
		s.Pending = &p
	}
	return s
}

// reconcile makes the clusters registered by one Secret match its data.
func (c *Controller) reconcile(ctx context.Context, key string) {
	var sec *corev1.Secret
	ns, name, _ := cache.SplitMetaNamespaceKey(key)
	for _, l := range c.listers {
		if s, err := l.Secrets(ns).Get(name); err == nil {
			sec = s
			break
		}
	}
	desired := map[model.ClusterID][]byte{}
	network := model.Network("")
	trustDomain := ""
	var ref *corev1.ObjectReference
	if sec != nil {
		for k, v := range sec.Data {
			desired[model.ClusterID(k)] = v
		}
		network = model.Network(sec.Annotations[remotesecret.NetworkAnnotation])
		trustDomain = sec.Annotations[remotesecret.TrustDomainAnnotation]
		ref = &corev1.ObjectReference{Kind: "Secret", APIVersion: "v1", Namespace: sec.Namespace, Name: sec.Name, UID: sec.UID, ResourceVersion: sec.ResourceVersion}
	}

	c.mu.Lock()
	defer c.mu.Unlock()
	refused := map[model.ClusterID]Status{}
	removedAny := false
	// Clusters this Secret owned that it no longer lists.
	for id, e := range c.clusters {
		if e.secret == key {
			if _, ok := desired[id]; !ok {
				c.log.Info("remote cluster removed", "cluster", id, "secret", key)
				c.stopEntryLocked(e)
				delete(c.clusters, id)
				c.notifyLocked(Status{ID: id, Secret: key, State: StateClosing, Reason: ReasonRemoved, LastTransitionTime: time.Now()})
				removedAny = true
			}
		}
	}
	for _, id := range slices.Sorted(maps.Keys(desired)) {
		kubeconfig := desired[id]
		if errs := validation.IsDNS1123Label(string(id)); len(errs) > 0 {
			refused[id] = c.refuse(ref, key, id, ReasonInvalidClusterID, fmt.Sprintf("cluster ID %q is not a DNS-1123 label", id))
			continue
		}
		if id == c.cfg.ConfigClusterID {
			refused[id] = c.refuse(ref, key, id, ReasonConfigClusterID, fmt.Sprintf("cluster ID %q is the config cluster's own ID; ignored", id))
			continue
		}
		e, ok := c.clusters[id]
		if ok && e.secret != key {
			refused[id] = c.refuse(ref, key, id, ReasonDuplicateCluster, fmt.Sprintf("cluster %q is already registered by secret %s; the first secret wins", id, e.secret))
			continue
		}
		hash := sha256.Sum256(kubeconfig)
		switch {
		case !ok:
			e = &entry{id: id, secret: key, ref: ref, network: network, trustDomain: trustDomain, hash: hash}
			c.clusters[id] = e
			c.log.Info("remote cluster added", "cluster", id, "secret", key)
			c.startLocked(ctx, e, kubeconfig)
		case e.hash != hash || e.network != network || e.trustDomain != trustDomain:
			e.hash, e.ref, e.network, e.trustDomain = hash, ref, network, trustDomain
			c.log.Info("remote cluster kubeconfig changed; starting a new generation (make-before-break)", "cluster", id, "secret", key)
			c.startLocked(ctx, e, kubeconfig)
		default:
			e.ref = ref // unchanged bytes: keep the running client
		}
	}
	if len(refused) > 0 {
		c.refused[key] = refused
	} else {
		delete(c.refused, key)
	}
	c.metrics.setStates(c.statusesLocked())
	if removedAny {
		// A cluster ID freed by this Secret may be claimed by another.
		for other := range c.refused {
			if other != key {
				c.queue.Add(other)
			}
		}
	}
}

func (c *Controller) refuse(ref *corev1.ObjectReference, key string, id model.ClusterID, reason, msg string) Status {
	c.log.Warn("remote cluster refused", "cluster", id, "secret", key, "reason", reason, "detail", msg)
	if ref != nil {
		c.event(ref, corev1.EventTypeWarning, reason, msg)
	}
	return Status{ID: id, Secret: key, State: StateError, Reason: reason, Message: msg, LastTransitionTime: time.Now()}
}

// startLocked starts a new generation for e: the serving one when e has
// none, else a pending replacement (closing any earlier pending one).
func (c *Controller) startLocked(ctx context.Context, e *entry, kubeconfig []byte) {
	c.nextGen++
	ictx, cancel := context.WithCancel(ctx)
	inst := &instance{
		c: c, e: e, gen: c.nextGen, ctx: ictx, cancel: cancel,
		syncedCh: make(chan struct{}), done: make(chan struct{}),
		status: Status{ID: e.id, Secret: e.secret, State: StatePending, Reason: "Starting", Generation: c.nextGen, LastTransitionTime: time.Now()},
	}
	if e.active == nil {
		e.active = inst
	} else {
		if e.pending != nil {
			e.pending.stop()
		}
		e.pending = inst
	}
	c.wg.Go(func() { inst.run(kubeconfig) })
}

// promote makes inst the serving generation once it has synced, and closes
// the one it replaces.
func (c *Controller) promote(inst *instance) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := inst.e
	if e.pending != inst {
		return
	}
	old := e.active
	e.active, e.pending = inst, nil
	c.log.Info("remote cluster swapped to new generation", "cluster", e.id, "generation", inst.gen)
	old.stop()
	c.notifyLocked(inst.getStatus())
	c.metrics.setStates(c.statusesLocked())
}

func (c *Controller) stopEntryLocked(e *entry) {
	if e.pending != nil {
		e.pending.stop()
		e.pending = nil
	}
	if e.active != nil {
		e.active.stop()
	}
}

// statusChanged is called by an instance after its status changed.
func (c *Controller) statusChanged(inst *instance, s Status, event *eventInfo) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := inst.e
	if cur, ok := c.clusters[e.id]; !ok || cur != e {
		return
	}
	if event != nil && e.ref != nil {
		c.event(e.ref, event.kind, event.reason, event.msg)
	}
	if e.active == inst {
		c.notifyLocked(s)
	}
	c.metrics.setStates(c.statusesLocked())
}

func (c *Controller) notifyLocked(s Status) {
	for _, fn := range c.listeners {
		fn(s)
	}
}

type eventInfo struct{ kind, reason, msg string }

// buildComponents builds every registered component for cl; on error the
// ones built are closed and the errors aggregated.
func (c *Controller) buildComponents(ctx context.Context, cl *Cluster) ([]Component, error) {
	c.mu.Lock()
	builders := slices.Clone(c.components)
	c.mu.Unlock()
	var out []Component
	var errs *multierror.Error
	for _, b := range builders {
		comp, err := b.build(ctx, cl)
		if err != nil {
			errs = multierror.Append(errs, fmt.Errorf("component %s: %w", b.name, err))
			continue
		}
		out = append(out, comp)
	}
	if err := errs.ErrorOrNil(); err != nil {
		for _, comp := range out {
			comp.Close()
		}
		return nil, err
	}
	return out, nil
}

// event records an Event on ref, when this replica records them.
func (c *Controller) event(ref runtime.Object, kind, reason, msg string) {
	if c.recorder == nil || (c.cfg.RecordEvents != nil && !c.cfg.RecordEvents()) {
		return
	}
	c.recorder.Event(ref, kind, reason, msg)
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
