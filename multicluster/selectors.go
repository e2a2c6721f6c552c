package multicluster

import (
	"fmt"
	"slices"

	corev1 "k8s.io/api/core/v1"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"

	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
)

// ReasonInvalidDiscoverySelectors: a Secret's discovery-selectors
// annotation does not parse; its clusters keep their previous selection
// (a cluster it would add is refused until it parses).
const ReasonInvalidDiscoverySelectors = "InvalidDiscoverySelectors"

// maxSelectorsText bounds the annotation's size (it is read from a Secret
// anyone with write access to the namespace may edit).
const maxSelectorsText = 64 << 10

// ParseDiscoverySelectors parses a list of namespace label selectors, as in
// Istio's MeshConfig discoverySelectors: YAML or JSON, strict (an unknown
// field is an error), every selector valid. The error names the selector
// at fault and never quotes more than the offending field.
func ParseDiscoverySelectors(text string) ([]metav1.LabelSelector, error) {
	if len(text) > maxSelectorsText {
		return nil, fmt.Errorf("discovery selectors: %d bytes, at most %d", len(text), maxSelectorsText)
	}
	var sels []metav1.LabelSelector
	if err := yaml.UnmarshalStrict([]byte(text), &sels); err != nil {
		return nil, fmt.Errorf("discovery selectors: not a list of label selectors: %w", err)
	}
	if err := ValidateDiscoverySelectors(sels); err != nil {
		return nil, err
	}
	return sels, nil
}

// ValidateDiscoverySelectors checks that every selector is a valid label
// selector.
func ValidateDiscoverySelectors(sels []metav1.LabelSelector) error {
	for i := range sels {
		if _, err := metav1.LabelSelectorAsSelector(&sels[i]); err != nil {
			return fmt.Errorf("discovery selector %d: %w", i, err)
		}
	}
	return nil
}

// NamespaceSelection is the namespaces one cluster's discovery covers:
// those whose labels match any of its selectors; all when it has none.
// Build it with NewNamespaceSelection.
type NamespaceSelection struct {
	selectors []labels.Selector
	// Source are the selectors as given.
	Source []metav1.LabelSelector
}

// NewNamespaceSelection converts valid selectors (see
// ValidateDiscoverySelectors).
func NewNamespaceSelection(sels []metav1.LabelSelector) (*NamespaceSelection, error) {
	if err := ValidateDiscoverySelectors(sels); err != nil {
		return nil, err
	}
	s := &NamespaceSelection{Source: slices.Clone(sels)}
	for i := range sels {
		sel, _ := metav1.LabelSelectorAsSelector(&sels[i])
		s.selectors = append(s.selectors, sel)
	}
	return s, nil
}

// All reports whether every namespace is selected (no selectors).
func (s *NamespaceSelection) All() bool { return s == nil || len(s.selectors) == 0 }

// Matches reports whether a namespace with these labels is selected.
func (s *NamespaceSelection) Matches(nsLabels map[string]string) bool {
	if s.All() {
		return true
	}
	set := labels.Set(nsLabels)
	for _, sel := range s.selectors {
		if sel.Matches(set) {
			return true
		}
	}
	return false
}

// ServerSelector returns the label selector the API server can apply to
// the namespace watch: the one selector when there is exactly one, else
// nil (several selectors are OR-ed, which a label selector cannot say, so
// they are matched on the client).
func (s *NamespaceSelection) ServerSelector() labels.Selector {
	if s == nil || len(s.selectors) != 1 {
		return nil
	}
	return s.selectors[0]
}

// String is the selectors in a stable form (for logs and change
// detection).
func (s *NamespaceSelection) String() string {
	if s.All() {
		return "all namespaces"
	}
	out := ""
	for i, sel := range s.selectors {
		if i > 0 {
			out += " OR "
		}
		out += "{" + sel.String() + "}"
	}
	return out
}

// selectionOf returns the namespace selection sec's annotation asks for
// (the mesh-wide one without it), or why the annotation does not parse.
func (c *Controller) selectionOf(sec *corev1.Secret) (*NamespaceSelection, error) {
	text, ok := sec.Annotations[remotesecret.DiscoverySelectorsAnnotation]
	if !ok {
		return c.meshSelection, nil
	}
	sels, err := ParseDiscoverySelectors(text)
	if err != nil {
		return nil, fmt.Errorf("annotation %s: %w", remotesecret.DiscoverySelectorsAnnotation, err)
	}
	return NewNamespaceSelection(sels)
}

// keepSelection returns the selection registered cluster e (nil: a new
// one) is to run with: want, or, when the annotation did not parse
// (selErr), the one it has; a new parse error is reported once.
func (c *Controller) keepSelection(e *entry, ref *corev1.ObjectReference, key string, want *NamespaceSelection, selErr error) *NamespaceSelection {
	if e == nil {
		return want
	}
	if selErr == nil {
		e.selectionErr = ""
		return want
	}
	if msg := selErr.Error() + "; the cluster keeps its previous selection (" + e.selection.String() + ")"; e.selectionErr != msg {
		e.selectionErr = msg
		c.log.Warn("remote cluster discovery selectors refused", "cluster", e.id, "secret", key, "reason", ReasonInvalidDiscoverySelectors, "detail", msg)
		if ref != nil {
			c.event(ref, corev1.EventTypeWarning, ReasonInvalidDiscoverySelectors, msg)
		}
	}
	return e.selection
}
