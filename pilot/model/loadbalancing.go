package model

import (
	"slices"
	"strings"
)

// RoutingScope is a property an endpoint can share with its client, by
// which a service's routing preference ranks endpoints. The names are
// those of Istio's workload API (LoadBalancing.Scope).
type RoutingScope uint8

// Routing scopes.
const (
	// RouteNetwork: the endpoint is on the client's network.
	RouteNetwork RoutingScope = iota + 1
	// RouteCluster: the endpoint is in the client's cluster.
	RouteCluster
	// RouteRegion: the endpoint is in the client's region.
	RouteRegion
	// RouteZone: the endpoint is in the client's zone.
	RouteZone
	// RouteSubzone: the endpoint is in the client's subzone.
	RouteSubzone
	// RouteNode: the endpoint runs on the client's node.
	RouteNode
)

var routingScopeNames = [...]string{RouteNetwork: "NETWORK", RouteCluster: "CLUSTER", RouteRegion: "REGION",
	RouteZone: "ZONE", RouteSubzone: "SUBZONE", RouteNode: "NODE"}

// String returns the scope's name as Istio spells it (NETWORK, ZONE, ...).
func (s RoutingScope) String() string {
	if int(s) < len(routingScopeNames) && s != 0 {
		return routingScopeNames[s]
	}
	return "UNKNOWN"
}

// ParseRoutingScope parses a scope name, case-insensitively.
func ParseRoutingScope(text string) (RoutingScope, bool) {
	i := slices.Index(routingScopeNames[:], strings.ToUpper(strings.TrimSpace(text)))
	if i <= 0 {
		return 0, false
	}
	return RoutingScope(i), true
}

// MarshalText implements encoding.TextMarshaler.
func (s RoutingScope) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// LoadBalancing is a service's routing preference, the model of Istio's
// workload API Service.load_balancing.
//
// With Strict unset (FAILOVER), clients prefer the endpoints that match the
// longest prefix of Preference and fall back to a shorter prefix only when
// no healthy endpoint matches the longer one: with [NETWORK, CLUSTER,
// REGION, ZONE] they try their zone, then their region, then their cluster,
// then their network, then anything. With Strict (STRICT) only endpoints
// matching every scope qualify. An empty Preference is no preference: every
// healthy endpoint is equally likely ("spread evenly").
//
// A service without a LoadBalancing (nil) keeps the mesh's default order
// (network, cluster, region, zone, subzone).
type LoadBalancing struct {
	// Preference lists the scopes, the most important first.
	Preference []RoutingScope `json:"preference"`
	// Strict restricts traffic to the endpoints matching every scope.
	Strict bool `json:"strict,omitempty"`
}

// Equal reports whether two preferences are the same (nil equals only nil).
func (lb *LoadBalancing) Equal(o *LoadBalancing) bool {
	if lb == nil || o == nil {
		return lb == o
	}
	return lb.Strict == o.Strict && slices.Equal(lb.Preference, o.Preference)
}

// String renders the preference as "FAILOVER:NETWORK,CLUSTER" ("" for nil).
func (lb *LoadBalancing) String() string {
	if lb == nil {
		return ""
	}
	mode := "FAILOVER:"
	if lb.Strict {
		mode = "STRICT:"
	}
	names := make([]string, len(lb.Preference))
	for i, s := range lb.Preference {
		names[i] = s.String()
	}
	return mode + strings.Join(names, ",")
}

// Routing preferences of Kubernetes' spec.trafficDistribution and Istio's
// networking.istio.io/traffic-distribution annotation. Isthmus's tiers are
// Istio's with the cluster added after the network: a client fails over to
// another cluster only when its own has no healthy endpoint in the tier.

// PreferSameZone (and PreferClose): zone, region, cluster, network, any.
func PreferSameZone() *LoadBalancing {
	return &LoadBalancing{Preference: []RoutingScope{RouteNetwork, RouteCluster, RouteRegion, RouteZone}}
}

// PreferSameNode: node, subzone, zone, region, cluster, network, any.
func PreferSameNode() *LoadBalancing {
	return &LoadBalancing{Preference: []RoutingScope{RouteNetwork, RouteCluster, RouteRegion, RouteZone, RouteSubzone, RouteNode}}
}

// LoadBalancingFor returns the routing preference of s for clients in
// cluster client: that of the client cluster's own Service when it defines
// one, else that of the oldest definition (the rule ports follow). nil is
// the default order.
func (s *Service) LoadBalancingFor(client ClusterID) *LoadBalancing {
	for _, d := range s.Definitions {
		if d.Cluster == client {
			return d.LoadBalancing
		}
	}
	if len(s.Definitions) > 0 {
		return s.Definitions[0].LoadBalancing
	}
	return nil
}
