package eastwest

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync/atomic"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/workqueue"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	gwv1 "sigs.k8s.io/gateway-api/apis/v1"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// reconcileQueue is the controller's work queue.
type reconcileQueue = workqueue.TypedRateLimitingInterface[reconcile.Request]

// reconciler reconciles the class and the Gateways of one cluster. Reads
// come from the cache, writes go to the API server; a conflict or a failed
// write is returned, and controller-runtime retries the item with backoff.
type reconciler struct {
	cfg     Config
	deps    Deps
	cluster model.ClusterID
	client  client.Client
	log     *slog.Logger
	synced  *atomic.Bool
}

// Reconcile implements reconcile.Reconciler. A replica that is not the
// leader writes nothing.
func (r *reconciler) Reconcile(ctx context.Context, req reconcile.Request) (reconcile.Result, error) {
	if req.Namespace == "" {
		err := r.reconcileClass(ctx)
		if err == nil {
			r.synced.Store(true)
		}
		return retryConflict(err)
	}
	if !r.deps.Leading() {
		return reconcile.Result{}, nil
	}
	return retryConflict(r.reconcileGateway(ctx, req.NamespacedName))
}

// conflictRetry is how soon an item whose write met a newer version (the
// cache had not yet seen this controller's previous write) is retried.
const conflictRetry = 100 * time.Millisecond

// retryConflict turns a write conflict into a quiet retry: it is expected
// right after this controller's own writes, and is not an error.
func retryConflict(err error) (reconcile.Result, error) {
	if apierrors.IsConflict(err) {
		return reconcile.Result{RequeueAfter: conflictRetry}, nil
	}
	return reconcile.Result{}, err
}

// reconcileClass makes the GatewayClass exist with this controller's name
// and status Accepted. A class of that name owned by another controller is
// left alone (its controllerName is immutable), and its Gateways are not
// served.
func (r *reconciler) reconcileClass(ctx context.Context) error {
	if !r.deps.Leading() {
		return nil
	}
	var gc gwv1.GatewayClass
	err := r.client.Get(ctx, client.ObjectKey{Name: ClassName}, &gc)
	if apierrors.IsNotFound(err) {
		gc = gwv1.GatewayClass{
			ObjectMeta: metav1.ObjectMeta{Name: ClassName, Labels: map[string]string{managedByLabel: managedBy}},
			Spec: gwv1.GatewayClassSpec{ControllerName: ControllerName,
				Description: new("Isthmus east-west gateways: HBONE on 15008, deployed by pilot")},
		}
		if err := r.client.Create(ctx, &gc); err != nil {
			return fmt.Errorf("create GatewayClass: %w", err)
		}
		r.log.Info("GatewayClass created", "class", ClassName)
	} else if err != nil {
		return err
	}
	if gc.Spec.ControllerName != ControllerName {
		r.log.Warn("GatewayClass belongs to another controller: its Gateways are not served", "class", ClassName, "controller", gc.Spec.ControllerName)
		return nil
	}
	cond := metav1.Condition{Type: string(gwv1.GatewayClassConditionStatusAccepted), Status: metav1.ConditionTrue,
		Reason: string(gwv1.GatewayClassReasonAccepted), Message: "Handled by Isthmus pilot", ObservedGeneration: gc.Generation}
	if !setCondition(&gc.Status.Conditions, cond) {
		return nil
	}
	if err := r.client.Status().Update(ctx, &gc); err != nil {
		return fmt.Errorf("GatewayClass status: %w", err)
	}
	return nil
}

// ours reports whether the class exists and is this controller's.
func (r *reconciler) ours(ctx context.Context) (bool, error) {
	var gc gwv1.GatewayClass
	err := r.client.Get(ctx, client.ObjectKey{Name: ClassName}, &gc)
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	return err == nil && gc.Spec.ControllerName == ControllerName, err
}

// reconcileGateway deploys a served Gateway, writes its status, and
// removes what it made for Gateways that are gone, left the class, or are
// refused.
func (r *reconciler) reconcileGateway(ctx context.Context, key types.NamespacedName) error {
	var gw gwv1.Gateway
	err := r.client.Get(ctx, key, &gw)
	if apierrors.IsNotFound(err) {
		return r.cleanup(ctx, key, "")
	}
	if err != nil {
		return err
	}
	ours, err := r.ours(ctx)
	if err != nil {
		return err
	}
	if !ours || string(gw.Spec.GatewayClassName) != ClassName {
		return r.cleanup(ctx, key, "")
	}
	trusted, err := r.trustedNamespace(ctx, gw.Namespace)
	if err != nil {
		return err
	}
	v := validate(&gw, trusted)
	if !v.accepted {
		if err := r.cleanup(ctx, key, ""); err != nil {
			return err
		}
		return r.writeStatus(ctx, &gw, v, nil, nil)
	}
	objs := build(r.cfg, r.cluster, &gw, v.network)
	for _, o := range objs.all() {
		if err := r.client.Apply(ctx, o, client.FieldOwner(fieldOwner), client.ForceOwnership); err != nil {
			return fmt.Errorf("apply %T %s/%s: %w", o, gw.Namespace, objs.name, err)
		}
	}
	if err := r.cleanup(ctx, key, gw.UID); err != nil {
		return err
	}
	if err := r.syncRoots(ctx, gw.Namespace); err != nil {
		return err
	}
	var svc corev1.Service
	var dep appsv1.Deployment
	made := client.ObjectKey{Namespace: gw.Namespace, Name: objs.name}
	for _, o := range []client.Object{&svc, &dep} {
		if err := r.client.Get(ctx, made, o); err != nil && !apierrors.IsNotFound(err) {
			return err
		}
	}
	return r.writeStatus(ctx, &gw, v, &svc, &dep)
}

// trustedNamespace reports whether ns is a gateway namespace: listed, or
// selected by its labels.
func (r *reconciler) trustedNamespace(ctx context.Context, ns string) (bool, error) {
	if slices.Contains(r.cfg.GatewayNamespaces, ns) {
		return true, nil
	}
	sel := r.cfg.GatewayNamespaceSelector
	if sel == nil || sel.Empty() {
		return false, nil
	}
	var n corev1.Namespace
	if err := r.client.Get(ctx, client.ObjectKey{Name: ns}, &n); err != nil {
		return false, client.IgnoreNotFound(err)
	}
	return sel.Matches(labels.Set(n.Labels)), nil
}

// cleanup deletes the objects made for the Gateway key whose owner is not
// the Gateway of UID keep ("": none is kept), and then the namespace's
// root ConfigMap copy if no served Gateway needs it.
func (r *reconciler) cleanup(ctx context.Context, key types.NamespacedName, keep types.UID) error {
	sel := client.MatchingLabels{managedByLabel: managedBy, gwv1.GatewayClassNameLabelKey: ClassName, gwv1.GatewayNameLabelKey: key.Name}
	in := client.InNamespace(key.Namespace)
	stale, err := r.staleServiceAccount(ctx, key, keep)
	if err != nil {
		return err
	}
	var deps appsv1.DeploymentList
	var svcs corev1.ServiceList
	for _, l := range []client.ObjectList{&deps, &svcs} {
		if err := r.client.List(ctx, l, in, sel); err != nil {
			return err
		}
		items, err := meta.ExtractList(l)
		if err != nil {
			return err
		}
		for _, it := range items {
			o := it.(client.Object)
			if keep == "" || !ownedBy(o, keep) {
				stale = append(stale, o)
			}
		}
	}
	for _, o := range stale {
		if err := r.client.Delete(ctx, o, client.Preconditions{UID: new(o.GetUID())}); client.IgnoreNotFound(err) != nil && !apierrors.IsConflict(err) {
			return fmt.Errorf("delete %T %s/%s: %w", o, o.GetNamespace(), o.GetName(), err)
		}
		r.log.Info("deleted what was made for a Gateway no longer served", "object", fmt.Sprintf("%T", o), "namespace", o.GetNamespace(), "name", o.GetName())
	}
	if keep == "" {
		return r.syncRoots(ctx, key.Namespace)
	}
	return nil
}

// staleServiceAccount returns the ServiceAccount made for the Gateway key
// when it is not owned by the Gateway of UID keep. ServiceAccounts are read
// one by name, uncached: pilot may not list them, and may read them only
// in the gateway namespaces (remotesecret.GatewayRules). Where it may not,
// it cannot have made one.
func (r *reconciler) staleServiceAccount(ctx context.Context, key types.NamespacedName, keep types.UID) ([]client.Object, error) {
	var sa corev1.ServiceAccount
	err := r.client.Get(ctx, client.ObjectKey{Namespace: key.Namespace, Name: ObjectName(key.Name)}, &sa)
	if apierrors.IsNotFound(err) || apierrors.IsForbidden(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	l := sa.Labels
	if l[managedByLabel] != managedBy || l[gwv1.GatewayClassNameLabelKey] != ClassName || l[gwv1.GatewayNameLabelKey] != key.Name {
		return nil, nil // not made by this controller
	}
	if keep != "" && ownedBy(&sa, keep) {
		return nil, nil
	}
	return []client.Object{&sa}, nil
}

func ownedBy(o client.Object, uid types.UID) bool {
	return slices.ContainsFunc(o.GetOwnerReferences(), func(ref metav1.OwnerReference) bool { return ref.UID == uid })
}
