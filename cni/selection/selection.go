// Package selection decides whether a pod is enrolled in the mesh, the way
// Istio's CNI does for ambient mode. It is pure: the decision depends only
// on the pod and its namespace as given.
//
// In order, the first rule that applies decides:
//  1. a pod in an excluded namespace is never enrolled (default: kube-system
//     and the control-plane namespace, isthmus-system);
//  2. hostNetwork pods are never enrolled (their namespace is the node's);
//  3. pods with a sidecar (annotation sidecar.istio.io/status) are never
//     enrolled;
//  4. a pod labelled istio.io/dataplane-mode=none (or
//     isthmus.io/dataplane-mode=none) opts out, whatever its namespace says;
//  5. a pod labelled istio.io/dataplane-mode=ambient (or the isthmus.io
//     label) is enrolled, whatever its namespace says, even when the
//     namespace is not known;
//  6. otherwise the pod follows its namespace: enrolled when the namespace
//     is labelled istio.io/dataplane-mode=ambient or
//     isthmus.io/dataplane-mode=ambient. A pod label of any other value
//     does not count (the namespace decides).
//
// This is Istio's precedence (its CNI's default enablement selectors: the
// pod's label ambient, or the namespace's ambient with the pod's label not
// none; a sidecar, hostNetwork or an excluded namespace never), with the
// isthmus.io label read beside Istio's on both objects. A pod label only
// ever decides for that pod, so whoever may create the pod may choose; no
// label reaches another pod.
package selection

import (
	"slices"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	corev1 "k8s.io/api/core/v1"
)

// Labels and annotations the selection reads.
const (
	// LabelDataplaneMode is Istio's label, on namespaces and pods: ambient
	// enrols, none (on a pod) opts out.
	LabelDataplaneMode = "istio.io/dataplane-mode"
	// LabelIsthmusDataplaneMode is accepted beside LabelDataplaneMode, on
	// namespaces and pods.
	LabelIsthmusDataplaneMode = "isthmus.io/dataplane-mode"
	// AnnotationSidecarStatus marks a pod that has an Istio sidecar.
	AnnotationSidecarStatus = "sidecar.istio.io/status"
	// ModeAmbient enrols; ModeNone opts a pod out.
	ModeAmbient = "ambient"
	ModeNone    = "none"
)

// DefaultExcludedNamespaces are never enrolled unless Config says otherwise.
func DefaultExcludedNamespaces() []string { return []string{"kube-system", defaults.Namespace} }

// Reason says why a pod is or is not enrolled; it is a stable, short token
// fit for logs and metric labels.
type Reason string

// The reasons Decide gives.
const (
	Enrolled             Reason = "enrolled"
	ExcludedNamespace    Reason = "excluded-namespace"
	HostNetwork          Reason = "host-network"
	Sidecar              Reason = "sidecar"
	PodOptOut            Reason = "pod-opt-out"
	PodEnrolled          Reason = "pod-enrolled"
	NamespaceNotAmbient  Reason = "namespace-not-ambient"
	NamespaceUnavailable Reason = "namespace-unknown"
)

// Config holds the excluded namespaces; nil means
// DefaultExcludedNamespaces (an empty, non-nil slice excludes none).
type Config struct {
	ExcludedNamespaces []string
}

func (c Config) excluded() []string {
	if c.ExcludedNamespaces == nil {
		return DefaultExcludedNamespaces()
	}
	return c.ExcludedNamespaces
}

// Excluded reports whether namespace is excluded, so that a caller can
// decide without fetching the pod (the node agent answers the CNI plugin
// for excluded namespaces even when the API server is away).
func (c Config) Excluded(namespace string) bool {
	return slices.Contains(c.excluded(), namespace)
}

// Decide returns whether pod is enrolled and why. ns is the pod's namespace
// object; nil means it is unknown, and the pod is then not enrolled.
func (c Config) Decide(pod *corev1.Pod, ns *corev1.Namespace) (bool, Reason) {
	switch {
	case c.Excluded(pod.Namespace):
		return false, ExcludedNamespace
	case pod.Spec.HostNetwork:
		return false, HostNetwork
	case hasKey(pod.Annotations, AnnotationSidecarStatus):
		return false, Sidecar
	case hasMode(pod.Labels, ModeNone):
		return false, PodOptOut
	case hasMode(pod.Labels, ModeAmbient):
		return true, PodEnrolled
	case ns == nil:
		return false, NamespaceUnavailable
	case hasMode(ns.Labels, ModeAmbient):
		return true, Enrolled
	default:
		return false, NamespaceNotAmbient
	}
}

// hasMode reports whether either dataplane-mode label of labels is mode.
func hasMode(labels map[string]string, mode string) bool {
	return labels[LabelDataplaneMode] == mode || labels[LabelIsthmusDataplaneMode] == mode
}

func hasKey(m map[string]string, k string) bool {
	_, ok := m[k]
	return ok
}
