package controller

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// Annotations on a Service that set its routing preference (see
// LoadBalancingOf).
const (
	// TrafficDistributionAnnotation is Istio's annotation with the values of
	// spec.trafficDistribution: PreferClose, PreferSameZone, PreferSameNode
	// (case-insensitive).
	TrafficDistributionAnnotation = "networking.istio.io/traffic-distribution"
	// RoutingPreferenceAnnotation is Isthmus's: a comma-separated list of
	// Istio's workload API scopes (NETWORK, CLUSTER, REGION, ZONE, SUBZONE,
	// NODE; case-insensitive), the most important first, or NONE for no
	// preference (spread evenly over every healthy endpoint).
	RoutingPreferenceAnnotation = "networking.isthmus.io/routing-preference"
	// RoutingModeAnnotation is FAILOVER (the default) or STRICT; it is read
	// only with RoutingPreferenceAnnotation.
	RoutingModeAnnotation = "networking.isthmus.io/routing-mode"
)

// maxRoutingAnnotation bounds the annotation values parsed.
const maxRoutingAnnotation = 256

// LoadBalancingOf returns a Service's routing preference, in order:
//  1. Isthmus's routing-preference annotation (with its routing-mode), if
//     set and valid;
//  2. else spec.trafficDistribution: PreferSameZone or PreferClose give
//     model.PreferSameZone, PreferSameNode model.PreferSameNode (another
//     value is ignored, as Istio ignores it);
//  3. else Istio's traffic-distribution annotation, with the same values
//     (this order of the field and the annotation is Istio's);
//  4. else nil: the mesh's default order, unless the Service's Namespace
//     has Istio's annotation (discovery applies it, Istio's third source).
//
// An annotation that cannot be read is ignored, and err says why; the
// returned preference is then what the rest of the order gives.
func LoadBalancingOf(svc *corev1.Service) (lb *model.LoadBalancing, err error) {
	if v, ok := svc.Annotations[RoutingPreferenceAnnotation]; ok {
		lb, err = parseRoutingPreference(v, svc.Annotations[RoutingModeAnnotation])
		if err == nil {
			return lb, nil
		}
	} else if _, ok := svc.Annotations[RoutingModeAnnotation]; ok {
		err = fmt.Errorf("annotation %s without %s: ignored", RoutingModeAnnotation, RoutingPreferenceAnnotation)
	}
	if td := svc.Spec.TrafficDistribution; td != nil {
		if lb := distribution(*td); lb != nil {
			return lb, err
		}
	}
	if v, ok := svc.Annotations[TrafficDistributionAnnotation]; ok {
		if lb := distribution(v); lb != nil {
			return lb, err
		}
		if err == nil {
			err = fmt.Errorf("annotation %s: %q is none of %s, %s, %s: ignored", TrafficDistributionAnnotation, clip(v),
				corev1.ServiceTrafficDistributionPreferClose, corev1.ServiceTrafficDistributionPreferSameZone, corev1.ServiceTrafficDistributionPreferSameNode)
		}
	}
	return nil, err
}

// ServiceLoadBalancing is the routing preference discovery gives a Service
// whose Namespace has annotations nsAnnotations: LoadBalancingOf, else
// (the Service sets none) the Namespace's Istio traffic-distribution
// annotation. err says which annotations were ignored, and why.
func ServiceLoadBalancing(svc *corev1.Service, nsAnnotations map[string]string) (*model.LoadBalancing, error) {
	lb, err := LoadBalancingOf(svc)
	if lb != nil {
		return lb, err
	}
	v, ok := nsAnnotations[TrafficDistributionAnnotation]
	if !ok {
		return nil, err
	}
	lb, nsErr := namespaceLoadBalancing(v)
	return lb, errors.Join(err, nsErr)
}

// namespaceLoadBalancing reads a Namespace's Istio traffic-distribution
// annotation (value).
func namespaceLoadBalancing(value string) (*model.LoadBalancing, error) {
	if lb := distribution(value); lb != nil {
		return lb, nil
	}
	return nil, fmt.Errorf("namespace annotation %s: %q is none of %s, %s, %s: ignored", TrafficDistributionAnnotation, clip(value),
		corev1.ServiceTrafficDistributionPreferClose, corev1.ServiceTrafficDistributionPreferSameZone, corev1.ServiceTrafficDistributionPreferSameNode)
}

// distribution maps a traffic distribution value (case-insensitive) to its
// preference; nil for an unknown one.
func distribution(v string) *model.LoadBalancing {
	switch strings.ToLower(strings.TrimSpace(v)) {
	case strings.ToLower(corev1.ServiceTrafficDistributionPreferClose), strings.ToLower(corev1.ServiceTrafficDistributionPreferSameZone):
		return model.PreferSameZone()
	case strings.ToLower(corev1.ServiceTrafficDistributionPreferSameNode):
		return model.PreferSameNode()
	}
	return nil
}

// parseRoutingPreference parses Isthmus's annotations.
func parseRoutingPreference(pref, mode string) (*model.LoadBalancing, error) {
	if len(pref) > maxRoutingAnnotation || len(mode) > maxRoutingAnnotation {
		return nil, fmt.Errorf("annotation %s or %s: longer than %d bytes: ignored", RoutingPreferenceAnnotation, RoutingModeAnnotation, maxRoutingAnnotation)
	}
	lb := &model.LoadBalancing{Preference: []model.RoutingScope{}}
	switch strings.ToUpper(strings.TrimSpace(mode)) {
	case "", "FAILOVER":
	case "STRICT":
		lb.Strict = true
	default:
		return nil, fmt.Errorf("annotation %s: %q is neither FAILOVER nor STRICT: ignored", RoutingModeAnnotation, mode)
	}
	if strings.EqualFold(strings.TrimSpace(pref), "NONE") {
		return lb, nil
	}
	for name := range strings.SplitSeq(pref, ",") {
		s, ok := model.ParseRoutingScope(name)
		if !ok {
			return nil, fmt.Errorf("annotation %s: %q is not a scope (NETWORK, CLUSTER, REGION, ZONE, SUBZONE, NODE) or NONE: ignored", RoutingPreferenceAnnotation, strings.TrimSpace(name))
		}
		if slices.Contains(lb.Preference, s) {
			return nil, fmt.Errorf("annotation %s: scope %s listed twice: ignored", RoutingPreferenceAnnotation, s)
		}
		lb.Preference = append(lb.Preference, s)
	}
	return lb, nil
}

// clip bounds a value quoted in an error.
func clip(v string) string {
	if len(v) > 64 {
		return v[:64] + "..."
	}
	return v
}
