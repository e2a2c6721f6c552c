package multicluster

import (
	"context"
	"crypto/sha256"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/hashicorp/go-multierror"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/tools/cache"
)

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
	// selection is the namespace selection generations are built with;
	// selectionErr why the Secret's annotation was not taken ("": it was).
	selection    *NamespaceSelection
	selectionErr string
	active       *instance
	pending      *instance
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
	s.Namespaces = e.active.selection.String()
	s.SelectorError = e.selectionErr
	return s
}

// secretSpec is what one remote Secret asks for.
type secretSpec struct {
	key         string
	desired     map[model.ClusterID][]byte // kubeconfig per cluster ID
	network     model.Network
	trustDomain string
	ref         *corev1.ObjectReference // nil when the Secret is gone
	selection   *NamespaceSelection
	selErr      error // why the Secret's selectors annotation was not taken
}

// specOf reads the Secret key from the listers; a Secret that is gone asks
// for nothing.
func (c *Controller) specOf(key string) secretSpec {
	spec := secretSpec{key: key, desired: map[model.ClusterID][]byte{}, selection: c.meshSelection}
	ns, name, _ := cache.SplitMetaNamespaceKey(key)
	var sec *corev1.Secret
	for _, l := range c.listers {
		if s, err := l.Secrets(ns).Get(name); err == nil {
			sec = s
			break
		}
	}
	if sec == nil {
		return spec
	}
	spec.selection, spec.selErr = c.selectionOf(sec)
	for k, v := range sec.Data {
		spec.desired[model.ClusterID(k)] = v
	}
	spec.network = model.Network(sec.Annotations[remotesecret.NetworkAnnotation])
	spec.trustDomain = sec.Annotations[remotesecret.TrustDomainAnnotation]
	spec.ref = &corev1.ObjectReference{Kind: "Secret", APIVersion: "v1", Namespace: sec.Namespace, Name: sec.Name, UID: sec.UID, ResourceVersion: sec.ResourceVersion}
	return spec
}

// reconcile makes the clusters registered by one Secret match its data.
func (c *Controller) reconcile(ctx context.Context, key string) {
	spec := c.specOf(key)
	c.mu.Lock()
	defer c.mu.Unlock()
	removedAny := c.removeUnlistedLocked(spec)
	refused := map[model.ClusterID]Status{}
	for _, id := range slices.Sorted(maps.Keys(spec.desired)) {
		if s, ok := c.applyLocked(ctx, spec, id); !ok {
			refused[id] = s
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

// removeUnlistedLocked stops the clusters the Secret owned and no longer
// lists; it reports whether there were any.
func (c *Controller) removeUnlistedLocked(spec secretSpec) bool {
	removed := false
	for id, e := range c.clusters {
		if _, ok := spec.desired[id]; e.secret != spec.key || ok {
			continue
		}
		c.log.Info("remote cluster removed", "cluster", id, "secret", spec.key)
		c.stopEntryLocked(e)
		delete(c.clusters, id)
		c.notifyLocked(Status{ID: id, Secret: spec.key, State: StateClosing, Reason: ReasonRemoved, LastTransitionTime: time.Now()})
		removed = true
	}
	return removed
}

// applyLocked adds, swaps or keeps cluster id as the Secret asks, or
// refuses it: then it returns the refusal and false.
func (c *Controller) applyLocked(ctx context.Context, spec secretSpec, id model.ClusterID) (Status, bool) {
	key, ref, kubeconfig := spec.key, spec.ref, spec.desired[id]
	if errs := validation.IsDNS1123Label(string(id)); len(errs) > 0 {
		return c.refuse(ref, key, id, ReasonInvalidClusterID, fmt.Sprintf("cluster ID %q is not a DNS-1123 label", id)), false
	}
	if id == c.cfg.ConfigClusterID {
		return c.refuse(ref, key, id, ReasonConfigClusterID, fmt.Sprintf("cluster ID %q is the config cluster's own ID; ignored", id)), false
	}
	e, ok := c.clusters[id]
	if ok && e.secret != key {
		return c.refuse(ref, key, id, ReasonDuplicateCluster, fmt.Sprintf("cluster %q is already registered by secret %s; the first secret wins", id, e.secret)), false
	}
	if spec.selErr != nil && !ok {
		// Nothing to keep: refuse rather than discover namespaces the
		// operator may have meant to exclude.
		return c.refuse(ref, key, id, ReasonInvalidDiscoverySelectors, spec.selErr.Error()+"; the cluster is not added until it parses"), false
	}
	hash := sha256.Sum256(kubeconfig)
	sel := c.keepSelection(e, ref, key, spec.selection, spec.selErr)
	switch {
	case !ok:
		e = &entry{id: id, secret: key, ref: ref, network: spec.network, trustDomain: spec.trustDomain, hash: hash, selection: sel}
		c.clusters[id] = e
		c.log.Info("remote cluster added", "cluster", id, "secret", key, "namespaces", sel.String())
		c.startLocked(ctx, e, kubeconfig)
	case e.hash != hash || e.network != spec.network || e.trustDomain != spec.trustDomain || e.selection.String() != sel.String():
		if e.selection.String() != sel.String() {
			c.log.Info("remote cluster discovery selectors changed; starting a new generation (make-before-break)", "cluster", id, "secret", key,
				"namespaces", sel.String())
		} else {
			c.log.Info("remote cluster kubeconfig changed; starting a new generation (make-before-break)", "cluster", id, "secret", key)
		}
		e.hash, e.ref, e.network, e.trustDomain, e.selection = hash, ref, spec.network, spec.trustDomain, sel
		c.startLocked(ctx, e, kubeconfig)
	default:
		e.ref = ref // unchanged bytes: keep the running client
	}
	return Status{}, true
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
		c: c, e: e, gen: c.nextGen, ctx: ictx, cancel: cancel, selection: e.selection,
		syncedCh: make(chan struct{}), done: make(chan struct{}),
		status: Status{ID: e.id, Secret: e.secret, State: StatePending, Reason: "Starting", Generation: c.nextGen, LastTransitionTime: time.Now()},
	}
	if e.ref != nil {
		inst.status.SecretResourceVersion = e.ref.ResourceVersion
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

// Outcomes of isthmus_remote_secret_kube_events_total.
const (
	eventRecorded     = "recorded"
	eventLeftToLeader = "left_to_leader"
)

// event records an Event on ref, when this replica records them; a
// replica that does not (not the leader) counts the Event it left out.
func (c *Controller) event(ref runtime.Object, kind, reason, msg string) {
	if c.recorder == nil {
		return
	}
	if c.cfg.RecordEvents != nil && !c.cfg.RecordEvents() {
		c.metrics.kubeEvents.WithLabelValues(kind, eventLeftToLeader).Inc()
		return
	}
	c.metrics.kubeEvents.WithLabelValues(kind, eventRecorded).Inc()
	c.recorder.Event(ref, kind, reason, msg)
}
