package xds

import (
	"cmp"
	"strings"

	"google.golang.org/protobuf/types/known/wrapperspb"
	"istio.io/istio/pkg/workloadapi"

	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// Istio's workload API (istio.io/istio/pkg/workloadapi), served beside
// Isthmus's own to Istio's ztunnel. It is encoded from the resources the
// view builds for Isthmus's type (buildWorkload, buildServiceAddresses):
// one registry, one set of visibility decisions, and an Isthmus message
// translated field by field. A view encodes Istio's type only once a
// client of its class asks for it (istioGroup in view.go): a class of
// Isthmus ztunnels holds no Istio resources, and a class of Istio ztunnels
// none of Isthmus's.

// IstioAddressType is the type URL of Istio's workload discovery resources.
const IstioAddressType = "type.googleapis.com/istio.workload.Address"

// IstioStaticStrictPolicy is the name of the Authorization that refuses
// plaintext, as Istio names it: listed in a workload's
// authorization_policies when its PeerAuthentication is STRICT.
const IstioStaticStrictPolicy = "istio_converted_static_strict"

// IstioWorkloadUID is the uid Istio gives the workload pilot calls uid
// (<cluster>/<namespace>/<name>): <cluster>/<group>/<kind>/<namespace>/<name>,
// with the empty group and kind Pod for a pod, and for an address of an
// EndpointSlice (SliceWorkloadPrefix) group discovery.k8s.io, kind
// EndpointSlice, named <service>/<address> (pilot does not keep the
// slice's own name). A uid of another form is returned as it is.
func IstioWorkloadUID(uid string) string {
	cluster, rest, ok1 := strings.Cut(uid, "/")
	ns, name, ok2 := strings.Cut(rest, "/")
	if !ok1 || !ok2 {
		return uid
	}
	if slice, ok := strings.CutPrefix(name, "endpointslice."); ok {
		if svc, addr, ok := strings.Cut(slice, "."); ok {
			return cluster + "/discovery.k8s.io/EndpointSlice/" + ns + "/" + svc + "/" + addr
		}
	}
	return cluster + "//Pod/" + ns + "/" + name
}

// IstioSplitHorizonUID is the uid Istio gives the synthetic workload
// standing for the endpoints of service hostname (namespace ns) on the
// network of gateway gw: <network>/SplitHorizonWorkload/<gateway service
// namespace/name>/<gateway address or hostname>/<namespace>/<hostname>.
func IstioSplitHorizonUID(gw model.NetworkGateway, ns, hostname string) string {
	return string(gw.Network) + "/SplitHorizonWorkload/" + gw.Source + "/" + gatewayDestination(gw) + "/" + ServiceResourceName(ns, hostname)
}

func gatewayDestination(gw model.NetworkGateway) string {
	if gw.Address.IsValid() {
		return gw.Address.String()
	}
	return gw.Hostname
}

// istioEncoder translates the Isthmus resources of one batch.
type istioEncoder struct {
	gws gatewayIndex
	// policies returns the names of the Authorizations that apply to the
	// workload uid beyond the global and namespace ones (Istio's
	// authorization_policies); nil lists none.
	policies func(uid string) []string
}

// address returns the Istio resource name and form of Isthmus's Address a
// (named name), or nil when Istio's type has no equivalent (a split-horizon
// workload of a network without a gateway, which the builder never makes).
func (e istioEncoder) address(name string, a *workloadv1.Address) (string, *workloadapi.Address) {
	if s := a.GetService(); s != nil {
		return name, &workloadapi.Address{Type: &workloadapi.Address_Service{Service: istioService(s)}}
	}
	w := a.GetWorkload()
	if strings.HasPrefix(w.GetUid(), workloadv1.SplitHorizonUIDPrefix) {
		gws := e.gws[model.Network(w.GetNetwork())]
		if len(gws) == 0 {
			return "", nil
		}
		out := e.splitWorkload(w, gws[0])
		return out.Uid, &workloadapi.Address{Type: &workloadapi.Address_Workload{Workload: out}}
	}
	out := e.workload(w)
	return out.Uid, &workloadapi.Address{Type: &workloadapi.Address_Workload{Workload: out}}
}

// workload translates a workload of the registry.
func (e istioEncoder) workload(w *workloadv1.Workload) *workloadapi.Workload {
	out := &workloadapi.Workload{
		Uid:               IstioWorkloadUID(w.GetUid()),
		Name:              w.GetName(),
		Namespace:         w.GetNamespace(),
		Addresses:         w.GetAddresses(),
		Network:           w.GetNetwork(),
		TunnelProtocol:    istioTunnel(w.GetTunnelProtocol()),
		TrustDomain:       w.GetTrustDomain(),
		ServiceAccount:    w.GetServiceAccount(),
		Node:              w.GetNode(),
		CanonicalName:     w.GetCanonicalName(),
		CanonicalRevision: w.GetCanonicalRevision(),
		WorkloadType:      workloadapi.WorkloadType_POD,
		WorkloadName:      w.GetWorkloadName(),
		Services:          istioPortLists(w.GetServices()),
		Status:            istioStatus(w.GetStatus()),
		ClusterId:         w.GetClusterId(),
		Locality:          istioLocality(w.GetLocality()),
	}
	if w.GetHostNetwork() {
		out.NetworkMode = workloadapi.NetworkMode_HOST_NETWORK
	}
	if e.policies != nil {
		out.AuthorizationPolicies = e.policies(w.GetUid())
	}
	return out
}

// splitWorkload translates a split-horizon workload, reached through gw
// (Istio's workload names one gateway: the first trusted one by key, the
// first Isthmus's lists).
func (e istioEncoder) splitWorkload(w *workloadv1.Workload, gw model.NetworkGateway) *workloadapi.Workload {
	host := w.GetName()
	uid := IstioSplitHorizonUID(gw, w.GetNamespace(), host)
	ga := &workloadapi.GatewayAddress{HboneMtlsPort: uint32(cmp.Or(gw.HBONEPort, model.HBONEPort))}
	if gw.Address.IsValid() {
		ga.Destination = &workloadapi.GatewayAddress_Address{Address: &workloadapi.NetworkAddress{Network: string(gw.Network), Address: addrBytes(gw.Address)}}
	} else {
		ga.Destination = &workloadapi.GatewayAddress_Hostname{Hostname: &workloadapi.NamespacedHostname{Namespace: gw.Namespace(), Hostname: gw.Hostname}}
	}
	return &workloadapi.Workload{
		Uid:            uid,
		Name:           uid,
		Namespace:      w.GetNamespace(),
		Network:        w.GetNetwork(),
		TrustDomain:    w.GetTrustDomain(),
		TunnelProtocol: workloadapi.TunnelProtocol_HBONE,
		WorkloadType:   workloadapi.WorkloadType_POD,
		NetworkGateway: ga,
		ClusterId:      string(gw.Cluster),
		Services:       istioPortLists(w.GetServices()),
		Status:         istioStatus(w.GetStatus()),
		Capacity:       wrapperspb.UInt32(w.GetCapacity()),
	}
}

func istioService(s *workloadv1.Service) *workloadapi.Service {
	out := &workloadapi.Service{
		Name:            s.GetName(),
		Namespace:       s.GetNamespace(),
		Hostname:        s.GetHostname(),
		SubjectAltNames: s.GetSubjectAltNames(),
	}
	for _, a := range s.GetAddresses() {
		out.Addresses = append(out.Addresses, &workloadapi.NetworkAddress{Network: a.GetNetwork(), Address: a.GetAddress()})
	}
	for _, p := range s.GetPorts() {
		out.Ports = append(out.Ports, &workloadapi.Port{ServicePort: p.GetServicePort(), TargetPort: p.GetTargetPort(), AppProtocol: istioAppProtocol(p.GetAppProtocol())})
	}
	if lb := s.GetLoadBalancing(); lb != nil {
		out.LoadBalancing = &workloadapi.LoadBalancing{Mode: workloadapi.LoadBalancing_Mode(lb.GetMode())}
		for _, sc := range lb.GetRoutingPreference() {
			// The two enums number their scopes alike (pinned by a test).
			out.LoadBalancing.RoutingPreference = append(out.LoadBalancing.RoutingPreference, workloadapi.LoadBalancing_Scope(sc))
		}
	}
	return out
}

func istioPortLists(in map[string]*workloadv1.PortList) map[string]*workloadapi.PortList {
	if len(in) == 0 {
		return nil
	}
	out := make(map[string]*workloadapi.PortList, len(in))
	for k, pl := range in {
		l := &workloadapi.PortList{Ports: make([]*workloadapi.Port, 0, len(pl.GetPorts()))}
		for _, p := range pl.GetPorts() {
			l.Ports = append(l.Ports, &workloadapi.Port{ServicePort: p.GetServicePort(), TargetPort: p.GetTargetPort()})
		}
		out[k] = l
	}
	return out
}

func istioLocality(l *workloadv1.Locality) *workloadapi.Locality {
	if l == nil {
		return nil
	}
	return &workloadapi.Locality{Region: l.GetRegion(), Zone: l.GetZone(), Subzone: l.GetSubzone()}
}

func istioTunnel(t workloadv1.TunnelProtocol) workloadapi.TunnelProtocol {
	if t == workloadv1.TunnelProtocol_HBONE {
		return workloadapi.TunnelProtocol_HBONE
	}
	return workloadapi.TunnelProtocol_NONE
}

func istioStatus(s workloadv1.WorkloadStatus) workloadapi.WorkloadStatus {
	if s == workloadv1.WorkloadStatus_UNHEALTHY {
		return workloadapi.WorkloadStatus_UNHEALTHY
	}
	return workloadapi.WorkloadStatus_HEALTHY
}

// istioAppProtocol maps a Service port's appProtocol to Istio's enum
// (UNKNOWN for anything it does not name).
func istioAppProtocol(p string) workloadapi.AppProtocol {
	switch strings.ToLower(p) {
	case "http", "http1", "http/1.1":
		return workloadapi.AppProtocol_HTTP11
	case "http2", "h2c", "kubernetes.io/h2c":
		return workloadapi.AppProtocol_HTTP2
	case "grpc":
		return workloadapi.AppProtocol_GRPC
	case "tcp":
		return workloadapi.AppProtocol_TCP
	case "tls", "https":
		return workloadapi.AppProtocol_TLS
	}
	return workloadapi.AppProtocol_UNKNOWN
}
