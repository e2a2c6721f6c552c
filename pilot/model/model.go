// Package model holds the plain types shared by the control plane: clusters,
// networks, localities, services, workloads, endpoints and network gateways.
//
// It has no Kubernetes imports. Values of these types that the registry
// publishes are immutable: a change replaces the value, it never mutates a
// published one, so readers may keep and share them without locks.
package model

import (
	"maps"
	"net/netip"
	"slices"
	"strings"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
)

// ClusterID names one Kubernetes cluster of the federation (a DNS-1123 label).
type ClusterID string

// Network names a set of workloads that reach each other directly by address.
type Network string

// DefaultDomain is the DNS suffix of Kubernetes service hostnames.
const DefaultDomain = defaults.DNSDomain

// HBONEPort is the port of HBONE (HTTP/2 CONNECT over mTLS) listeners.
const HBONEPort = defaults.HBONEPort

// TLSPassthroughPort is the east-west gateway's SNI-routed mTLS
// passthrough port (Istio's "tls" port of its east-west gateway).
const TLSPassthroughPort = defaults.TLSPassthroughPort

// Locality is where a workload runs, from its node's topology labels.
type Locality struct {
	Region  string `json:"region"`
	Zone    string `json:"zone"`
	Subzone string `json:"subzone,omitempty"`
}

// String renders the locality as region/zone/subzone ("" when unset).
func (l Locality) String() string {
	if l == (Locality{}) {
		return ""
	}
	return l.Region + "/" + l.Zone + "/" + l.Subzone
}

// Hostname returns the federated hostname of service name in namespace ns.
func Hostname(name, ns, domain string) string {
	if domain == "" {
		domain = DefaultDomain
	}
	return name + "." + ns + ".svc." + domain
}

// ServiceKey identifies a service across clusters (namespace sameness).
type ServiceKey struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
}

// String renders the key as namespace/name.
func (k ServiceKey) String() string { return k.Namespace + "/" + k.Name }

// Protocol is a transport protocol of a port.
type Protocol string

// Transport protocols of service ports.
const (
	TCP  Protocol = "TCP"
	UDP  Protocol = "UDP"
	SCTP Protocol = "SCTP"
)

// Port is one port of a service.
type Port struct {
	// Name is the port's name (unique within the service, may be empty for a
	// single-port service).
	Name string `json:"name"`
	// Port is the service port.
	Port uint16 `json:"port"`
	// TargetPort is the numeric port on the workload; zero when the service
	// names its target port (TargetPortName) and it is resolved per workload.
	TargetPort uint16 `json:"targetPort"`
	// TargetPortName is a named target port ("" when numeric).
	TargetPortName string `json:"targetPortName,omitempty"`
	// Protocol is the transport protocol.
	Protocol Protocol `json:"protocol"`
	// AppProtocol is the application protocol (appProtocol, or "" when unset).
	AppProtocol string `json:"appProtocol,omitempty"`
}

// Scope says whether a service crosses clusters.
type Scope uint8

// Service scopes.
const (
	// ScopeGlobal services are federated: same name and namespace in every
	// cluster is one service.
	ScopeGlobal Scope = iota
	// ScopeClusterLocal services are never visible outside their cluster.
	ScopeClusterLocal
)

// String names the scope.
func (s Scope) String() string {
	if s == ScopeClusterLocal {
		return "cluster-local"
	}
	return "global"
}

// WorkloadUID returns the uid of a pod workload: cluster/namespace/name.
func WorkloadUID(cluster ClusterID, ns, name string) string {
	return string(cluster) + "/" + ns + "/" + name
}

// PortMapping maps a service port to the target port on one workload.
type PortMapping struct {
	ServicePort uint16 `json:"servicePort"`
	TargetPort  uint16 `json:"targetPort"`
}

// Workload is one addressable instance: a pod, or an address from an
// EndpointSlice of a service without a selector. Where it runs and as whom
// is its Placement, shared by every workload of the same identity on the
// same node (see Place), so its fields read as the workload's own
// (w.Cluster, w.Node, ...) but must never be assigned through a workload.
type Workload struct {
	*Placement
	// UID is <cluster>/<namespace>/<name>.
	UID  string `json:"uid"`
	Name string `json:"name"`
	// Addresses are the workload's IPs (status.podIPs).
	Addresses []netip.Addr      `json:"addresses"`
	Labels    map[string]string `json:"labels,omitempty"`
	// Services the workload backs, keyed by service hostname, with the port
	// mappings resolved for this workload. Set by the registry.
	Services map[string][]PortMapping `json:"services,omitempty"`
	// Ready is the pod's Ready condition (or the EndpointSlice ready flag).
	Ready bool `json:"ready"`
	// Terminating is set once the pod has a deletion timestamp.
	Terminating bool `json:"terminating,omitempty"`
	// HostNetwork is set for a pod sharing its node's network namespace (a
	// ztunnel, a node agent): no ztunnel captures its traffic, so it is
	// reached without HBONE.
	HostNetwork bool `json:"hostNetwork,omitempty"`
	// FromSlice marks a workload made from an EndpointSlice address (UID
	// from SliceWorkloadPrefix). Such a workload belongs to one service and
	// is kept in that service's shard only. When the address's targetRef
	// names a pod of the slice's namespace that has this address, Name is
	// that pod's name and Placement the pod's; readiness is the slice's.
	FromSlice bool `json:"fromSlice,omitempty"`
	// SliceOfPod is set on a FromSlice workload whose address is bound to a
	// pod by its targetRef (Name and Placement are that pod's). An address
	// without a pod (the API server behind the kubernetes Service, a
	// database outside the cluster) is no ztunnel's: see Tunnelled.
	SliceOfPod bool `json:"sliceOfPod,omitempty"`
	// Created is when the object that claims the addresses was created
	// (Unix seconds; Kubernetes timestamps have a one-second resolution):
	// the pod, or the EndpointSlice an address was listed in. The oldest
	// claim of an address wins among equals (see Outranks).
	Created int64 `json:"created"`
}

// ClaimsAddresses reports whether w claims its addresses as their owner.
// A hostNetwork pod does not: it shares its node's address with the node
// and every other hostNetwork pod there, so it is no address's owner.
func (w *Workload) ClaimsAddresses() bool { return !w.HostNetwork }

// Outranks reports whether a's claim on an address it shares with b wins:
// a pod beats an address made from an EndpointSlice; among equals the
// older claim wins, then the smaller UID, so the order is total.
func Outranks(a, b *Workload) bool {
	if a.FromSlice != b.FromSlice {
		return !a.FromSlice
	}
	if a.Created != b.Created {
		return a.Created < b.Created
	}
	return a.UID < b.UID
}

// NamesPod reports whether w, made from an EndpointSlice address, is bound
// to pod workload p by its targetRef: the slice's own view of that pod's
// address, not a rival claim on it.
func (w *Workload) NamesPod(p *Workload) bool {
	return w.FromSlice && !p.FromSlice && w.Placement == p.Placement && p.UID == WorkloadUID(p.Cluster, p.Namespace, w.Name)
}

// SliceWorkloadPrefix is the UID prefix of the workloads made from the
// EndpointSlice addresses of service k in cluster: the address follows.
func SliceWorkloadPrefix(cluster ClusterID, k ServiceKey) string {
	return WorkloadUID(cluster, k.Namespace, "endpointslice."+k.Name+".")
}

// SliceWorkloadService returns the service whose EndpointSlice address uid
// was made from (see SliceWorkloadPrefix).
func SliceWorkloadService(uid string) (ServiceKey, bool) {
	_, rest, ok1 := strings.Cut(uid, "/")
	ns, name, ok2 := strings.Cut(rest, "/")
	name, ok3 := strings.CutPrefix(name, "endpointslice.")
	svc, _, ok4 := strings.Cut(name, ".") // service names have no dots
	return ServiceKey{Namespace: ns, Name: svc}, ok1 && ok2 && ok3 && ok4
}

// Endpoint is one workload behind one service, as the registry shards
// them. It points at the (immutable) workload instead of copying it, so an
// endpoint costs a pointer and a port map, whatever the workload holds.
type Endpoint struct {
	// Workload is the pod, or the workload made from an EndpointSlice
	// address, behind the endpoint. Never nil in a published shard.
	Workload *Workload `json:"workload"`
	// Ports maps the service's ports to this endpoint's target ports
	// (shared between endpoints with equal mappings; never mutated).
	Ports []PortMapping `json:"ports"`
}

// FindEndpoint returns where workload uid's endpoint is, or would be, in
// eps (a shard: sorted by workload UID), and whether it is there.
func FindEndpoint(eps []Endpoint, uid string) (int, bool) {
	return slices.BinarySearchFunc(eps, uid, func(e Endpoint, uid string) int { return strings.Compare(e.Workload.UID, uid) })
}

// Address is the endpoint's IP.
func (e *Endpoint) Address() netip.Addr { return e.Workload.Addresses[0] }

// WorkloadUID is the uid of the endpoint's workload.
func (e *Endpoint) WorkloadUID() string { return e.Workload.UID }

// Cluster is the endpoint's cluster.
func (e *Endpoint) Cluster() ClusterID { return e.Workload.Cluster }

// Network is the endpoint's network.
func (e *Endpoint) Network() Network { return e.Workload.Network }

// Locality is the endpoint's locality.
func (e *Endpoint) Locality() Locality { return e.Workload.Locality }

// ServiceAccount is the endpoint's service account.
func (e *Endpoint) ServiceAccount() string { return e.Workload.ServiceAccount }

// Namespace is the endpoint's namespace.
func (e *Endpoint) Namespace() string { return e.Workload.Namespace }

// Node is the node the endpoint runs on.
func (e *Endpoint) Node() string { return e.Workload.Node }

// Ready reports whether the endpoint may take new traffic.
func (e *Endpoint) Ready() bool { return e.Workload.Ready }

// Terminating reports whether the endpoint's workload is shutting down.
func (e *Endpoint) Terminating() bool { return e.Workload.Terminating }

// TargetPort returns the target port for service port p, and whether the
// endpoint serves it.
func (e *Endpoint) TargetPort(p uint16) (uint16, bool) {
	for _, m := range e.Ports {
		if m.ServicePort == p {
			return m.TargetPort, true
		}
	}
	return 0, false
}

// Equal reports whether two endpoints are the same in value.
func (e *Endpoint) Equal(o *Endpoint) bool {
	return slices.Equal(e.Ports, o.Ports) && e.Workload.Equal(o.Workload)
}

// Equal reports whether two workloads are the same in value.
func (w *Workload) Equal(o *Workload) bool {
	if w == o {
		return true
	}
	if w == nil || o == nil || len(w.Services) != len(o.Services) {
		return false
	}
	for h, pm := range w.Services {
		if !slices.Equal(pm, o.Services[h]) {
			return false
		}
	}
	return w.UID == o.UID && w.Name == o.Name && slices.Equal(w.Addresses, o.Addresses) &&
		(w.Placement == o.Placement || (w.Placement != nil && o.Placement != nil && *w.Placement == *o.Placement)) &&
		maps.Equal(w.Labels, o.Labels) && w.Ready == o.Ready && w.Terminating == o.Terminating &&
		w.HostNetwork == o.HostNetwork && w.FromSlice == o.FromSlice && w.SliceOfPod == o.SliceOfPod && w.Created == o.Created
}

// Tunnelled reports whether w is reached over HBONE: a pod in its own
// network namespace, or an EndpointSlice address bound to one. A
// hostNetwork pod shares its node's namespace, where no ztunnel captures
// for it, and a slice address without a pod has no ztunnel at all: both
// are reached in plaintext, and no gateway forwards to them.
func (w *Workload) Tunnelled() bool {
	return !w.HostNetwork && (!w.FromSlice || w.SliceOfPod)
}

// NetworkGateway is an east-west gateway through which other networks reach
// the workloads of Network, or a candidate for one that pilot does not
// trust (Ignored says why). Discovery reports every candidate so that
// operators can see the ignored ones; only trusted gateways reach xDS.
type NetworkGateway struct {
	Network Network   `json:"network"`
	Cluster ClusterID `json:"cluster"`
	// Address is the gateway's IP (or Hostname when it has none).
	Address  netip.Addr `json:"address,omitzero"`
	Hostname string     `json:"hostname,omitempty"`
	// HBONEPort is the gateway's HBONE port (15008 by default).
	HBONEPort uint16 `json:"hbonePort"`
	// TLSPassthroughPort is the gateway's SNI passthrough port (15443, or
	// the Service port named tls), 0 when the gateway has none: then
	// clients that cannot speak HBONE cannot cross to its network.
	TLSPassthroughPort uint16 `json:"tlsPassthroughPort,omitempty"`
	// Source names the Service the gateway was discovered from (ns/name).
	Source string `json:"source,omitempty"`
	// ServiceAccounts are the accounts, in the Service's namespace, whose
	// identities the gateway may present: those an operator annotated
	// (GatewayServiceAccountsAnnotation), else those of the pods the
	// Service selects. Sorted, without duplicates.
	ServiceAccounts []string `json:"serviceAccounts"`
	// Capacity weighs the gateway against the other gateways of its
	// network: its ready instances, at least 1.
	Capacity uint32 `json:"capacity,omitempty"`
	// Ignored is why the candidate is not a gateway ("" for a trusted one):
	// one of the GatewayIgnored* reasons.
	Ignored string `json:"ignored,omitempty"`
}

// Reasons a gateway candidate is ignored.
const (
	// GatewayIgnoredUntrustedNamespace: the Service is outside the
	// namespaces pilot trusts to hold gateways.
	GatewayIgnoredUntrustedNamespace = "untrusted_namespace"
	// GatewayIgnoredNoAddress: the Service has no load-balancer address or
	// external IP yet.
	GatewayIgnoredNoAddress = "no_address"
	// GatewayIgnoredNoIdentity: neither an annotation nor a selected pod
	// says which identity the gateway presents, so clients could not
	// verify it.
	GatewayIgnoredNoIdentity = "no_identity"
)

// GatewayServiceAccountsAnnotation on a gateway Service lists (comma
// separated) the service accounts of its namespace whose identities the
// gateway presents, overriding those of its pods.
const GatewayServiceAccountsAnnotation = "networking.isthmus.io/gateway-service-accounts"

// Namespace returns the namespace of the gateway's Service.
func (g NetworkGateway) Namespace() string {
	ns, _, _ := strings.Cut(g.Source, "/")
	return ns
}

// Trusted reports whether g is a gateway clients may use.
func (g NetworkGateway) Trusted() bool { return g.Ignored == "" }

// Equal reports whether g and o are the same gateway in every field.
func (g NetworkGateway) Equal(o NetworkGateway) bool {
	return g.Network == o.Network && g.Cluster == o.Cluster && g.Address == o.Address && g.Hostname == o.Hostname &&
		g.HBONEPort == o.HBONEPort && g.TLSPassthroughPort == o.TLSPassthroughPort && g.Source == o.Source && slices.Equal(g.ServiceAccounts, o.ServiceAccounts) &&
		g.Capacity == o.Capacity && g.Ignored == o.Ignored
}

// Key identifies the gateway within its network.
func (g NetworkGateway) Key() string {
	addr := g.Hostname
	if g.Address.IsValid() {
		addr = g.Address.String()
	}
	return string(g.Network) + "/" + string(g.Cluster) + "/" + g.Source + "/" + addr
}

// Istio's canonical-service labels, and the labels controllers put on
// their pods, which name a pod's workload (its Deployment, StatefulSet,
// DaemonSet or Job) without keeping its owner references.
const (
	LabelCanonicalName     = "service.istio.io/canonical-name"
	LabelCanonicalRevision = "service.istio.io/canonical-revision"
	labelAppName           = "app.kubernetes.io/name"
	labelAppVersion        = "app.kubernetes.io/version"
	labelPodTemplateHash   = "pod-template-hash"
	labelStatefulSetPod    = "statefulset.kubernetes.io/pod-name"
	labelJobName           = "job-name"
	labelRevisionHash      = "controller-revision-hash"
	labelTemplateGen       = "pod-template-generation"
)

// WorkloadName is the name of the workload a pod belongs to, as Istio's
// telemetry names it: a Deployment's pods <deploy>-<hash>-<x> give <deploy>,
// a StatefulSet's <sts>-<n> give <sts>, a DaemonSet's <ds>-<x> give <ds>, a
// Job's its job-name; any other pod is its own workload. A workload made
// from an EndpointSlice address has none ("").
func (w *Workload) WorkloadName() string {
	if w.FromSlice {
		return ""
	}
	l := w.Labels
	if h := l[labelPodTemplateHash]; h != "" {
		if i := strings.LastIndex(w.Name, "-"+h+"-"); i > 0 {
			return w.Name[:i]
		}
	}
	if l[labelStatefulSetPod] == w.Name && l[labelRevisionHash] != "" {
		if i := strings.LastIndex(w.Name, "-"); i > 0 {
			return w.Name[:i]
		}
	}
	if j := l[labelJobName]; j != "" {
		return j
	}
	if l[labelRevisionHash] != "" && l[labelTemplateGen] != "" {
		if i := strings.LastIndex(w.Name, "-"); i > 0 {
			return w.Name[:i]
		}
	}
	return w.Name
}

// CanonicalName is the workload's canonical service (Istio's rule: the
// canonical-name label, else app.kubernetes.io/name, else app, else the
// workload name).
func (w *Workload) CanonicalName() string {
	for _, k := range []string{LabelCanonicalName, labelAppName, "app"} {
		if v := w.Labels[k]; v != "" {
			return v
		}
	}
	return w.WorkloadName()
}

// CanonicalRevision is the workload's canonical revision (the
// canonical-revision label, else app.kubernetes.io/version, else version,
// else "latest").
func (w *Workload) CanonicalRevision() string {
	for _, k := range []string{LabelCanonicalRevision, labelAppVersion, "version"} {
		if v := w.Labels[k]; v != "" {
			return v
		}
	}
	return "latest"
}
