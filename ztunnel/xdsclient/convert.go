package xdsclient

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/protobuf/proto"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// defaultHBONEPort is used for a gateway that names no HBONE port.
const defaultHBONEPort = defaults.HBONEPort

// kind says which state key a resource name maps to.
type kind uint8

const (
	kindWorkload kind = iota + 1
	kindService
)

// resource is one decoded, validated and converted Address resource.
type resource struct {
	name    string
	version string
	kind    kind
	// workload is set for kindWorkload, service for kindService.
	workload *state.Workload
	service  *state.Service
}

// converter turns Address protos into state values for one client.
type converter struct {
	// network is the client's network: service VIPs of other networks are
	// meaningless to it and dropped.
	network string
	// trustDomain fills workloads that name none.
	trustDomain string
}

// decode unmarshals, validates and converts one delta resource. Errors name
// the resource and never include its bytes.
func (cv converter) decode(r *discovery.Resource) (*resource, error) {
	name := r.GetName()
	if name == "" {
		return nil, errors.New("resource without a name")
	}
	anyRes := r.GetResource()
	if anyRes == nil {
		return nil, fmt.Errorf("resource %q: no body", name)
	}
	if anyRes.GetTypeUrl() != workloadv1.TypeURL {
		return nil, fmt.Errorf("resource %q: type %q, want %q", name, anyRes.GetTypeUrl(), workloadv1.TypeURL)
	}
	addr := &workloadv1.Address{}
	if err := proto.Unmarshal(anyRes.GetValue(), addr); err != nil {
		return nil, fmt.Errorf("resource %q: unmarshal: %w", name, err)
	}
	out := &resource{name: name, version: r.GetVersion()}
	switch t := addr.GetType().(type) {
	case *workloadv1.Address_Workload:
		w, err := cv.workload(t.Workload)
		if err != nil {
			return nil, fmt.Errorf("resource %q: workload: %w", name, err)
		}
		if w.UID != name {
			return nil, fmt.Errorf("resource %q: workload uid %q differs from the resource name", name, w.UID)
		}
		out.kind, out.workload = kindWorkload, w
	case *workloadv1.Address_Service:
		svc, err := cv.service(t.Service)
		if err != nil {
			return nil, fmt.Errorf("resource %q: service: %w", name, err)
		}
		if svc.Key() != name {
			return nil, fmt.Errorf("resource %q: service key %q differs from the resource name", name, svc.Key())
		}
		out.kind, out.service = kindService, svc
	default:
		return nil, fmt.Errorf("resource %q: Address holds neither a workload nor a service", name)
	}
	return out, nil
}

func (cv converter) workload(p *workloadv1.Workload) (*state.Workload, error) {
	if p.GetUid() == "" {
		return nil, errors.New("empty uid")
	}
	w := &state.Workload{
		UID:            p.GetUid(),
		Name:           p.GetName(),
		Namespace:      p.GetNamespace(),
		Network:        p.GetNetwork(),
		Cluster:        p.GetClusterId(),
		Node:           p.GetNode(),
		TrustDomain:    p.GetTrustDomain(),
		ServiceAccount: p.GetServiceAccount(),
		Locality: state.Locality{
			Region:  p.GetLocality().GetRegion(),
			Zone:    p.GetLocality().GetZone(),
			Subzone: p.GetLocality().GetSubzone(),
		},
		Capacity: p.GetCapacity(),
	}
	if w.TrustDomain == "" {
		w.TrustDomain = cv.trustDomain
	}
	if w.ServiceAccount != "" && w.Namespace == "" {
		return nil, errors.New("service account without a namespace")
	}
	for i, b := range p.GetAddresses() {
		a, err := addrOf(b)
		if err != nil {
			return nil, fmt.Errorf("address %d: %w", i, err)
		}
		w.Addresses = append(w.Addresses, a)
	}
	proto, err := tunnelProtocol(p.GetTunnelProtocol())
	if err != nil {
		return nil, err
	}
	w.Protocol = proto
	switch p.GetStatus() {
	case workloadv1.WorkloadStatus_HEALTHY:
		w.Status = state.StatusReady
	default:
		w.Status = state.StatusNotReady
	}
	w.HostNetwork = p.GetHostNetwork()
	w.WorkloadName, w.CanonicalName, w.CanonicalRevision = p.GetWorkloadName(), p.GetCanonicalName(), p.GetCanonicalRevision()
	for i, gw := range p.GetNetworkGateways() {
		g, err := gateway(w.Network, gw)
		if err != nil {
			return nil, fmt.Errorf("network gateway %d: %w", i, err)
		}
		w.Gateways = append(w.Gateways, g)
	}
	if len(w.Addresses) == 0 && len(w.Gateways) == 0 {
		return nil, errors.New("neither an address nor a network gateway")
	}
	if len(w.Addresses) > 0 && len(w.Gateways) > 0 {
		return nil, errors.New("both addresses and network gateways")
	}
	if w.Identities, err = identities(p.GetIdentities()); err != nil {
		return nil, err
	}
	if len(w.Gateways) > 0 && len(w.Identities) == 0 {
		return nil, errors.New("a workload behind gateways names no identity to verify end to end")
	}
	if w.Services, err = services(p.GetServices()); err != nil {
		return nil, err
	}
	return w, nil
}

func tunnelProtocol(p workloadv1.TunnelProtocol) (state.TunnelProtocol, error) {
	switch p {
	case workloadv1.TunnelProtocol_NONE:
		return state.TunnelNone, nil
	case workloadv1.TunnelProtocol_HBONE:
		return state.TunnelHBONE, nil
	}
	return state.TunnelNone, fmt.Errorf("unknown tunnel protocol %d", p)
}

// services converts a workload's service port maps (nil when none).
func services(in map[string]*workloadv1.PortList) (map[string]state.PortMap, error) {
	if len(in) == 0 {
		return nil, nil
	}
	out := make(map[string]state.PortMap, len(in))
	for key, pl := range in {
		pm := make(state.PortMap, len(pl.GetPorts()))
		for _, port := range pl.GetPorts() {
			sp, err := port16(port.GetServicePort())
			if err != nil || sp == 0 {
				return nil, fmt.Errorf("service %q: bad service port %d", key, port.GetServicePort())
			}
			tp, err := port16(port.GetTargetPort())
			if err != nil {
				return nil, fmt.Errorf("service %q: bad target port %d", key, port.GetTargetPort())
			}
			pm[sp] = tp
		}
		out[key] = pm
	}
	return out, nil
}

// identities parses SPIFFE URIs.
func identities(uris []string) ([]identity.Identity, error) {
	var out []identity.Identity
	for _, u := range uris {
		id, err := identity.Parse(u)
		if err != nil {
			return nil, err
		}
		out = append(out, id)
	}
	return out, nil
}

// gateway converts a GatewayAddress, by address or by DNS name (resolved
// when a tunnel is opened). A gateway must name the identities it may
// present.
func gateway(network string, p *workloadv1.GatewayAddress) (*state.NetworkGateway, error) {
	port, err := port16(p.GetHboneMtlsPort())
	if err != nil {
		return nil, err
	}
	if port == 0 {
		port = defaultHBONEPort
	}
	ids, err := identities(p.GetIdentities())
	if err != nil {
		return nil, err
	}
	if len(ids) == 0 {
		return nil, errors.New("gateway names no identity")
	}
	switch d := p.GetDestination().(type) {
	case *workloadv1.GatewayAddress_Address:
		a, err := addrOf(d.Address)
		if err != nil {
			return nil, err
		}
		if network == "" {
			return nil, errors.New("gateway of a workload without a network")
		}
		return &state.NetworkGateway{Network: network, Address: a, HBONEPort: port, Identities: ids, Capacity: p.GetCapacity()}, nil
	case *workloadv1.GatewayAddress_Hostname:
		if !validHostname(d.Hostname) {
			return nil, fmt.Errorf("gateway hostname %q is not a DNS name", d.Hostname)
		}
		if network == "" {
			return nil, errors.New("gateway of a workload without a network")
		}
		return &state.NetworkGateway{Network: network, Hostname: d.Hostname, HBONEPort: port, Identities: ids, Capacity: p.GetCapacity()}, nil
	default:
		return nil, errors.New("no destination")
	}
}

// validHostname accepts a DNS name: dot-separated labels of letters,
// digits and inner hyphens, 253 characters at most.
func validHostname(s string) bool {
	if s == "" || len(s) > 253 {
		return false
	}
	for _, label := range strings.Split(s, ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for _, r := range label {
			if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-') {
				return false
			}
		}
	}
	return true
}

func (cv converter) service(p *workloadv1.Service) (*state.Service, error) {
	if p.GetName() == "" || p.GetNamespace() == "" {
		return nil, errors.New("name and namespace are required")
	}
	svc := &state.Service{Name: p.GetName(), Namespace: p.GetNamespace(), Hostname: p.GetHostname(),
		ClusterLocal: p.GetScope() == workloadv1.ServiceScope_CLUSTER_LOCAL, LocalClusters: p.GetLocalClusters(),
		Headless: p.GetHeadless(), Exported: p.GetExported()}
	for i, b := range p.GetAllocatedAddresses() {
		a, err := addrOf(b)
		if err != nil {
			return nil, fmt.Errorf("allocated address %d: %w", i, err)
		}
		svc.Allocated = append(svc.Allocated, a)
	}
	if svc.Hostname == "" {
		svc.Hostname = state.Hostname(svc.Name, svc.Namespace)
	}
	for i, na := range p.GetAddresses() {
		a, err := addrOf(na.GetAddress())
		if err != nil {
			return nil, fmt.Errorf("address %d: %w", i, err)
		}
		if na.GetNetwork() == "" || na.GetNetwork() == cv.network {
			svc.VIPs = append(svc.VIPs, a)
		}
	}
	for _, sp := range p.GetPorts() {
		port, err := port16(sp.GetServicePort())
		if err != nil || port == 0 {
			return nil, fmt.Errorf("bad service port %d", sp.GetServicePort())
		}
		if _, err := port16(sp.GetTargetPort()); err != nil {
			return nil, fmt.Errorf("port %d: bad target port %d", port, sp.GetTargetPort())
		}
		svc.Ports = append(svc.Ports, port)
	}
	lb, err := loadBalancing(p.GetLoadBalancing())
	if err != nil {
		return nil, err
	}
	svc.LoadBalancing = lb
	return svc, nil
}

// wireScopes maps the workload API's routing scopes to state's.
var wireScopes = map[workloadv1.LoadBalancing_Scope]state.Scope{
	workloadv1.LoadBalancing_NETWORK: state.ScopeNetwork, workloadv1.LoadBalancing_CLUSTER: state.ScopeCluster,
	workloadv1.LoadBalancing_REGION: state.ScopeRegion, workloadv1.LoadBalancing_ZONE: state.ScopeZone,
	workloadv1.LoadBalancing_SUBZONE: state.ScopeSubzone, workloadv1.LoadBalancing_NODE: state.ScopeNode,
}

// loadBalancing converts a service's routing preference: nil stays nil (the
// default order); UNSPECIFIED_MODE is FAILOVER. An unknown scope or mode,
// or a scope listed twice, is an error: ranking by part of a preference
// would send traffic where the service did not ask.
func loadBalancing(p *workloadv1.LoadBalancing) (*state.LoadBalancing, error) {
	if p == nil {
		return nil, nil
	}
	lb := &state.LoadBalancing{Preference: make([]state.Scope, 0, len(p.GetRoutingPreference()))}
	switch p.GetMode() {
	case workloadv1.LoadBalancing_UNSPECIFIED_MODE, workloadv1.LoadBalancing_FAILOVER:
	case workloadv1.LoadBalancing_STRICT:
		lb.Strict = true
	default:
		return nil, fmt.Errorf("load balancing: unknown mode %d", p.GetMode())
	}
	for i, ws := range p.GetRoutingPreference() {
		sc, ok := wireScopes[ws]
		if !ok {
			return nil, fmt.Errorf("load balancing: routing preference %d: unknown scope %d", i, ws)
		}
		if slices.Contains(lb.Preference, sc) {
			return nil, fmt.Errorf("load balancing: scope %s listed twice", sc)
		}
		lb.Preference = append(lb.Preference, sc)
	}
	return lb, nil
}

func addrOf(b []byte) (netip.Addr, error) {
	a, ok := netip.AddrFromSlice(b)
	if !ok {
		return netip.Addr{}, fmt.Errorf("IP of %d bytes, want 4 or 16", len(b))
	}
	return a.Unmap(), nil
}

func port16(p uint32) (uint16, error) {
	if p > 0xffff {
		return 0, fmt.Errorf("port %d out of range", p)
	}
	return uint16(p), nil
}
