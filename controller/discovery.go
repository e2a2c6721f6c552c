// Package controller discovers, for one cluster, the Services,
// EndpointSlices, Pods, Namespaces, Nodes and east-west gateways that the
// federation needs, and keeps that cluster's view: its services, workloads
// (with network and locality), endpoint shards and network gateways.
//
// It runs as a multicluster component, so it follows each cluster's life:
// a view is built per cluster generation, handed whole to the Sink once its
// watches have synced (Activate), then changed key by key (Update); when the
// generation stops it is withdrawn (Deactivate) unless a newer generation
// already serves, which makes kubeconfig rotations gapless.
//
// Objects are never cached whole: each watch feeds a store that turns the
// object into a compact value (a pod keeps its name, labels, service
// account, node, IPs, readiness and named ports; repeated strings are
// interned) and drops the rest, so memory follows what the registry uses.
// A service's endpoints are the pods its selector matches (readiness from
// the Ready condition, terminating from the deletion timestamp); a service
// without a selector takes them from its EndpointSlices, whose addresses
// take their readiness from the slice and, when they name a pod by
// targetRef, their identity and placement from that pod (slices.go).
//
// Discovery selectors (the cluster's multicluster.NamespaceSelection) limit
// it to the namespaces they select; objects of other namespaces are dropped
// on arrival (scope.go).
package controller

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// Config configures discovery. Zero values take the defaults beside them.
type Config struct {
	// ControlPlaneNamespace is the namespace whose network label gives a
	// cluster's network (default "isthmus-system").
	ControlPlaneNamespace string
	// Domain is the services' DNS suffix (default "cluster.local").
	Domain string
	// WatchServiceExports watches MCS ServiceExports (for export mode).
	WatchServiceExports bool
	// GatewayNamespaces are the namespaces whose Services may be east-west
	// gateways (default: the control-plane namespace). A Service elsewhere
	// labelled with a network is reported as an ignored candidate: any
	// tenant can label a Service and give it external IPs.
	GatewayNamespaces []string
	// GatewayNamespaceSelector, if set, also trusts the namespaces whose
	// labels it matches (namespace labels are the cluster administrator's,
	// unlike Service labels). It is watched on the API server.
	GatewayNamespaceSelector labels.Selector
	// ServiceScope decides, per cluster, which services share their
	// endpoints with the other clusters (zero: all, unless cluster-local).
	ServiceScope ServiceScope
	// Logger (default: discards).
	Logger *slog.Logger
}

// withDefaults fills what c leaves empty.
func (c Config) withDefaults() Config {
	if c.ControlPlaneNamespace == "" {
		c.ControlPlaneNamespace = defaults.Namespace
	}
	if c.Domain == "" {
		c.Domain = model.DefaultDomain
	}
	if len(c.GatewayNamespaces) == 0 {
		c.GatewayNamespaces = []string{c.ControlPlaneNamespace}
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

// ServiceExportGVRs are the MCS ServiceExport versions, preferred first.
var ServiceExportGVRs = []schema.GroupVersionResource{
	{Group: "multicluster.x-k8s.io", Version: "v1beta1", Resource: "serviceexports"},
	{Group: "multicluster.x-k8s.io", Version: "v1alpha1", Resource: "serviceexports"},
}

// exportSource lists and watches ServiceExports in the preferred version
// the cluster serves. A cluster without the CRD has no exports.
type exportSource struct {
	client *multicluster.Client
}

func (e *exportSource) list(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
	for _, gvr := range ServiceExportGVRs {
		l, err := e.client.Dynamic.Resource(gvr).List(ctx, o)
		if apierrors.IsNotFound(err) {
			continue
		}
		return l, err
	}
	l := &unstructured.UnstructuredList{}
	l.SetResourceVersion("0")
	return l, nil
}

func (e *exportSource) watch(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
	for _, gvr := range ServiceExportGVRs {
		w, err := e.client.Dynamic.Resource(gvr).Watch(ctx, o)
		if !apierrors.IsNotFound(err) {
			return w, err
		}
	}
	// No CRD: a watch that delivers nothing (but, when asked for initial
	// events, their end) and ends after a while, so that the reflector
	// starts over and finds a CRD installed later, without an error logged
	// at every attempt.
	return idleWatch(noCRDRecheck, o.SendInitialEvents != nil && *o.SendInitialEvents), nil
}

// noCRDRecheck is how often a cluster without the ServiceExport CRD is
// checked for it again.
const noCRDRecheck = time.Minute

// idleWatch returns a watch that sends nothing — or, for a watch-list
// request, only the bookmark that ends the (empty) initial events — and
// ends after d.
func idleWatch(d time.Duration, initialEvents bool) watch.Interface {
	w := watch.NewFakeWithChanSize(1, false)
	if initialEvents {
		end := &unstructured.Unstructured{}
		end.SetAPIVersion(ServiceExportGVRs[0].GroupVersion().String())
		end.SetKind("ServiceExport")
		end.SetResourceVersion("1")
		end.SetAnnotations(map[string]string{metav1.InitialEventsAnnotationKey: "true"})
		w.Action(watch.Bookmark, end)
	}
	time.AfterFunc(d, w.Stop)
	return w
}

// NewBuilder returns the multicluster component builder of discovery: one
// view per cluster generation, feeding sink.
func NewBuilder(cfg Config, sink Sink) multicluster.ComponentBuilder {
	cfg = cfg.withDefaults()
	scoper, scopeErr := cfg.ServiceScope.Compile()
	return func(ctx context.Context, c *multicluster.Cluster) (multicluster.Component, error) {
		if sink == nil {
			return nil, errors.New("controller: nil sink")
		}
		if scopeErr != nil {
			return nil, fmt.Errorf("controller: %w", scopeErr)
		}
		return start(ctx, cfg, scoper, c, sink), nil
	}
}

// Discovery is one cluster generation's discovery component.
type Discovery struct {
	v      *view
	stores []*store
	cancel context.CancelFunc
	wg     sync.WaitGroup
	once   sync.Once
	// scope runs the namespaced watches when discovery selectors narrow
	// the namespaces (nil: they run like the others).
	scope *scope
}

func start(parent context.Context, cfg Config, scoper *Scoper, c *multicluster.Cluster, sink Sink) *Discovery {
	ctx, cancel := context.WithCancel(parent)
	d := &Discovery{v: newView(c.ID, c.Generation, cfg.Domain, c.Network, sink), cancel: cancel}
	d.v.scoper = scoper
	kube := c.Client.Kube
	log := cfg.Logger.With("cluster", c.ID, "generation", c.Generation)
	v := d.v
	for _, ns := range cfg.GatewayNamespaces {
		v.gatewayNS[ns] = true
	}
	if !c.Namespaces.All() {
		d.scope = newScope(d, c.Namespaces)
	}

	d.watchWorkloads(ctx, c, cfg)
	d.watchClusterScoped(ctx, cfg, kube)
	if d.scope != nil {
		d.scope.start(ctx, kube)
		log.Debug("discovery started", "namespaces", c.Namespaces.String())
		return d
	}
	log.Debug("discovery started")
	return d
}

// watchWorkloads watches the namespaced kinds: pods, services,
// EndpointSlices and (when asked) ServiceExports.
func (d *Discovery) watchWorkloads(ctx context.Context, c *multicluster.Cluster, cfg Config) {
	kube, v := c.Client.Kube, d.v
	d.watchNamespaced(ctx, "pods", &corev1.Pod{}, lw(
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return kube.CoreV1().Pods("").List(ctx, o)
		},
		func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return kube.CoreV1().Pods("").Watch(ctx, o)
		}),
		func(obj any) { v.putPod(convertPod(obj.(*corev1.Pod))) }, v.removePod)
	d.watchNamespaced(ctx, "services", &corev1.Service{}, lw(
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return kube.CoreV1().Services("").List(ctx, o)
		},
		func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return kube.CoreV1().Services("").Watch(ctx, o)
		}),
		func(obj any) {
			svc := obj.(*corev1.Service)
			s := convertService(c.ID, svc)
			s.labels = internMap(v.scoper.ServiceLabels(svc.Labels))
			v.putService(s)
		}, v.removeService)
	d.watchNamespaced(ctx, "endpointslices", &discoveryv1.EndpointSlice{}, lw(
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return kube.DiscoveryV1().EndpointSlices("").List(ctx, o)
		},
		func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return kube.DiscoveryV1().EndpointSlices("").Watch(ctx, o)
		}),
		func(obj any) { v.putSlice(convertSlice(obj.(*discoveryv1.EndpointSlice))) }, v.removeSlice)
	if cfg.WatchServiceExports && c.Client.Dynamic != nil {
		ex := &exportSource{client: c.Client}
		d.watchNamespaced(ctx, "serviceexports", &unstructured.Unstructured{}, lw(ex.list, ex.watch),
			func(obj any) {
				u := obj.(*unstructured.Unstructured)
				v.setExported(model.ServiceKey{Namespace: u.GetNamespace(), Name: u.GetName()}, true, u.GetCreationTimestamp().Time)
			},
			func(key string) {
				ns, name := splitKey(key)
				v.setExported(model.ServiceKey{Namespace: ns, Name: name}, false, time.Time{})
			})
	}
}

// watchClusterScoped watches nodes, the control-plane namespace (its
// network label) and the namespaces trusted for gateways by selector.
func (d *Discovery) watchClusterScoped(ctx context.Context, cfg Config, kube kubernetes.Interface) {
	v := d.v
	d.watch(ctx, "nodes", &corev1.Node{}, lw(
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return kube.CoreV1().Nodes().List(ctx, o)
		},
		func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return kube.CoreV1().Nodes().Watch(ctx, o)
		}),
		func(obj any) { n := obj.(*corev1.Node); v.putNode(n.Name, convertNode(n)) },
		func(key string) { v.removeNode(key) })
	// Every namespace: the control-plane namespace's network label, each
	// namespace's labels for service scope (a relabel re-scopes its
	// services at once), and its Istio traffic-distribution annotation.
	cpNS := cfg.ControlPlaneNamespace
	d.watch(ctx, "namespaces", &corev1.Namespace{}, lw(
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return kube.CoreV1().Namespaces().List(ctx, o)
		},
		func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return kube.CoreV1().Namespaces().Watch(ctx, o)
		}),
		func(obj any) {
			ns := obj.(*corev1.Namespace)
			if ns.Name == cpNS {
				v.setNamespaceNetwork(model.Network(ns.Labels[NetworkLabel]))
			}
			v.setNamespaceLabels(ns.Name, internMap(ns.Labels))
			v.setNamespaceDistribution(ns.Name, ns.Annotations[TrafficDistributionAnnotation])
		},
		func(key string) {
			if key == cpNS {
				v.setNamespaceNetwork("")
			}
			v.setNamespaceLabels(key, nil)
			v.setNamespaceDistribution(key, "")
		})
	if sel := cfg.GatewayNamespaceSelector; sel != nil && !sel.Empty() {
		d.watch(ctx, "gateway-namespaces", &corev1.Namespace{}, lw(
			func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
				o.LabelSelector = sel.String()
				return kube.CoreV1().Namespaces().List(ctx, o)
			},
			func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
				o.LabelSelector = sel.String()
				return kube.CoreV1().Namespaces().Watch(ctx, o)
			}),
			func(obj any) { v.setGatewayNamespaceSelected(obj.(*corev1.Namespace).Name, true) },
			func(key string) { v.setGatewayNamespaceSelected(key, false) })
	}
}

func lw(list cache.ListWithContextFunc, w cache.WatchFuncWithContext) *cache.ListWatch {
	return &cache.ListWatch{ListWithContextFunc: list, WatchFuncWithContext: w}
}

// watch runs a reflector of one kind into a store feeding the view.
func (d *Discovery) watch(ctx context.Context, name string, example runtime.Object, lw *cache.ListWatch, put func(any), remove func(string)) {
	s := &store{name: name, v: d.v, put: put, remove: remove, keys: map[string]struct{}{}}
	d.stores = append(d.stores, s)
	r := cache.NewReflectorWithOptions(lw, example, s, cache.ReflectorOptions{Name: name + "@" + string(d.v.cluster)})
	d.wg.Go(func() { r.RunWithContext(ctx) })
}

// watchNamespaced is watch for a namespaced kind: when discovery selectors
// narrow the namespaces, its store keeps only the selected namespaces'
// objects and the scope runs its reflector.
func (d *Discovery) watchNamespaced(ctx context.Context, name string, example runtime.Object, lw *cache.ListWatch, put func(any), remove func(string)) {
	if d.scope == nil {
		d.watch(ctx, name, example, lw, put, remove)
		return
	}
	s := &store{name: name, v: d.v, put: put, remove: remove, keys: map[string]struct{}{}, inScope: d.v.inScope}
	d.stores = append(d.stores, s)
	d.scope.add(name, example, lw, s)
}

// HasSynced reports whether every watch has listed once. The first time it
// is true the view is handed to the sink.
func (d *Discovery) HasSynced() bool {
	for _, s := range d.stores {
		if !s.hasSynced() {
			return false
		}
	}
	d.v.activate()
	return true
}

// ObjectCounts implements multicluster.ObjectCounter: how many objects each
// watch holds (after discovery selectors), by the watch's kind.
func (d *Discovery) ObjectCounts() map[string]int {
	out := make(map[string]int, len(d.stores))
	for _, s := range d.stores {
		s.mu.Lock()
		out[s.name] += len(s.keys)
		s.mu.Unlock()
	}
	return out
}

// Close stops the watches, waits for them, and withdraws the view from the
// sink unless a newer generation serves.
func (d *Discovery) Close() {
	d.once.Do(func() {
		d.cancel()
		d.wg.Wait()
		d.v.deactivate()
	})
}

// store is a cache.ReflectorStore that keeps no objects: it converts each
// one into the view and remembers only keys (to diff relists).
type store struct {
	name   string // the kind it watches, as ObjectCounts reports it
	v      *view
	put    func(any)
	remove func(key string)
	// inScope, if set, says whether a namespace's objects are kept
	// (called with the view's mu held); others are ignored.
	inScope func(ns string) bool
	// replaced, if set, is called after each Replace (not under a lock).
	replaced func()

	mu     sync.Mutex
	keys   map[string]struct{}
	synced bool
}

func keyOf(obj any) (string, error) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		return d.Key, nil
	}
	m, err := meta.Accessor(obj)
	if err != nil {
		return "", err
	}
	if m.GetNamespace() == "" {
		return m.GetName(), nil
	}
	return m.GetNamespace() + "/" + m.GetName(), nil
}

func (s *store) apply(fn func()) {
	s.v.mu.Lock()
	defer s.v.mu.Unlock()
	fn()
	s.v.finish()
}

// Add implements cache.ReflectorStore.
func (s *store) Add(obj any) error { return s.Update(obj) }

// Update implements cache.ReflectorStore.
func (s *store) Update(obj any) error {
	key, err := keyOf(obj)
	if err != nil {
		return err
	}
	s.apply(func() {
		if !s.keeps(key) {
			return
		}
		s.mu.Lock()
		s.keys[key] = struct{}{}
		s.mu.Unlock()
		s.put(obj)
	})
	return nil
}

// keeps reports whether the object of key is in scope. Called with the
// view's mu held.
func (s *store) keeps(key string) bool {
	if s.inScope == nil {
		return true
	}
	ns, _ := splitKey(key)
	return s.inScope(ns)
}

// Delete implements cache.ReflectorStore.
func (s *store) Delete(obj any) error {
	key, err := keyOf(obj)
	if err != nil {
		return err
	}
	s.mu.Lock()
	delete(s.keys, key)
	s.mu.Unlock()
	s.apply(func() { s.remove(key) })
	return nil
}

// forgetNamespace drops the keys of namespace ns (whose objects the view
// dropped when it left the selection). Called with the view's mu held.
func (s *store) forgetNamespace(ns string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for key := range s.keys {
		if kns, _ := splitKey(key); kns == ns {
			delete(s.keys, key)
		}
	}
}

// Replace implements cache.ReflectorStore: a (re)list. Keys not listed are
// removed; the rest are upserted (equal values change nothing).
func (s *store) Replace(list []any, _ string) error {
	keys := make([]string, len(list))
	for i, obj := range list {
		key, err := keyOf(obj)
		if err != nil {
			return err
		}
		keys[i] = key
	}
	s.apply(func() {
		next := make(map[string]struct{}, len(list))
		for _, key := range keys {
			if s.keeps(key) {
				next[key] = struct{}{}
			}
		}
		s.mu.Lock()
		prev := s.keys
		s.keys = next
		s.mu.Unlock()
		for key := range prev {
			if _, ok := next[key]; !ok {
				s.remove(key)
			}
		}
		for i, obj := range list {
			if _, ok := next[keys[i]]; ok {
				s.put(obj)
			}
		}
	})
	s.mu.Lock()
	s.synced = true
	s.mu.Unlock()
	if s.replaced != nil {
		s.replaced()
	}
	return nil
}

// Resync implements cache.ReflectorStore.
func (s *store) Resync() error { return nil }

func (s *store) hasSynced() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.synced
}
