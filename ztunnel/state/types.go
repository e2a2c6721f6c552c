// Package state holds ztunnel's view of the mesh: workloads, services and
// network gateways, indexed in immutable snapshots. A Store swaps snapshots
// atomically, so readers never lock and never see a half-applied update;
// writers (the delta-xDS client, tests) apply upserts and removals by key
// through Store.Update.
package state

import (
	"maps"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
)

// DefaultDomainSuffix is the cluster domain used to build service hostnames.
const DefaultDomainSuffix = "svc.cluster.local"

// TunnelProtocol is how a workload expects to be reached.
type TunnelProtocol uint8

const (
	// TunnelNone means plain TCP to the workload.
	TunnelNone TunnelProtocol = iota
	// TunnelHBONE means HTTP/2 CONNECT over mTLS on the HBONE port.
	TunnelHBONE
)

// String returns the protocol name.
func (p TunnelProtocol) String() string {
	if p == TunnelHBONE {
		return "HBONE"
	}
	return "NONE"
}

// MarshalText implements encoding.TextMarshaler.
func (p TunnelProtocol) MarshalText() ([]byte, error) { return []byte(p.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (p *TunnelProtocol) UnmarshalText(b []byte) error {
	*p = TunnelNone
	if string(b) == "HBONE" {
		*p = TunnelHBONE
	}
	return nil
}

// Status is a workload's health.
type Status uint8

const (
	// StatusReady workloads receive new connections.
	StatusReady Status = iota
	// StatusNotReady workloads receive no new connections.
	StatusNotReady
	// StatusTerminating workloads are going away and receive no new connections.
	StatusTerminating
)

// String returns the status name.
func (s Status) String() string {
	switch s {
	case StatusReady:
		return "Ready"
	case StatusTerminating:
		return "Terminating"
	default:
		return "NotReady"
	}
}

// MarshalText implements encoding.TextMarshaler.
func (s Status) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (s *Status) UnmarshalText(b []byte) error {
	switch string(b) {
	case "Ready":
		*s = StatusReady
	case "Terminating":
		*s = StatusTerminating
	default:
		*s = StatusNotReady
	}
	return nil
}

// Locality is a workload's topology position.
type Locality struct {
	Region  string `json:"region,omitempty"`
	Zone    string `json:"zone,omitempty"`
	Subzone string `json:"subzone,omitempty"`
}

// NetworkGateway is an HBONE entry point of a network.
type NetworkGateway struct {
	// Network is the network the gateway fronts.
	Network string `json:"network"`
	// Address and HBONEPort are where other networks reach the gateway.
	// A gateway known only by a DNS name (a cloud load balancer) has
	// Hostname instead, resolved each time a tunnel to it is opened.
	Address   netip.Addr `json:"address,omitzero"`
	Hostname  string     `json:"hostname,omitempty"`
	HBONEPort uint16     `json:"hbonePort"`
	// Identities are the SPIFFE identities the gateway may present; a
	// tunnel to a gateway presenting any other is refused. Never empty for
	// a gateway from xDS.
	Identities []identity.Identity `json:"identities"`
	// Capacity weighs the gateway against the others of its network; 0
	// means 1.
	Capacity uint32 `json:"capacity,omitempty"`
}

// Weight returns the capacity used to spread tunnels (at least 1).
func (g *NetworkGateway) Weight() uint64 { return uint64(max(g.Capacity, 1)) }

// AddrPort returns the gateway's HBONE address (not valid for a gateway
// known by Hostname).
func (g *NetworkGateway) AddrPort() netip.AddrPort { return netip.AddrPortFrom(g.Address, g.HBONEPort) }

// Target returns the gateway's HBONE address as host:port, its Hostname
// or its Address.
func (g *NetworkGateway) Target() string {
	if g.Address.IsValid() {
		return g.AddrPort().String()
	}
	return net.JoinHostPort(g.Hostname, strconv.Itoa(int(g.HBONEPort)))
}

// PortMap maps a service port to the workload's target port.
type PortMap map[uint16]uint16

// Workload is one addressable workload (a pod) or, when it has no address
// and a Gateway, a synthetic "split-horizon" workload standing for a
// service's endpoints on a remote network. Values held by a Snapshot are
// shared and must not be modified.
type Workload struct {
	UID            string         `json:"uid"`
	Name           string         `json:"name"`
	Namespace      string         `json:"namespace"`
	Addresses      []netip.Addr   `json:"addresses,omitempty"`
	Network        string         `json:"network,omitempty"`
	Cluster        string         `json:"cluster,omitempty"`
	Node           string         `json:"node,omitempty"`
	TrustDomain    string         `json:"trustDomain,omitempty"`
	ServiceAccount string         `json:"serviceAccount,omitempty"`
	Locality       Locality       `json:"locality"`
	Protocol       TunnelProtocol `json:"protocol"`
	// Gateways are set for synthetic workloads: the trusted gateways of
	// their network, through which they are reached.
	Gateways []*NetworkGateway `json:"gateways,omitempty"`
	// Identities are, for a synthetic workload, the identities its
	// endpoints run as: the end-to-end peer must present one of them.
	Identities []identity.Identity `json:"identities,omitempty"`
	// HostNetwork workloads share their node's address: they are never a
	// connection's source and are not indexed by address.
	HostNetwork bool `json:"hostNetwork,omitempty"`
	// WorkloadName, CanonicalName and CanonicalRevision name the workload
	// in telemetry (Istio's labels).
	WorkloadName      string `json:"workloadName,omitempty"`
	CanonicalName     string `json:"canonicalName,omitempty"`
	CanonicalRevision string `json:"canonicalRevision,omitempty"`
	// Services maps "<ns>/<hostname>" of each service the workload backs to
	// its port mapping.
	Services map[string]PortMap `json:"services,omitempty"`
	Status   Status             `json:"status"`
	// Capacity weighs the workload in endpoint selection; 0 means 1.
	Capacity uint32 `json:"capacity,omitempty"`
}

// Identity returns the workload's SPIFFE identity.
func (w *Workload) Identity() identity.Identity {
	if w.ServiceAccount == "" {
		return identity.Identity{}
	}
	return identity.Identity{TrustDomain: w.TrustDomain, Namespace: w.Namespace, ServiceAccount: w.ServiceAccount}
}

// Synthetic reports whether w stands for remote endpoints behind gateways.
func (w *Workload) Synthetic() bool { return len(w.Addresses) == 0 && len(w.Gateways) > 0 }

// PeerIdentities returns the identities an HBONE peer standing for w may
// present: its own identity, or for a synthetic workload those of the
// endpoints it stands for. Empty means w cannot be verified, and must not
// be dialled over HBONE.
func (w *Workload) PeerIdentities() []identity.Identity {
	if w.Synthetic() {
		return w.Identities
	}
	if id := w.Identity(); !id.IsZero() {
		return []identity.Identity{id}
	}
	return nil
}

// Weight returns the capacity used for weighted selection (at least 1).
func (w *Workload) Weight() uint64 {
	if w.Capacity == 0 {
		return 1
	}
	return uint64(w.Capacity)
}

// TargetPort returns the workload port for port of the service with key
// svcKey, and whether the workload serves that port.
func (w *Workload) TargetPort(svcKey string, port uint16) (uint16, bool) {
	pm, ok := w.Services[svcKey]
	if !ok {
		return 0, false
	}
	if len(pm) == 0 {
		return port, true
	}
	t, ok := pm[port]
	if ok && t == 0 {
		t = port
	}
	return t, ok
}

// ServesPort reports whether any service the workload backs targets port.
func (w *Workload) ServesPort(port uint16) bool {
	for _, pm := range w.Services {
		for sp, tp := range pm {
			if tp == port || (tp == 0 && sp == port) {
				return true
			}
		}
	}
	return false
}

func (w *Workload) clone() *Workload {
	c := *w
	c.Addresses = slices.Clone(w.Addresses)
	c.Identities = slices.Clone(w.Identities)
	c.Gateways = make([]*NetworkGateway, 0, len(w.Gateways))
	for _, g := range w.Gateways {
		gc := *g
		gc.Identities = slices.Clone(g.Identities)
		c.Gateways = append(c.Gateways, &gc)
	}
	if len(c.Gateways) == 0 {
		c.Gateways = nil
	}
	if w.Services != nil {
		c.Services = make(map[string]PortMap, len(w.Services))
		for k, pm := range w.Services {
			c.Services[k] = maps.Clone(pm)
		}
	}
	return &c
}

// Service is a (federated) service. Values held by a Snapshot are shared and
// must not be modified.
type Service struct {
	Name      string       `json:"name"`
	Namespace string       `json:"namespace"`
	Hostname  string       `json:"hostname"`
	VIPs      []netip.Addr `json:"vips,omitempty"`
	Ports     []uint16     `json:"ports"`
	// ClusterLocal services never cross clusters.
	ClusterLocal bool `json:"clusterLocal,omitempty"`
	// LocalClusters are clusters whose endpoints of the service are
	// reachable only from inside that cluster (MCS export mode).
	LocalClusters []string `json:"localClusters,omitempty"`
	// Headless services have no virtual IP of their own.
	Headless bool `json:"headless,omitempty"`
	// Exported services also answer under clusterset.local (MCS).
	Exported bool `json:"exported,omitempty"`
	// Allocated are the virtual addresses pilot allocated for the service
	// on this node's network: because it has none of its own here, or,
	// for an exported service that is not headless, as its clusterset
	// (ServiceImport) IPs beside its local VIPs. They are in VIPs too.
	Allocated []netip.Addr `json:"allocated,omitempty"`
	// LoadBalancing is the service's routing preference; nil keeps the
	// default order (see Selector.Rank).
	LoadBalancing *LoadBalancing `json:"loadBalancing,omitempty"`
}

// Scope is a property an endpoint can share with its client (Istio's
// workload API LoadBalancing.Scope).
type Scope uint8

// Routing scopes.
const (
	ScopeNetwork Scope = iota + 1
	ScopeCluster
	ScopeRegion
	ScopeZone
	ScopeSubzone
	ScopeNode
)

var scopeNames = [...]string{ScopeNetwork: "NETWORK", ScopeCluster: "CLUSTER", ScopeRegion: "REGION",
	ScopeZone: "ZONE", ScopeSubzone: "SUBZONE", ScopeNode: "NODE"}

// String returns the scope's name (NETWORK, ZONE, ...).
func (s Scope) String() string {
	if s != 0 && int(s) < len(scopeNames) {
		return scopeNames[s]
	}
	return "UNKNOWN"
}

// MarshalText implements encoding.TextMarshaler.
func (s Scope) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (s *Scope) UnmarshalText(b []byte) error {
	*s = Scope(max(slices.Index(scopeNames[:], string(b)), 0))
	return nil
}

// LoadBalancing is a service's routing preference. Clients rank a
// service's ready endpoints by the length of the prefix of Preference they
// match and use the best rank (FAILOVER); with Strict only endpoints
// matching every scope qualify (STRICT). An empty Preference ranks every
// ready endpoint alike.
type LoadBalancing struct {
	Preference []Scope `json:"preference"`
	Strict     bool    `json:"strict,omitempty"`
}

// ReachableFromOtherClusters reports whether an endpoint of the service in
// cluster may be reached from outside that cluster (through a gateway).
func (s *Service) ReachableFromOtherClusters(cluster string) bool {
	return !s.ClusterLocal && !slices.Contains(s.LocalClusters, cluster)
}

// Key returns "<ns>/<hostname>", the key used in Workload.Services.
func (s *Service) Key() string { return s.Namespace + "/" + s.Hostname }

// HasPort reports whether the service exposes port.
func (s *Service) HasPort(port uint16) bool { return slices.Contains(s.Ports, port) }

// Hostname returns <name>.<ns>.svc.cluster.local.
func Hostname(name, namespace string) string {
	return strings.Join([]string{name, namespace, DefaultDomainSuffix}, ".")
}

// ServiceKey returns the Workload.Services key for a service.
func ServiceKey(namespace, hostname string) string { return namespace + "/" + hostname }

func (s *Service) clone() *Service {
	c := *s
	c.VIPs = slices.Clone(s.VIPs)
	c.Ports = slices.Clone(s.Ports)
	c.LocalClusters = slices.Clone(s.LocalClusters)
	c.Allocated = slices.Clone(s.Allocated)
	if s.LoadBalancing != nil {
		lb := *s.LoadBalancing
		lb.Preference = slices.Clone(lb.Preference)
		c.LoadBalancing = &lb
	}
	if c.Hostname == "" {
		c.Hostname = Hostname(c.Name, c.Namespace)
	}
	return &c
}
