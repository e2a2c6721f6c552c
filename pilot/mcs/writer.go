package mcs

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"sync"
	"time"

	"github.com/isthmus-mesh/isthmus/internal/backoff"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	mcsv1beta1 "sigs.k8s.io/mcs-api/pkg/apis/v1beta1"
)

// ServiceImportGVR is the ServiceImport resource written.
var ServiceImportGVR = schema.GroupVersionResource{Group: "multicluster.x-k8s.io", Version: "v1beta1", Resource: "serviceimports"}

var namespaceGVR = schema.GroupVersionResource{Version: "v1", Resource: "namespaces"}

// Ownership label: the writer deletes only ServiceImports carrying it, and
// never changes one without it (another MCS implementation's).
const (
	ManagedByLabel = "app.kubernetes.io/managed-by"
	ManagedByValue = "isthmus"
)

// ConditionConflict is the condition type on ServiceImports that reports
// conflicting exports (the type the MCS API uses on ServiceExports).
const ConditionConflict = string(mcsv1beta1.ServiceExportConditionConflict)

// Cluster is a cluster to write ServiceImports to.
type Cluster struct {
	Name   string
	Client dynamic.Interface
	// Network is the cluster's network: its imported EndpointSlices list
	// the exporting clusters' endpoints on that network.
	Network string
}

// Config configures a Writer. Zero fields take the defaults of
// DefaultConfig.
type Config struct {
	// Debounce is how long Run waits after a Notify for more changes; the
	// first change after a quiet period is written at once.
	Debounce time.Duration
	// Resync is how often Run reconciles without a Notify, repairing
	// drift (a deleted or edited ServiceImport, a new namespace).
	Resync time.Duration
	// RetryMax caps the backoff after a failed reconcile.
	RetryMax time.Duration
	// ClusterTimeout bounds the pass over one cluster, so that an
	// unreachable cluster does not hold up the others.
	ClusterTimeout time.Duration
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{Debounce: 100 * time.Millisecond, Resync: 5 * time.Minute, RetryMax: 30 * time.Second,
		ClusterTimeout: 30 * time.Second}
}

// Deps are the Writer's collaborators.
type Deps struct {
	// Services returns every exported service of the federation (required).
	Services func() []Service
	// Clusters returns the clusters to write to (required).
	Clusters func() []Cluster
	// Log receives errors; nil discards.
	Log *slog.Logger
}

func (c Config) withDefaults() Config {
	d := DefaultConfig()
	if c.Debounce <= 0 {
		c.Debounce = d.Debounce
	}
	if c.Resync <= 0 {
		c.Resync = d.Resync
	}
	if c.RetryMax <= 0 {
		c.RetryMax = d.RetryMax
	}
	if c.ClusterTimeout <= 0 {
		c.ClusterTimeout = d.ClusterTimeout
	}
	return c
}

// Writer keeps ServiceImports in every cluster equal to the merged exports.
// Run it in one replica only (it writes to clusters). Notify, Conflicts and
// Imports are safe for concurrent use.
type Writer struct {
	cfg    Config
	deps   Deps
	log    *slog.Logger
	notify chan struct{}

	mu      sync.Mutex
	imports map[string]Import // "<ns>/<name>" -> last merged import
	runMu   sync.Mutex        // serializes Reconcile
}

// New makes a Writer.
func New(cfg Config, deps Deps) (*Writer, error) {
	if deps.Services == nil || deps.Clusters == nil {
		return nil, errors.New("mcs: Services and Clusters are required")
	}
	w := &Writer{cfg: cfg.withDefaults(), deps: deps, log: deps.Log, notify: make(chan struct{}, 1), imports: map[string]Import{}}
	if w.log == nil {
		w.log = slog.New(slog.DiscardHandler)
	}
	return w, nil
}

// Notify tells Run that the exported services or the clusters changed. It
// never blocks.
func (w *Writer) Notify() {
	select {
	case w.notify <- struct{}{}:
	default:
	}
}

// Conflicts returns the conflicts of the exported service ns/name as of
// the last reconcile (nil when none or not exported), for the Conflict
// condition of its ServiceExports.
func (w *Writer) Conflicts(ns, name string) []Conflict {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.imports[ns+"/"+name].Conflicts
}

// Run reconciles at start, after each Notify (debounced with a leading
// edge), every Resync, and after a failure with capped exponential backoff,
// until ctx ends.
func (w *Writer) Run(ctx context.Context) error {
	failures := backoff.New(w.cfg.Debounce, w.cfg.RetryMax)
	last := time.Time{}
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-w.notify:
			// Also while a retry is pending: a cluster that keeps failing
			// must not delay the others' changes.
			if wait := w.cfg.Debounce - time.Since(last); wait > 0 {
				timer.Reset(wait) // inside the quiet period: merge with what follows
				continue
			}
		case <-timer.C:
		}
		last = time.Now()
		if err := w.Reconcile(ctx); err != nil {
			delay := failures.Next()
			w.log.Warn("writing ServiceImports failed; retrying", "in", delay, "error", err)
			timer.Reset(delay)
			continue
		}
		failures.Reset()
		timer.Reset(w.cfg.Resync)
	}
}

// Reconcile makes one full pass: it merges every exported service and, in
// each cluster, creates or updates its ServiceImport where its namespace
// exists and deletes managed ServiceImports of services no longer exported.
// A cluster that fails does not stop the others; errors are joined.
func (w *Writer) Reconcile(ctx context.Context) error {
	w.runMu.Lock()
	defer w.runMu.Unlock()
	desired := map[string]Import{}
	for _, s := range w.deps.Services() {
		if len(s.Exports) == 0 {
			continue
		}
		desired[s.Namespace+"/"+s.Name] = Merge(s)
	}
	w.mu.Lock()
	w.imports = desired
	w.mu.Unlock()
	var errs []error
	for _, c := range w.deps.Clusters() {
		cctx, cancel := context.WithTimeout(ctx, w.cfg.ClusterTimeout)
		err := w.reconcileCluster(cctx, c, desired)
		cancel()
		if err != nil {
			errs = append(errs, fmt.Errorf("cluster %s: %w", c.Name, err))
		}
	}
	return errors.Join(errs...)
}

func (w *Writer) reconcileCluster(ctx context.Context, c Cluster, desired map[string]Import) error {
	nsList, err := c.Client.Resource(namespaceGVR).List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list namespaces: %w", err)
	}
	namespaces := map[string]bool{}
	for _, ns := range nsList.Items {
		namespaces[ns.GetName()] = ns.GetDeletionTimestamp() == nil
	}
	res := c.Client.Resource(ServiceImportGVR)
	existing, err := listManaged(ctx, res, ManagedByLabel+"="+ManagedByValue)
	if err != nil {
		return fmt.Errorf("list ServiceImports (is the MCS CRD installed?): %w", err)
	}
	var errs []error
	owners := map[string]types.UID{} // the ServiceImports the slices belong to
	for key, imp := range desired {
		if !namespaces[imp.Namespace] {
			continue
		}
		uid, err := w.apply(ctx, res, imp, existing[key])
		if err != nil {
			errs = append(errs, fmt.Errorf("ServiceImport %s: %w", key, err))
		}
		if uid != "" {
			owners[key] = uid
		}
	}
	for key, u := range existing {
		if _, ok := desired[key]; ok && namespaces[u.GetNamespace()] {
			continue
		}
		err := res.Namespace(u.GetNamespace()).Delete(ctx, u.GetName(), metav1.DeleteOptions{
			Preconditions: &metav1.Preconditions{UID: ptr(u.GetUID())}})
		if err != nil && !apierrors.IsNotFound(err) {
			errs = append(errs, fmt.Errorf("delete ServiceImport %s: %w", key, err))
		}
	}
	// After the imports: a slice is written only with its owner's UID, and
	// the slices of a deleted import go with it (also without a garbage
	// collector).
	if err := w.reconcileSlices(ctx, c, desired, owners); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

func ptr[T any](v T) *T { return &v }

// apply creates or updates the ServiceImport of imp (spec, then status)
// and returns its UID ("" when there is no managed ServiceImport).
func (w *Writer) apply(ctx context.Context, res dynamic.NamespaceableResourceInterface, imp Import, cur *unstructured.Unstructured) (types.UID, error) {
	want := desiredObject(imp)
	ri := res.Namespace(imp.Namespace)
	var si mcsv1beta1.ServiceImport
	if cur == nil {
		obj, err := toUnstructured(want)
		if err != nil {
			return "", err
		}
		created, err := ri.Create(ctx, obj, metav1.CreateOptions{})
		if apierrors.IsAlreadyExists(err) {
			return "", fmt.Errorf("a ServiceImport not managed by Isthmus exists; left alone")
		}
		if err != nil {
			return "", err
		}
		cur = created
	}
	uid := cur.GetUID()
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(cur.Object, &si); err != nil {
		return uid, err
	}
	if !equality.Semantic.DeepEqual(si.Spec, want.Spec) {
		si.Spec = want.Spec
		obj, err := toUnstructured(&si)
		if err != nil {
			return uid, err
		}
		if cur, err = ri.Update(ctx, obj, metav1.UpdateOptions{}); err != nil {
			return uid, err
		}
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(cur.Object, &si); err != nil {
			return uid, err
		}
	}
	status := desiredStatus(imp, si.Status.Conditions, si.Generation)
	if equality.Semantic.DeepEqual(si.Status, status) {
		return uid, nil
	}
	si.Status = status
	obj, err := toUnstructured(&si)
	if err != nil {
		return uid, err
	}
	_, err = ri.UpdateStatus(ctx, obj, metav1.UpdateOptions{})
	return uid, err
}

func toUnstructured(si *mcsv1beta1.ServiceImport) (*unstructured.Unstructured, error) {
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(si)
	if err != nil {
		return nil, err
	}
	u := &unstructured.Unstructured{Object: m}
	u.SetAPIVersion(mcsv1beta1.GroupVersion.String())
	u.SetKind(mcsv1beta1.ServiceImportKindName)
	return u, nil
}

// desiredObject is the ServiceImport (without status) for imp.
func desiredObject(imp Import) *mcsv1beta1.ServiceImport {
	si := &mcsv1beta1.ServiceImport{
		ObjectMeta: metav1.ObjectMeta{Name: imp.Name, Namespace: imp.Namespace, Labels: map[string]string{ManagedByLabel: ManagedByValue}},
		Spec:       mcsv1beta1.ServiceImportSpec{Type: imp.Type, Ports: []mcsv1beta1.ServicePort{}},
	}
	for _, p := range imp.Ports {
		sp := mcsv1beta1.ServicePort{Name: p.Name, Protocol: p.protocol(), Port: p.Port}
		if p.AppProtocol != "" {
			sp.AppProtocol = ptr(p.AppProtocol)
		}
		si.Spec.Ports = append(si.Spec.Ports, sp)
	}
	for _, a := range imp.IPs {
		si.Spec.IPs = append(si.Spec.IPs, a.String())
		si.Spec.IPFamilies = append(si.Spec.IPFamilies, family(a))
	}
	return si
}

func family(a netip.Addr) corev1.IPFamily {
	if a.Is4() {
		return corev1.IPv4Protocol
	}
	return corev1.IPv6Protocol
}

// desiredStatus is the status for imp, keeping the transition times of
// conditions that did not change.
func desiredStatus(imp Import, conds []metav1.Condition, gen int64) mcsv1beta1.ServiceImportStatus {
	st := mcsv1beta1.ServiceImportStatus{}
	for _, c := range imp.Clusters {
		st.Clusters = append(st.Clusters, mcsv1beta1.ClusterStatus{Cluster: c})
	}
	ready := metav1.Condition{Type: string(mcsv1beta1.ServiceImportConditionReady), Status: metav1.ConditionTrue,
		Reason: string(mcsv1beta1.ServiceImportReasonReady), Message: "imported from " + fmt.Sprint(imp.Clusters), ObservedGeneration: gen}
	if imp.Type == mcsv1beta1.ClusterSetIP && len(imp.IPs) == 0 {
		ready.Status, ready.Reason, ready.Message = metav1.ConditionFalse, string(mcsv1beta1.ServiceImportReasonPending), "no clusterset IP allocated yet"
	}
	conflict := metav1.Condition{Type: ConditionConflict, Status: metav1.ConditionFalse, Reason: ReasonNoConflicts,
		Message: "no conflict", ObservedGeneration: gen}
	if len(imp.Conflicts) > 0 {
		conflict.Status, conflict.Reason = metav1.ConditionTrue, imp.Conflicts[0].Reason
		conflict.Message = ""
		for i, c := range imp.Conflicts {
			if i > 0 {
				conflict.Message += "; "
			}
			conflict.Message += c.Reason + ": " + c.Message
		}
	}
	st.Conditions = append([]metav1.Condition(nil), conds...)
	meta.SetStatusCondition(&st.Conditions, ready)
	meta.SetStatusCondition(&st.Conditions, conflict)
	return st
}

// listManaged lists the objects of res that selector finds, by
// "<namespace>/<name>".
func listManaged(ctx context.Context, res dynamic.NamespaceableResourceInterface, selector string) (map[string]*unstructured.Unstructured, error) {
	list, err := res.List(ctx, metav1.ListOptions{LabelSelector: selector})
	if err != nil {
		return nil, err
	}
	out := make(map[string]*unstructured.Unstructured, len(list.Items))
	for i := range list.Items {
		u := &list.Items[i]
		out[u.GetNamespace()+"/"+u.GetName()] = u
	}
	return out, nil
}
