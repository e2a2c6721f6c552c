package policy

import (
	"context"
	"errors"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	securityclient "istio.io/client-go/pkg/apis/security/v1"
	"istio.io/client-go/pkg/clientset/versioned"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"

	"github.com/prometheus/client_golang/prometheus"

	securityv1 "github.com/isthmus-mesh/isthmus/pilot/api/security/v1"
)

// Config configures a Watcher.
type Config struct {
	// RootNamespace is the mesh's root namespace (the control plane's):
	// policies there without a selector are mesh-wide. Required.
	RootNamespace string
	// TrustDomains are the mesh's trust domain and its aliases, applied
	// to principals (optional).
	TrustDomains TrustDomains
}

// Deps are the Watcher's collaborators; Client is required.
type Deps struct {
	// Client reads the config cluster's security.istio.io objects.
	Client versioned.Interface
	// Registerer receives the metrics; a private registry by default.
	Registerer prometheus.Registerer
	// Log defaults to a discarding logger.
	Log *slog.Logger
}

// Watcher follows the AuthorizationPolicies and PeerAuthentications of the
// config cluster (every namespace), converts them, and publishes the result
// as immutable Snapshots. A missing CRD counts as no policies of that kind
// (none can exist) and is reported; the watch retries until it appears.
// Snapshot, HasSynced and Subscribe are safe for concurrent use.
type Watcher struct {
	cfg     Config
	deps    Deps
	log     *slog.Logger
	metrics *metrics

	aps, pas   cache.Store
	apc, pac   cache.Controller
	absent     [2]atomic.Bool // CRD not served: [AuthorizationPolicy, PeerAuthentication]
	kick       chan struct{}
	snap       atomic.Pointer[Snapshot]
	synced     atomic.Bool
	mu         sync.Mutex
	subs       map[int]func()
	nextSub    int
	logged     map[string]string // key -> problems last logged
	runStarted atomic.Bool
}

// New returns a Watcher; it does no I/O until Run.
func New(cfg Config, deps Deps) (*Watcher, error) {
	if cfg.RootNamespace == "" || deps.Client == nil {
		return nil, errors.New("policy: RootNamespace and Client are required")
	}
	if deps.Registerer == nil {
		deps.Registerer = prometheus.NewRegistry()
	}
	if deps.Log == nil {
		deps.Log = slog.New(slog.DiscardHandler)
	}
	m, err := newMetrics(deps.Registerer)
	if err != nil {
		return nil, err
	}
	w := &Watcher{cfg: cfg, deps: deps, log: deps.Log.With("component", "policy"), metrics: m,
		kick: make(chan struct{}, 1), subs: map[int]func(){}, logged: map[string]string{}}
	empty, _ := NewSnapshot(cfg.RootNamespace, nil, nil)
	w.snap.Store(empty)
	onChange := func(kind string) cache.ResourceEventHandlerFuncs {
		return cache.ResourceEventHandlerFuncs{
			AddFunc:    func(any) { w.event(kind, EventAdd) },
			UpdateFunc: func(any, any) { w.event(kind, EventUpdate) },
			DeleteFunc: func(any) { w.event(kind, EventDelete) },
		}
	}
	sec := deps.Client.SecurityV1()
	w.aps, w.apc = cache.NewInformerWithOptions(cache.InformerOptions{
		ObjectType: &securityclient.AuthorizationPolicy{}, Handler: onChange(KindAuthorizationPolicy),
		ListerWatcher: w.listWatch(0,
			func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
				return sec.AuthorizationPolicies(metav1.NamespaceAll).List(ctx, o)
			},
			func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
				return sec.AuthorizationPolicies(metav1.NamespaceAll).Watch(ctx, o)
			}, &securityclient.AuthorizationPolicyList{}),
	})
	w.pas, w.pac = cache.NewInformerWithOptions(cache.InformerOptions{
		ObjectType: &securityclient.PeerAuthentication{}, Handler: onChange(KindPeerAuthentication),
		ListerWatcher: w.listWatch(1,
			func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
				return sec.PeerAuthentications(metav1.NamespaceAll).List(ctx, o)
			},
			func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
				return sec.PeerAuthentications(metav1.NamespaceAll).Watch(ctx, o)
			}, &securityclient.PeerAuthenticationList{}),
	})
	return w, nil
}

// listWatch wraps a kind's list and watch: a list that finds no such
// resource (the CRD is not installed) is an empty list, and the kind is
// marked absent until a list or watch succeeds (the reflector may use
// either first).
func (w *Watcher) listWatch(kind int, list cache.ListWithContextFunc, wf cache.WatchFuncWithContext, empty runtime.Object) *cache.ListWatch {
	return &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			obj, err := list(ctx, o)
			if apierrors.IsNotFound(err) {
				w.setAbsent(kind, true)
				return empty.DeepCopyObject(), nil
			}
			if err == nil {
				w.setAbsent(kind, false)
			}
			return obj, err
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			wi, err := wf(ctx, o)
			switch {
			case apierrors.IsNotFound(err):
				w.setAbsent(kind, true)
			case err == nil:
				w.setAbsent(kind, false)
			}
			return wi, err
		},
	}
}

// setAbsent records whether the kind's CRD is served, logging and
// republishing on a change.
func (w *Watcher) setAbsent(kind int, absent bool) {
	if w.absent[kind].Swap(absent) == absent {
		return
	}
	if absent {
		w.log.Warn("policy CRD not installed: no policies of this kind apply", "kind", kindNames[kind])
	} else {
		w.log.Info("policy CRD installed", "kind", kindNames[kind])
	}
	w.poke()
}

var kindNames = [2]string{KindAuthorizationPolicy, KindPeerAuthentication}

// Events of pilot_k8s_cfg_events, as Istio names them.
const (
	EventAdd    = "add"
	EventUpdate = "update"
	EventDelete = "delete"
)

// event counts an informer event on a policy of kind and schedules a
// rebuild.
func (w *Watcher) event(kind, event string) {
	w.metrics.events.WithLabelValues(kind, event).Inc()
	w.poke()
}

func (w *Watcher) poke() {
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

// Snapshot returns the current policies.
func (w *Watcher) Snapshot() *Snapshot { return w.snap.Load() }

// HasSynced reports whether the policies were read once (both kinds listed
// and converted).
func (w *Watcher) HasSynced() bool { return w.synced.Load() }

// Absent returns the kinds whose CRD the config cluster does not serve.
func (w *Watcher) Absent() []string {
	var out []string
	for i, k := range kindNames {
		if w.absent[i].Load() {
			out = append(out, k)
		}
	}
	return out
}

// Subscribe calls fn, from Run's goroutine, after each new snapshot (and
// once when the policies first sync). cancel stops the calls.
func (w *Watcher) Subscribe(fn func()) (cancel func()) {
	w.mu.Lock()
	defer w.mu.Unlock()
	id := w.nextSub
	w.nextSub++
	w.subs[id] = fn
	return func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		delete(w.subs, id)
	}
}

// Run watches until ctx ends; it may be called once.
func (w *Watcher) Run(ctx context.Context) error {
	if !w.runStarted.CompareAndSwap(false, true) {
		return errors.New("policy: Run called twice")
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() { w.apc.RunWithContext(ctx) })
	wg.Go(func() { w.pac.RunWithContext(ctx) })
	if !cache.WaitForCacheSync(ctx.Done(), w.apc.HasSynced, w.pac.HasSynced) {
		return nil
	}
	w.rebuild()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-w.kick:
			w.rebuild()
		}
	}
}

// rebuild converts every object into a new snapshot and publishes it.
func (w *Watcher) rebuild() {
	root := w.cfg.RootNamespace
	var aps []*Policy
	for _, o := range w.aps.List() {
		aps = append(aps, ConvertAuthorizationPolicyIn(root, w.cfg.TrustDomains, o.(*securityclient.AuthorizationPolicy)))
	}
	var pas []*PeerAuth
	for _, o := range w.pas.List() {
		pas = append(pas, ConvertPeerAuthentication(root, o.(*securityclient.PeerAuthentication)))
	}
	snap, err := NewSnapshot(root, aps, pas)
	if err != nil {
		// Encoding a converted policy cannot fail; keep the last snapshot.
		w.log.Error("policy snapshot not built; keeping the last one", "err", err)
		return
	}
	w.snap.Store(snap)
	w.synced.Store(true)
	w.report(snap)
	w.mu.Lock()
	subs := make([]func(), 0, len(w.subs))
	for _, id := range slices.Sorted(maps.Keys(w.subs)) {
		subs = append(subs, w.subs[id])
	}
	w.mu.Unlock()
	for _, fn := range subs {
		fn()
	}
}

// report sets the problem gauges and logs the problems of each policy once
// per change of them.
func (w *Watcher) report(s *Snapshot) {
	w.metrics.set(s, w.Absent())
	seen := map[string]bool{}
	logOnce := func(kind, key string, problems []*securityv1.Problem) {
		id := kind + "/" + key
		seen[id] = true
		text := describeProblems(problems)
		if w.logged[id] == text {
			return
		}
		w.logged[id] = text
		if text != "" {
			w.log.Warn("policy not enforced as written", "kind", kind, "policy", key, "problems", text)
		}
	}
	for _, p := range s.Policies() {
		logOnce(KindAuthorizationPolicy, p.Key(), p.Problems)
	}
	for _, p := range s.PeerAuths() {
		logOnce(KindPeerAuthentication, p.Key(), p.Problems)
	}
	for id := range w.logged {
		if !seen[id] {
			delete(w.logged, id)
		}
	}
}

// describeProblems renders problems for a log line.
func describeProblems(ps []*securityv1.Problem) string {
	parts := make([]string, len(ps))
	for i, p := range ps {
		parts[i] = p.GetReason() + " " + p.GetField() + ": " + p.GetEffect()
	}
	return strings.Join(parts, "; ")
}
