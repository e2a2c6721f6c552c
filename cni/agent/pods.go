//go:build linux

package agent

import (
	"context"
	"fmt"
	"net/netip"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"

	"github.com/isthmus-mesh/isthmus/cni/selection"
	"github.com/isthmus-mesh/isthmus/cni/zds"
)

// stripPod keeps what enrolment reads of a pod: identity, labels, the
// sidecar annotation, host networking, service account, phase and addresses.
func stripPod(obj any) (any, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil
	}
	out := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{
		Name: p.Name, Namespace: p.Namespace, UID: p.UID, Labels: p.Labels,
		ResourceVersion: p.ResourceVersion, DeletionTimestamp: p.DeletionTimestamp,
	}}
	if v, ok := p.Annotations[selection.AnnotationSidecarStatus]; ok {
		out.Annotations = map[string]string{selection.AnnotationSidecarStatus: v}
	}
	out.Spec.NodeName, out.Spec.HostNetwork, out.Spec.ServiceAccountName = p.Spec.NodeName, p.Spec.HostNetwork, p.Spec.ServiceAccountName
	out.Status.Phase, out.Status.PodIP, out.Status.PodIPs = p.Status.Phase, p.Status.PodIP, p.Status.PodIPs
	return out, nil
}

// stripNamespace keeps a namespace's name and labels.
func stripNamespace(obj any) (any, error) {
	ns, ok := obj.(*corev1.Namespace)
	if !ok {
		return obj, nil
	}
	return &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns.Name, Labels: ns.Labels, ResourceVersion: ns.ResourceVersion}}, nil
}

func (a *Agent) newInformers() {
	node := fields.OneTermEqualSelector("spec.nodeName", a.cfg.NodeName).String()
	pods := informers.NewSharedInformerFactoryWithOptions(a.deps.Client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.FieldSelector = node }),
		informers.WithTransform(stripPod))
	nss := informers.NewSharedInformerFactoryWithOptions(a.deps.Client, 0, informers.WithTransform(stripNamespace))
	a.podInf = pods.Core().V1().Pods().Informer()
	a.nsInf = nss.Core().V1().Namespaces().Informer()
	a.queue = workqueue.NewTypedRateLimitingQueue(workqueue.NewTypedItemExponentialFailureRateLimiter[string](
		200*time.Millisecond, 30*time.Second))
}

func (a *Agent) addHandlers() error {
	enqueue := func(obj any) {
		if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
			a.queue.Add(key)
		}
	}
	if _, err := a.podInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: enqueue, UpdateFunc: func(_, n any) { enqueue(n) }, DeleteFunc: enqueue,
	}); err != nil {
		return err
	}
	nsChanged := func(obj any) {
		ns, ok := obj.(*corev1.Namespace)
		if !ok {
			return
		}
		objs, _ := a.podInf.GetIndexer().ByIndex(cache.NamespaceIndex, ns.Name)
		for _, o := range objs {
			enqueue(o)
		}
	}
	_, err := a.nsInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: nsChanged, UpdateFunc: func(_, n any) { nsChanged(n) }, DeleteFunc: nsChanged,
	})
	return err
}

// watch runs the informers; once synced it reconciles every pod of the
// node (enrolling those that ran before the agent), removes rules left for
// pods no longer enrolled, then works the queue until ctx ends.
func (a *Agent) watch(ctx context.Context) error {
	if err := a.addHandlers(); err != nil {
		return err
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() { a.podInf.Run(ctx.Done()) })
	wg.Go(func() { a.nsInf.Run(ctx.Done()) })
	defer a.queue.ShutDown()
	if !cache.WaitForCacheSync(ctx.Done(), a.podInf.HasSynced, a.nsInf.HasSynced) {
		return nil // ctx ended
	}
	for _, key := range a.podInf.GetStore().ListKeys() {
		if err := a.reconcile(ctx, key); err != nil {
			a.log.Warn("enrol a running pod", "pod", key, "error", err)
			a.queue.AddRateLimited(key)
		}
	}
	a.removeStale(a.knownNotEnrolled)
	a.mu.Lock()
	if err := a.syncNodeLocked(); err != nil {
		a.fail(failNodeRules)
		a.log.Error("node probe rules", "error", err)
	}
	a.mu.Unlock()
	// Every running pod is recorded (or queued for a retry): ztunnels may
	// have their snapshots.
	a.zds.MarkSynced()
	a.synced.Store(true)
	wg.Go(func() {
		<-ctx.Done()
		a.queue.ShutDown()
	})
	for a.work(ctx) {
	}
	return nil
}

func (a *Agent) work(ctx context.Context) bool {
	key, quit := a.queue.Get()
	if quit {
		return false
	}
	defer a.queue.Done(key)
	if err := a.reconcile(ctx, key); err != nil {
		a.log.Warn("reconcile pod", "pod", key, "error", err)
		a.queue.AddRateLimited(key)
		return true
	}
	a.queue.Forget(key)
	return true
}

// reconcile brings one pod's enrolment in line with the selection: a
// running pod that should be enrolled is (through its own sandbox, see
// discoverer.locate),
// an enrolled pod that should not be, or is gone, is released. Pods not yet
// running are left to the CNI ADD, terminating ones to the CNI DEL.
func (a *Agent) reconcile(ctx context.Context, key string) error {
	obj, exists, err := a.podInf.GetStore().GetByKey(key)
	if err != nil {
		return err
	}
	if !exists {
		a.releaseWhere(ctx, func(e *enrolment) bool { return e.key == key }, "pod deleted")
		a.forgetReports(key, "")
		return nil
	}
	pod := obj.(*corev1.Pod)
	uid := string(pod.UID)
	a.releaseWhere(ctx, func(e *enrolment) bool { return e.key == key && e.pod.UID != uid }, "pod replaced")
	if pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed {
		a.release(ctx, uid, "pod terminated")
		return nil
	}
	want, reason := a.cfg.selection().Decide(pod, a.namespace(pod.Namespace))
	cur := a.enrolled(uid)
	switch {
	case !want && cur != nil:
		a.release(ctx, uid, string(reason))
	case want && cur == nil && pod.Status.Phase == corev1.PodRunning && pod.DeletionTimestamp == nil:
		// (A terminating pod is not enrolled anew: its sandbox may be gone
		// already, the CNI DEL having released it.)
		ips := podIPs(pod)
		if len(ips) == 0 {
			return nil // enrolled once the kubelet reports its address
		}
		a.discMu.Lock()
		loc, err := a.disc.locate(uid, ips)
		a.discMu.Unlock()
		if err != nil {
			// Not enrolled: an impostor must never get the pod's
			// identity, and a retry may find the sandbox.
			a.reportSandbox(pod, err)
			return fmt.Errorf("pod %s not enrolled: %w", key, err)
		}
		a.forgetReports("", uid)
		for _, n := range loc.notes {
			a.reportOne(pod, n)
		}
		a.log.Debug("running pod's sandbox found", "pod", key, "uid", uid, "via", loc.via)
		return a.enrol(ctx, zdsPod(pod, ips), key, loc.containerID, loc.ns, keepCaptured)
	}
	return nil
}

// knownNotEnrolled reports whether ip belongs to a pod of this node that
// is known and not to be enrolled.
func (a *Agent) knownNotEnrolled(ip netip.Addr) bool {
	for _, obj := range a.podInf.GetStore().List() {
		pod := obj.(*corev1.Pod)
		for _, pip := range podIPs(pod) {
			if pip == ip {
				want, _ := a.cfg.selection().Decide(pod, a.namespace(pod.Namespace))
				return !want
			}
		}
	}
	return false
}

func (a *Agent) namespace(name string) *corev1.Namespace {
	obj, ok, err := a.nsInf.GetStore().GetByKey(name)
	if err != nil || !ok {
		return nil
	}
	return obj.(*corev1.Namespace)
}

func podIPs(pod *corev1.Pod) []netip.Addr {
	var out []netip.Addr
	for _, ip := range pod.Status.PodIPs {
		if a, err := netip.ParseAddr(ip.IP); err == nil {
			out = append(out, a.Unmap())
		}
	}
	if len(out) == 0 && pod.Status.PodIP != "" {
		if a, err := netip.ParseAddr(pod.Status.PodIP); err == nil {
			out = append(out, a.Unmap())
		}
	}
	return out
}

func zdsPod(pod *corev1.Pod, ips []netip.Addr) zds.Pod {
	sa := pod.Spec.ServiceAccountName
	if sa == "" {
		sa = "default"
	}
	return zds.Pod{UID: string(pod.UID), Name: pod.Name, Namespace: pod.Namespace, ServiceAccount: sa, IPs: ips}
}

// lookupPod returns the pod the runtime named, from the cache if it has
// that UID, else from the API server.
func (a *Agent) lookupPod(ctx context.Context, ns, name, uid string) (*corev1.Pod, error) {
	if obj, ok, _ := a.podInf.GetStore().GetByKey(ns + "/" + name); ok {
		if p := obj.(*corev1.Pod); uid == "" || string(p.UID) == uid {
			return p, nil
		}
	}
	p, err := a.deps.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("get pod %s/%s: %w", ns, name, err)
	}
	if uid != "" && string(p.UID) != uid {
		return nil, fmt.Errorf("pod %s/%s has uid %s, the runtime named %s", ns, name, p.UID, uid)
	}
	return p, nil
}

// lookupNamespace returns the namespace from the cache, else from the API
// server; a namespace that does not exist is nil without error.
func (a *Agent) lookupNamespace(ctx context.Context, name string) (*corev1.Namespace, error) {
	if ns := a.namespace(name); ns != nil {
		return ns, nil
	}
	ns, err := a.deps.Client.CoreV1().Namespaces().Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("get namespace %s: %w", name, err)
	}
	return ns, nil
}
