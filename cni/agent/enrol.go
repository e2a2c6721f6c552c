//go:build linux

package agent

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"slices"

	"github.com/isthmus-mesh/isthmus/cni/redirect"
	"github.com/isthmus-mesh/isthmus/cni/zds"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
)

// enrolment is one enrolled pod: its rules are in its namespace, its
// addresses in the node's probe set, and the zds server has it.
type enrolment struct {
	pod         zds.Pod
	key         string // namespace/name
	containerID string
	netns       *os.File
	id          netns.ID
	opts        redirect.Options // its rules, as last written
}

// strictness says what a failure to hand a pod to ztunnel or to update the
// node's probe set means.
type strictness bool

const (
	// failClosedAndReport (CNI ADD): undo everything and return the
	// error, so the runtime fails the sandbox and retries.
	failClosedAndReport strictness = true
	// keepCaptured (a running pod enrolled from the API): keep the rules,
	// so its traffic fails closed, and let the next snapshot or retry
	// finish the job.
	keepCaptured strictness = false
)

func (a *Agent) redirectOptions() redirect.Options {
	return redirect.Options{RedirectDNS: a.cfg.RedirectDNS, ExcludeDestinations: a.excluded,
		ZtunnelCgroups: a.capture.Cgroups, MarkOnly: a.capture.MarkOnly, CgroupNS: a.cgroupNS}
}

// enrol captures the pod's traffic and hands it to ztunnel. It owns ns: it
// keeps it while the pod is enrolled and closes it otherwise.
func (a *Agent) enrol(ctx context.Context, p zds.Pod, key, containerID string, ns *os.File, mode strictness) error {
	id, err := netns.IDOf(ns)
	if err != nil {
		ns.Close()
		a.fail(failNetns)
		return err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if cur := a.pods[p.UID]; cur != nil {
		if cur.id == id {
			// The same sandbox again (a retried ADD, or the API catching
			// up): converge the rules, keep the rest.
			ns.Close()
			if containerID != "" {
				cur.containerID = containerID
			}
			opts := a.podOptions(cur.netns)
			if err := redirect.Apply(cur.netns, opts); err != nil {
				a.fail(failRules)
				return err
			}
			cur.opts = opts
			return nil
		}
		a.releaseLocked(ctx, cur, "replaced by a new sandbox")
	}
	opts := a.podOptions(ns)
	if err := redirect.Apply(ns, opts); err != nil {
		ns.Close()
		a.fail(failRules)
		return err
	}
	e := &enrolment{pod: p, key: key, containerID: containerID, netns: ns, id: id, opts: opts}
	a.pods[p.UID] = e
	a.m.enrolled.Set(float64(len(a.pods)))
	log := a.log.With("pod", key, "uid", p.UID)
	if err := a.syncNodeLocked(); err != nil {
		a.fail(failNodeRules)
		if mode == failClosedAndReport {
			a.releaseLocked(ctx, e, "node rules failed")
			return err
		}
		log.Error("node probe rules", "error", err)
	}
	if err := a.zds.AddPod(ctx, p, ns); err != nil {
		// zds counted the failure by its reason.
		if mode == failClosedAndReport {
			a.releaseLocked(ctx, e, "ztunnel did not take it")
			return err
		}
		log.Warn("enrolled, but ztunnel did not take the pod; its traffic fails closed until it does", "error", err)
	}
	log.Info("pod enrolled", "ips", p.IPs)
	return nil
}

// release undoes the enrolment of uid, if any.
func (a *Agent) release(ctx context.Context, uid, why string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if e := a.pods[uid]; e != nil {
		a.releaseLocked(ctx, e, why)
	}
}

// releaseWhere releases every enrolment match selects.
func (a *Agent) releaseWhere(ctx context.Context, match func(*enrolment) bool, why string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, e := range a.pods {
		if match(e) {
			a.releaseLocked(ctx, e, why)
		}
	}
}

func (a *Agent) releaseLocked(ctx context.Context, e *enrolment, why string) {
	delete(a.pods, e.pod.UID)
	a.m.enrolled.Set(float64(len(a.pods)))
	log := a.log.With("pod", e.key, "uid", e.pod.UID)
	if err := a.zds.DelPod(ctx, e.pod.UID); err != nil {
		log.Warn("ztunnel did not take the release", "error", err)
	}
	if err := redirect.Remove(e.netns); err != nil {
		a.fail(failRelease)
		log.Error("remove the pod's rules", "error", err)
	}
	if err := a.syncNodeLocked(); err != nil {
		a.fail(failNodeRules)
		log.Error("node probe rules", "error", err)
	}
	e.netns.Close()
	log.Info("pod released", "why", why)
}

// syncNodeLocked makes the node's probe set the enrolled pods' addresses.
func (a *Agent) syncNodeLocked() error {
	var ips []netip.Addr
	for _, e := range a.pods {
		ips = append(ips, e.pod.IPs...)
	}
	slices.SortFunc(ips, netip.Addr.Compare)
	return redirect.ApplyNode(a.nodeNS, slices.Compact(ips))
}

// enrolled returns the enrolment of uid (nil if none) under the lock; the
// caller must not keep it past another agent call.
func (a *Agent) enrolled(uid string) *enrolment {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.pods[uid]
}

// checkRules verifies that the enrolled pod's rules are complete.
func (a *Agent) checkRules(uid string) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	e := a.pods[uid]
	if e == nil {
		return fmt.Errorf("pod %s is not enrolled", uid)
	}
	n, err := redirect.RuleCount(e.netns)
	if err != nil {
		return err
	}
	if want := redirect.ExpectedRules(e.opts); n != want {
		return fmt.Errorf("pod %s has %d of its %d redirect rules", e.key, n, want)
	}
	return nil
}

// closeAll drops the agent's references without touching the rules: pods
// stay captured while the agent restarts.
func (a *Agent) closeAll() {
	a.mu.Lock()
	defer a.mu.Unlock()
	for uid, e := range a.pods {
		e.netns.Close()
		delete(a.pods, uid)
	}
}

// removeStale removes the pod table from namespaces on the node that have
// one although their pod is known and not to be enrolled (its labels
// changed while no agent ran). A namespace whose pod is unknown keeps its
// rules: failing closed beats capturing nothing.
func (a *Agent) removeStale(notEnrolled func(netip.Addr) bool) {
	a.mu.Lock()
	keep := map[netns.ID]bool{}
	for _, e := range a.pods {
		keep[e.id] = true
	}
	a.mu.Unlock()
	a.discMu.Lock()
	defer a.discMu.Unlock()
	seen := map[netns.ID]bool{}
	for _, path := range a.disc.candidates() {
		f, err := netns.Open(path)
		if err != nil {
			continue
		}
		id, err := netns.IDOf(f)
		if err == nil && !seen[id] && !keep[id] && !a.disc.skip[id] {
			seen[id] = true
			if ok, _ := redirect.Present(f); ok {
				if addrs, err := addrsOf(f); err == nil && slices.ContainsFunc(addrs, notEnrolled) {
					err := redirect.Remove(f)
					a.log.Info("removed the rules of a pod no longer enrolled", "netns", path, "addrs", addrs, "error", err)
				}
			}
		}
		f.Close()
	}
}

func (a *Agent) fail(reason string) {
	a.m.failures.WithLabelValues(reason).Inc()
}
