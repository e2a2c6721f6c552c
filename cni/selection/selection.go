// Package selection decides whether a pod is enrolled in the mesh, the way
// Istio's CNI does for ambient mode. It is pure: the decision depends only
// on the pod and its namespace as given.
//
// In order:
//  1. a pod in an excluded namespace is never enrolled (default: kube-system
//     and the control-plane namespace, isthmus-system);
//  2. hostNetwork pods are never enrolled (their namespace is the node's);
//  3. pods with a sidecar (annotation sidecar.istio.io/status) are never
//     enrolled;
//  4. a pod labelled istio.io/dataplane-mode=none opts out;
//  5. otherwise the pod is enrolled when its namespace is labelled
//     istio.io/dataplane-mode=ambient or isthmus.io/dataplane-mode=ambient.
package selection

import (
	"slices"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	corev1 "k8s.io/api/core/v1"
)

// Labels and annotations the selection reads.
const (
	// LabelDataplaneMode is Istio's label, on namespaces (ambient) and pods
	// (none to opt out).
	LabelDataplaneMode = "istio.io/dataplane-mode"
	// LabelIsthmusDataplaneMode is accepted on namespaces like
	// LabelDataplaneMode.
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
	case pod.Labels[LabelDataplaneMode] == ModeNone:
		return false, PodOptOut
	case ns == nil:
		return false, NamespaceUnavailable
	case ns.Labels[LabelDataplaneMode] == ModeAmbient, ns.Labels[LabelIsthmusDataplaneMode] == ModeAmbient:
		return true, Enrolled
	default:
		return false, NamespaceNotAmbient
	}
}

func hasKey(m map[string]string, k string) bool {
	_, ok := m[k]
	return ok
}
