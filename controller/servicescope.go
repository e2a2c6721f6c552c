package controller

import (
	"errors"
	"fmt"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"
)

// GlobalLabel is Istio's service scope label: "true" makes a Service (or
// every Service of a Namespace) global, "false" local; any other value is
// ignored. A Service's label wins over its Namespace's.
const GlobalLabel = "istio.io/global"

// Scope names a service scope as Istio's MeshConfig serviceScopeConfigs
// spells it.
type Scope string

// Service scopes.
const (
	// ScopeGlobal: the cluster's endpoints of the service are shared with
	// every cluster of the mesh.
	ScopeGlobal Scope = "GLOBAL"
	// ScopeLocal: they are seen only by clients in the same cluster.
	ScopeLocal Scope = "LOCAL"
)

// ServiceScopeRule is one entry of Istio's MeshConfig serviceScopeConfigs:
// the services it selects (both selectors must match; an absent or empty
// selector matches everything) have its Scope.
type ServiceScopeRule struct {
	NamespaceSelector *metav1.LabelSelector `json:"namespaceSelector,omitempty"`
	ServicesSelector  *metav1.LabelSelector `json:"servicesSelector,omitempty"`
	Scope             Scope                 `json:"scope"`
}

// ServiceScope decides whether a service is global or local in a cluster,
// from that cluster's Service and Namespace labels. The zero value makes
// every service global (Isthmus's behaviour before scopes existed).
//
// The scope of a Service, in order:
//  1. its istio.io/global label ("true" or "false"), if set;
//  2. else its Namespace's istio.io/global label, if set;
//  3. else GLOBAL if a GLOBAL rule selects it, else LOCAL if a LOCAL rule
//     does (so rule order does not matter, and with Default LOCAL the rules
//     mean exactly what Istio's serviceScopeConfigs mean: Istio's default is
//     local and only its GLOBAL entries have an effect);
//  4. else Default.
type ServiceScope struct {
	// Default is the scope of a service nothing else decides: ScopeGlobal
	// (the default when empty) or ScopeLocal (Istio's).
	Default Scope `json:"default,omitempty"`
	// Rules are Istio's serviceScopeConfigs.
	Rules []ServiceScopeRule `json:"rules,omitempty"`
}

// maxScopeText bounds the serialized rules a flag may give.
const maxScopeText = 64 << 10

// ParseServiceScopeRules parses a YAML or JSON list of rules (Istio's
// serviceScopeConfigs), strictly: an unknown field is an error.
func ParseServiceScopeRules(text string) ([]ServiceScopeRule, error) {
	if len(text) > maxScopeText {
		return nil, fmt.Errorf("service scope rules: %d bytes, at most %d", len(text), maxScopeText)
	}
	var rules []ServiceScopeRule
	if err := yaml.UnmarshalStrict([]byte(text), &rules); err != nil {
		return nil, fmt.Errorf("service scope rules: not a list of {namespaceSelector, servicesSelector, scope}: %w", err)
	}
	s := ServiceScope{Rules: rules}
	if _, err := s.compile(); err != nil {
		return nil, err
	}
	return rules, nil
}

// ParseScope parses a scope name, case-insensitively ("global", "LOCAL").
func ParseScope(text string) (Scope, error) {
	switch s := Scope(strings.ToUpper(strings.TrimSpace(text))); s {
	case ScopeGlobal, ScopeLocal:
		return s, nil
	}
	return "", fmt.Errorf("service scope %q: want global or local", text)
}

// Validate checks the default and every rule.
func (s ServiceScope) Validate() error {
	_, err := s.compile()
	return err
}

// Scoper is a compiled ServiceScope. Its methods are safe for concurrent
// use; a nil Scoper is the zero ServiceScope's (every service global).
type Scoper struct {
	local bool // the default is local
	rules []scopeRule
	// usesServiceLabels: some rule selects by service labels.
	usesServiceLabels bool
}

type scopeRule struct {
	ns, svc labels.Selector
	local   bool
}

// Compile checks s and returns its Scoper.
func (s ServiceScope) Compile() (*Scoper, error) { return s.compile() }

func (s ServiceScope) compile() (*Scoper, error) {
	sc := &Scoper{}
	switch s.Default {
	case "", ScopeGlobal:
	case ScopeLocal:
		sc.local = true
	default:
		return nil, fmt.Errorf("service scope default %q: want %s or %s", s.Default, ScopeGlobal, ScopeLocal)
	}
	var errs []error
	for i, r := range s.Rules {
		if r.Scope != ScopeGlobal && r.Scope != ScopeLocal {
			errs = append(errs, fmt.Errorf("service scope rule %d: scope %q: want %s or %s", i, r.Scope, ScopeGlobal, ScopeLocal))
			continue
		}
		ns, err := selectorOf(r.NamespaceSelector)
		if err != nil {
			errs = append(errs, fmt.Errorf("service scope rule %d: namespaceSelector: %w", i, err))
			continue
		}
		svc, err := selectorOf(r.ServicesSelector)
		if err != nil {
			errs = append(errs, fmt.Errorf("service scope rule %d: servicesSelector: %w", i, err))
			continue
		}
		sc.usesServiceLabels = sc.usesServiceLabels || !svc.Empty()
		sc.rules = append(sc.rules, scopeRule{ns: ns, svc: svc, local: r.Scope == ScopeLocal})
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return sc, nil
}

// selectorOf converts a label selector; nil or empty matches everything.
func selectorOf(ls *metav1.LabelSelector) (labels.Selector, error) {
	if ls == nil {
		return labels.Everything(), nil
	}
	return metav1.LabelSelectorAsSelector(ls)
}

// Local reports whether a Service with labels svc in a Namespace with
// labels ns is local (see ServiceScope for the order of precedence).
func (sc *Scoper) Local(svc, ns map[string]string) bool {
	if local, ok := labelScope(svc); ok {
		return local
	}
	if local, ok := labelScope(ns); ok {
		return local
	}
	if sc == nil {
		return false
	}
	matchedLocal := false
	for _, r := range sc.rules {
		if r.ns.Matches(labels.Set(ns)) && r.svc.Matches(labels.Set(svc)) {
			if !r.local {
				return false
			}
			matchedLocal = true
		}
	}
	return matchedLocal || sc.local
}

// labelScope reads the istio.io/global label: ok is false when it is
// absent or neither "true" nor "false".
func labelScope(l map[string]string) (local, ok bool) {
	switch l[GlobalLabel] {
	case "true":
		return false, true
	case "false":
		return true, true
	}
	return false, false
}

// ServiceLabels returns what of a Service's labels the scoper reads: all
// of them when a rule selects by service labels, else only istio.io/global
// (nil when absent), so that discovery keeps no more than it uses.
func (sc *Scoper) ServiceLabels(l map[string]string) map[string]string {
	if sc != nil && sc.usesServiceLabels {
		return l
	}
	if v, ok := l[GlobalLabel]; ok {
		return map[string]string{GlobalLabel: v}
	}
	return nil
}
