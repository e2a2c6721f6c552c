package controller

import (
	"context"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/isthmus-mesh/isthmus/multicluster"
)

// scope narrows one cluster generation's discovery to the namespaces its
// discovery selectors match (multicluster.Cluster.Namespaces), plus the
// gateway namespaces, which are always discovered.
//
// A watch of Namespaces decides which are selected: on the API server when
// there is one selector (a namespace relabeled out of it is then delivered
// as deleted), else every namespace, matched here. The namespaced watches
// (Pods, Services, EndpointSlices, ServiceExports) cannot be narrowed by a
// namespace's labels on the API server: they watch every namespace, and
// their stores drop the objects of unselected namespaces on arrival, so
// memory follows the selection, not the cluster.
//
// A namespace leaving the selection drops its objects from the view at
// once. One entering it needs objects that were dropped: the namespaced
// watches are restarted (stopped, then listed again), which replays every
// object in the order the API server gives; such changes are rare, and
// coalesce.
type scope struct {
	d   *Discovery
	sel *multicluster.NamespaceSelection

	watches []scopedWatch
	// kick asks run to (re)start the namespaced watches.
	kick    chan struct{}
	started atomic.Bool // the namespace watch has listed once
}

type scopedWatch struct {
	name    string
	example runtime.Object
	lw      *cache.ListWatch
	store   *store
}

func newScope(d *Discovery, sel *multicluster.NamespaceSelection) *scope {
	d.v.discovered = map[string]bool{}
	sc := &scope{d: d, sel: sel, kick: make(chan struct{}, 1)}
	d.v.onEnter = sc.signal
	return sc
}

func (sc *scope) signal() {
	if !sc.started.Load() {
		return // the first start follows the namespace list
	}
	select {
	case sc.kick <- struct{}{}:
	default:
	}
}

func (sc *scope) add(name string, example runtime.Object, lw *cache.ListWatch, s *store) {
	sc.watches = append(sc.watches, scopedWatch{name, example, lw, s})
	sc.d.v.scoped = append(sc.d.v.scoped, s)
}

// start watches the namespaces and runs the namespaced watches once they
// have been listed.
func (sc *scope) start(ctx context.Context, kube kubernetes.Interface) {
	d, v := sc.d, sc.d.v
	server := ""
	if s := sc.sel.ServerSelector(); s != nil {
		server = s.String()
	}
	s := &store{name: "selected-namespaces", v: v, keys: map[string]struct{}{},
		put: func(obj any) {
			ns := obj.(*corev1.Namespace)
			v.setDiscovered(ns.Name, sc.sel.Matches(ns.Labels))
		},
		remove: func(key string) { v.setDiscovered(key, false) },
		replaced: func() {
			if !sc.started.Swap(true) {
				sc.kick <- struct{}{}
			}
		},
	}
	d.stores = append(d.stores, s)
	lw := lw(
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.LabelSelector = server
			return kube.CoreV1().Namespaces().List(ctx, o)
		},
		func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.LabelSelector = server
			return kube.CoreV1().Namespaces().Watch(ctx, o)
		})
	r := cache.NewReflectorWithOptions(lw, &corev1.Namespace{}, s, cache.ReflectorOptions{Name: "discovery-namespaces@" + string(v.cluster)})
	d.wg.Go(func() { r.RunWithContext(ctx) })
	d.wg.Go(func() { sc.run(ctx) })
}

// run (re)starts the namespaced watches at each kick until ctx ends. A
// restart stops the running reflectors and waits for them before the new
// ones list, so no event of the old ones follows the new list.
func (sc *scope) run(ctx context.Context) {
	stop := func() {}
	defer func() { stop() }()
	for {
		select {
		case <-ctx.Done():
			return
		case <-sc.kick:
		}
		stop()
		stop = sc.runWatches(ctx)
		// Coalesce a burst of namespaces entering (a label applied to
		// several at once) into one restart.
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// runWatches starts the namespaced reflectors; the function returned stops
// them and waits for them.
func (sc *scope) runWatches(ctx context.Context) (stop func()) {
	wctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for _, w := range sc.watches {
		r := cache.NewReflectorWithOptions(w.lw, w.example, w.store, cache.ReflectorOptions{Name: w.name + "@" + string(sc.d.v.cluster)})
		wg.Go(func() { r.RunWithContext(wctx) })
	}
	return func() {
		cancel()
		wg.Wait()
	}
}

// inScope reports whether namespace ns is discovered. Called with mu held.
func (v *view) inScope(ns string) bool {
	return v.discovered == nil || v.discovered[ns] || v.gatewayNS[ns]
}

// setDiscovered records whether namespace ns is selected. One leaving the
// selection takes its services, workloads and endpoints with it; one
// entering asks for the namespaced watches to list again. Called with mu
// held.
func (v *view) setDiscovered(ns string, selected bool) {
	if v.discovered[ns] == selected {
		return
	}
	if selected {
		v.discovered[ns] = true
		if !v.gatewayNS[ns] && v.onEnter != nil {
			v.onEnter()
		}
		return
	}
	delete(v.discovered, ns)
	if !v.gatewayNS[ns] {
		v.dropNamespace(ns)
	}
}

// dropNamespace removes every object of namespace ns from the view and
// forgets their keys. Called with mu held.
func (v *view) dropNamespace(ns string) {
	for _, s := range v.scoped {
		s.forgetNamespace(ns)
	}
	for _, name := range slices.Sorted(maps.Keys(v.podsByNS[ns])) {
		v.removePod(ns + "/" + name)
	}
	prefix := ns + "/"
	for _, key := range slices.Sorted(maps.Keys(v.slices)) {
		if strings.HasPrefix(key, prefix) {
			v.removeSlice(key)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(v.svcsByNS[ns])) {
		v.removeService(prefix + name)
	}
	for k := range v.exported {
		if k.Namespace == ns {
			v.setExported(k, false, time.Time{})
		}
	}
}
