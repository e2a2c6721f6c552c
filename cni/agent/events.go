//go:build linux

package agent

import (
	"context"
	"errors"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"
)

// eventComponent is the source of the agent's Events.
const eventComponent = "isthmus-cni"

// startEvents starts the Event recorder; the returned func stops it.
func (a *Agent) startEvents(ctx context.Context) func() {
	b := record.NewBroadcaster(record.WithContext(ctx))
	b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: a.deps.Client.CoreV1().Events("")})
	a.recorder = b.NewRecorder(scheme.Scheme, corev1.EventSource{Component: eventComponent, Host: a.cfg.NodeName})
	return b.Shutdown
}

// reportSandbox reports each sandboxError in err on pod: an Event (reason
// from the fixed set, a message of the agent's own words and the pod's
// addresses), the counter by reason and a log line; once per pod and
// reason until the pod is enrolled or gone.
func (a *Agent) reportSandbox(pod *corev1.Pod, err error) {
	var list []*sandboxError
	var one *sandboxError
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		for _, e := range j.Unwrap() {
			if errors.As(e, &one) {
				list = append(list, one)
			}
		}
	} else if errors.As(err, &one) {
		list = append(list, one)
	}
	for _, e := range list {
		a.reportOne(pod, e)
	}
}

func (a *Agent) reportOne(pod *corev1.Pod, e *sandboxError) {
	key := pod.Namespace + "/" + pod.Name
	uid := string(pod.UID)
	a.repMu.Lock()
	st := a.reported[uid]
	if st == nil {
		st = &reportState{key: key, reasons: map[string]bool{}}
		a.reported[uid] = st
	}
	again := st.reasons[e.reason]
	st.reasons[e.reason] = true
	a.repMu.Unlock()
	if again {
		a.log.Debug("sandbox problem persists", "pod", key, "uid", uid, "reason", e.reason)
		return
	}
	a.m.sandbox.WithLabelValues(e.reason).Inc()
	if e.reason == ReasonDuplicateAddress {
		a.log.Warn("pod enrolled through its own sandbox; another namespace claims its address", "pod", key, "uid", uid, "reason", e.reason, "detail", e.msg)
	} else {
		a.log.Warn("pod sandbox not trusted", "pod", key, "uid", uid, "reason", e.reason, "detail", e.msg)
	}
	if a.recorder != nil {
		a.recorder.Event(pod, corev1.EventTypeWarning, e.reason, e.msg)
	}
}

// forgetReports lets the problems of pod key (a pod gone) or uid (a pod
// enrolled) be reported again.
func (a *Agent) forgetReports(key, uid string) {
	a.repMu.Lock()
	defer a.repMu.Unlock()
	for u, st := range a.reported {
		if u == uid || st.key == key {
			delete(a.reported, u)
		}
	}
}

// reportState is what was reported of one pod.
type reportState struct {
	key     string
	reasons map[string]bool
}
