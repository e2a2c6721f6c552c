package eastwest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"
	gwv1 "sigs.k8s.io/gateway-api/apis/v1"

	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// Controller keeps the GatewayClass and the Gateways of the class in every
// cluster it is built for. It is safe for concurrent use.
type Controller struct {
	cfg    Config
	deps   Deps
	log    *slog.Logger
	scheme *runtime.Scheme

	mu       sync.Mutex
	clusters map[*clusterController]struct{}
}

// New returns a controller; Build makes its per-cluster components.
func New(cfg Config, deps Deps) (*Controller, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("eastwest: %w", err)
	}
	if deps.Leading == nil {
		deps.Leading = func() bool { return true }
	}
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{corev1.AddToScheme, appsv1.AddToScheme, gwv1.Install} {
		if err := add(s); err != nil {
			return nil, err
		}
	}
	return &Controller{cfg: cfg, deps: deps, log: cfg.Logger, scheme: s, clusters: map[*clusterController]struct{}{}}, nil
}

// Resync makes every cluster's controller reconcile the class and every
// Gateway again (call it when this replica becomes the leader, or the
// root bundle changes). It never blocks.
func (c *Controller) Resync() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for cc := range c.clusters {
		select {
		case cc.resync <- struct{}{}:
		default:
		}
	}
}

// Build is the multicluster component builder: it starts the controller of
// one cluster generation.
func (c *Controller) Build(ctx context.Context, mc *multicluster.Cluster) (multicluster.Component, error) {
	if mc.Client == nil || mc.Client.REST == nil {
		return nil, errors.New("eastwest: cluster without a REST config")
	}
	cfg := rest.CopyConfig(mc.Client.REST)
	// Gateway API objects have no protobuf form.
	cfg.ContentType, cfg.AcceptContentTypes = runtime.ContentTypeJSON, runtime.ContentTypeJSON
	hc, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return nil, fmt.Errorf("eastwest: http client: %w", err)
	}
	disc, err := discovery.NewDiscoveryClientForConfigAndClient(cfg, hc)
	if err != nil {
		return nil, fmt.Errorf("eastwest: discovery client: %w", err)
	}
	ctx, cancel := context.WithCancel(ctx)
	cc := &clusterController{
		parent: c, cluster: mc.ID, network: mc.Network, trustDomain: mc.TrustDomain, rest: cfg, http: hc, disc: disc,
		log: c.log.With("cluster", mc.ID, "generation", mc.Generation), cancel: cancel,
		resync: make(chan struct{}, 1), events: make(chan event.TypedGenericEvent[reconcile.Request], 64), done: make(chan struct{}),
	}
	c.mu.Lock()
	c.clusters[cc] = struct{}{}
	c.mu.Unlock()
	go cc.run(ctx)
	return cc, nil
}

func (c *Controller) forget(cc *clusterController) {
	c.mu.Lock()
	delete(c.clusters, cc)
	c.mu.Unlock()
}

// clusterController is one cluster generation's component.
type clusterController struct {
	parent  *Controller
	cluster model.ClusterID
	network model.Network
	// trustDomain is the cluster's own (its remote Secret's), "" for the
	// mesh's: the gateways deployed there are identities of it.
	trustDomain string
	rest        *rest.Config
	http        *http.Client
	disc        discovery.DiscoveryInterface
	log         *slog.Logger
	cancel      context.CancelFunc
	resync      chan struct{}
	events      chan event.TypedGenericEvent[reconcile.Request]
	done        chan struct{}
	synced      atomic.Bool
	once        sync.Once
}

// HasSynced implements multicluster.Component: the class has been
// reconciled once (written, when leading), or the cluster has no Gateway API.
func (cc *clusterController) HasSynced() bool { return cc.synced.Load() }

// Close implements multicluster.Component; idempotent, it returns once the
// controller's goroutines have ended. What it made stays.
func (cc *clusterController) Close() {
	cc.once.Do(func() {
		cc.cancel()
		<-cc.done
		cc.parent.forget(cc)
		cc.http.CloseIdleConnections()
	})
}

// run waits for the Gateway API, then runs the cache and the controller
// until ctx ends.
func (cc *clusterController) run(ctx context.Context) {
	defer close(cc.done)
	if !cc.waitForGatewayAPI(ctx) {
		return
	}
	if err := cc.serve(ctx); err != nil && ctx.Err() == nil {
		cc.log.Error("east-west gateway controller stopped", "error", err)
	}
}

// waitForGatewayAPI returns true once the cluster serves Gateways and
// GatewayClasses in gateway.networking.k8s.io/v1; until then the component
// counts as synced with nothing to do. false: ctx ended.
func (cc *clusterController) waitForGatewayAPI(ctx context.Context) bool {
	delay := 100 * time.Millisecond
	for {
		served, err := cc.servesGatewayAPI()
		switch {
		case err != nil:
			cc.log.Warn("cannot read the cluster's API groups; retrying", "error", err, "in", delay)
		case served:
			return true
		default:
			if !cc.synced.Swap(true) {
				cc.log.Info("the cluster does not serve gateway.networking.k8s.io/v1: no east-west Gateways until it does")
			}
			delay = cc.parent.cfg.CRDRecheck
		}
		select {
		case <-ctx.Done():
			return false
		case <-time.After(delay):
		}
		if err != nil {
			delay = min(2*delay, 30*time.Second)
		}
	}
}

func (cc *clusterController) servesGatewayAPI() (bool, error) {
	l, err := cc.disc.ServerResourcesForGroupVersion(gwv1.GroupVersion.String())
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	var gw, class bool
	for _, r := range l.APIResources {
		gw = gw || r.Name == "gateways"
		class = class || r.Name == "gatewayclasses"
	}
	return gw && class, nil
}

// serve runs the cache and the controller until ctx ends.
func (cc *clusterController) serve(ctx context.Context) error {
	cfg := cc.parent.cfg
	if cc.trustDomain != "" {
		cfg.TrustDomain = cc.trustDomain
	}
	owned := labels.SelectorFromSet(labels.Set{managedByLabel: managedBy, gwv1.GatewayClassNameLabelKey: ClassName})
	ca, err := cache.New(cc.rest, cache.Options{
		HTTPClient: cc.http, Scheme: cc.parent.scheme, DefaultTransform: cache.TransformStripManagedFields(),
		ByObject: map[client.Object]cache.ByObject{
			&corev1.Service{}:    {Label: owned},
			&appsv1.Deployment{}: {Label: owned},
			&corev1.ConfigMap{}:  {Label: owned},
			&gwv1.GatewayClass{}: {Field: fields.OneTermEqualSelector("metadata.name", ClassName)},
		},
	})
	if err != nil {
		return fmt.Errorf("cache: %w", err)
	}
	// ServiceAccounts are read uncached, one by name: pilot may not list
	// them.
	cl, err := client.New(cc.rest, client.Options{HTTPClient: cc.http, Scheme: cc.parent.scheme,
		Cache: &client.CacheOptions{Reader: ca, DisableFor: []client.Object{&corev1.ServiceAccount{}}}})
	if err != nil {
		return fmt.Errorf("client: %w", err)
	}
	r := &reconciler{cfg: cfg, deps: cc.parent.deps, cluster: cc.cluster, client: cl, log: cc.log, synced: &cc.synced}
	ctl, err := controller.NewTypedUnmanaged("isthmus-east-west-gateways", controller.TypedOptions[reconcile.Request]{
		Reconciler: r, SkipNameValidation: ptr.To(true), NeedLeaderElection: ptr.To(false),
		Logger: logr.FromSlogHandler(cc.log.Handler()),
	})
	if err != nil {
		return fmt.Errorf("controller: %w", err)
	}
	if err := cc.watch(ctx, ctl, ca, cl); err != nil {
		return err
	}
	errs := make(chan error, 2)
	go func() { errs <- ca.Start(ctx) }()
	go func() { errs <- ctl.Start(ctx) }()
	var wg sync.WaitGroup
	wg.Go(func() { cc.forwardResyncs(ctx, cl) })
	cc.resyncNow()
	err = errors.Join(<-errs, <-errs)
	wg.Wait()
	return err
}

// classRequest is the work item of the GatewayClass (Gateways always have
// a namespace).
var classRequest = reconcile.Request{NamespacedName: client.ObjectKey{Name: ClassName}}

// watch wires the controller's sources: Gateways, the class, what was made
// (by its gateway-name label), namespaces (their labels decide trust) and
// resyncs.
func (cc *clusterController) watch(ctx context.Context, ctl controller.TypedController[reconcile.Request], ca cache.Cache, cl client.Client) error {
	byLabel := handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
		if name := o.GetLabels()[gwv1.GatewayNameLabelKey]; name != "" {
			return []reconcile.Request{{NamespacedName: client.ObjectKey{Namespace: o.GetNamespace(), Name: name}}}
		}
		return nil
	})
	inNamespace := func(ns string) []reconcile.Request {
		var l gwv1.GatewayList
		if err := cl.List(ctx, &l, client.InNamespace(ns)); err != nil {
			return nil
		}
		out := make([]reconcile.Request, 0, len(l.Items))
		for i := range l.Items {
			out = append(out, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&l.Items[i])})
		}
		return out
	}
	ofClass := func() []reconcile.Request {
		var l gwv1.GatewayList
		if err := cl.List(ctx, &l); err != nil {
			return nil
		}
		var out []reconcile.Request
		for i := range l.Items {
			if l.Items[i].Spec.GatewayClassName == ClassName {
				out = append(out, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&l.Items[i])})
			}
		}
		return out
	}
	sources := []source.TypedSource[reconcile.Request]{
		source.Kind[client.Object](ca, &gwv1.Gateway{}, &handler.EnqueueRequestForObject{}),
		// A change of the class changes whether its Gateways are served: a
		// Gateway reconciled before this leader's new class reached the
		// cache was left undeployed, and is reconciled again now.
		source.Kind[client.Object](ca, &gwv1.GatewayClass{}, handler.EnqueueRequestsFromMapFunc(
			func(context.Context, client.Object) []reconcile.Request {
				return append([]reconcile.Request{classRequest}, ofClass()...)
			})),
		source.Kind[client.Object](ca, &corev1.Service{}, byLabel),
		source.Kind[client.Object](ca, &appsv1.Deployment{}, byLabel),
		source.Kind[client.Object](ca, &corev1.ConfigMap{}, handler.EnqueueRequestsFromMapFunc(
			func(_ context.Context, o client.Object) []reconcile.Request { return inNamespace(o.GetNamespace()) })),
		source.Kind[client.Object](ca, &corev1.Namespace{}, handler.EnqueueRequestsFromMapFunc(
			func(_ context.Context, o client.Object) []reconcile.Request { return inNamespace(o.GetName()) })),
		source.TypedChannel(cc.events, handler.TypedFuncs[reconcile.Request, reconcile.Request]{
			GenericFunc: func(_ context.Context, e event.TypedGenericEvent[reconcile.Request], q reconcileQueue) {
				q.Add(e.Object)
			},
		}),
	}
	for _, s := range sources {
		if err := ctl.Watch(s); err != nil {
			return fmt.Errorf("watch: %w", err)
		}
	}
	return nil
}

// forwardResyncs turns each resync signal into one work item for the class
// and one per Gateway of the cluster.
func (cc *clusterController) forwardResyncs(ctx context.Context, cl client.Client) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-cc.resync:
		}
		reqs := []reconcile.Request{classRequest}
		var l gwv1.GatewayList
		if err := cl.List(ctx, &l); err == nil {
			for i := range l.Items {
				reqs = append(reqs, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&l.Items[i])})
			}
		}
		for _, r := range reqs {
			select {
			case cc.events <- event.TypedGenericEvent[reconcile.Request]{Object: r}:
			case <-ctx.Done():
				return
			}
		}
	}
}

func (cc *clusterController) resyncNow() {
	select {
	case cc.resync <- struct{}{}:
	default:
	}
}
