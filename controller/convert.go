package controller

import (
	"maps"
	"net/netip"
	"slices"
	"strings"
	"unique"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// Well-known labels.
const (
	// NetworkLabel names a pod's, namespace's or gateway Service's network.
	NetworkLabel = "topology.istio.io/network"
	// SubzoneLabel is the node label of the subzone.
	SubzoneLabel = "topology.istio.io/subzone"
)

// intern returns the canonical copy of s, so that repeated strings (label
// keys and values, namespaces, nodes, service accounts) are stored once.
func intern(s string) string {
	if s == "" {
		return ""
	}
	return unique.Make(s).Value()
}

func internMap(m map[string]string) map[string]string {
	if len(m) == 0 {
		return nil
	}
	out := make(map[string]string, len(m))
	for k, v := range m {
		out[intern(k)] = intern(v)
	}
	return out
}

// podInfo is what discovery keeps of a Pod: nothing else of it is cached.
type podInfo struct {
	name, ns    string
	labels      map[string]string
	sa, node    string
	ips         []netip.Addr
	ready       bool
	terminating bool
	hostNetwork bool
	// created is the creation time in Unix seconds (to 2106): in four
	// bytes beside the flags, a podInfo stays 128 bytes.
	created uint32
	ports   []namedPort // named container ports, for named target ports
}

type namedPort struct {
	name string
	port uint16
}

func (p *podInfo) equal(o *podInfo) bool {
	return o != nil && p.name == o.name && p.ns == o.ns && maps.Equal(p.labels, o.labels) && p.sa == o.sa && p.node == o.node &&
		slices.Equal(p.ips, o.ips) && p.ready == o.ready && p.terminating == o.terminating && p.hostNetwork == o.hostNetwork && slices.Equal(p.ports, o.ports) &&
		p.created == o.created
}

func (p *podInfo) namedPort(name string) (uint16, bool) {
	for _, np := range p.ports {
		if np.name == name {
			return np.port, true
		}
	}
	return 0, false
}

func convertPod(pod *corev1.Pod) *podInfo {
	p := &podInfo{
		name: pod.Name, ns: intern(pod.Namespace), labels: pod.Labels, // interned by the view
		sa: intern(pod.Spec.ServiceAccountName), node: intern(pod.Spec.NodeName),
		terminating: pod.DeletionTimestamp != nil, hostNetwork: pod.Spec.HostNetwork, created: uint32(max(pod.CreationTimestamp.Unix(), 0)),
	}
	if p.sa == "" {
		p.sa = "default"
	}
	for _, ip := range pod.Status.PodIPs {
		if a, err := netip.ParseAddr(ip.IP); err == nil {
			p.ips = append(p.ips, a)
		}
	}
	if len(p.ips) == 0 && pod.Status.PodIP != "" {
		if a, err := netip.ParseAddr(pod.Status.PodIP); err == nil {
			p.ips = append(p.ips, a)
		}
	}
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			p.ready = c.Status == corev1.ConditionTrue
		}
	}
	if pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed {
		p.ready = false
		p.ips = nil
	}
	for _, c := range pod.Spec.Containers {
		for _, cp := range c.Ports {
			if cp.Name != "" {
				p.ports = append(p.ports, namedPort{intern(cp.Name), uint16(cp.ContainerPort)})
			}
		}
	}
	return p
}

// svcInfo is what discovery keeps of a Service.
type svcInfo struct {
	cs       *model.ClusterService
	selector labels.Selector // nil: selector-less
	gateway  *model.NetworkGateway
	// labels are the Service labels its scope reads (Scoper.ServiceLabels).
	labels map[string]string
	// ownLB is the routing preference the Service itself sets (nil: none;
	// LoadBalancingOf), ownLBErr why an annotation of it was ignored.
	ownLB    *model.LoadBalancing
	ownLBErr string
}

// with returns a copy of s with cs.
func (s *svcInfo) with(cs *model.ClusterService) *svcInfo {
	c := *s
	c.cs = cs
	return &c
}

// loadBalancing returns the Service's routing preference and why an
// annotation was ignored: its own (ownLB), else its namespace ns's Istio
// annotation (nsDistribution), Istio's third source: ServiceLoadBalancing
// from what discovery keeps.
func (s *svcInfo) loadBalancing(nsDistribution map[string]string, ns string) (*model.LoadBalancing, string) {
	if s.ownLB != nil {
		return s.ownLB, s.ownLBErr
	}
	v, ok := nsDistribution[ns]
	if !ok {
		return nil, s.ownLBErr
	}
	lb, err := namespaceLoadBalancing(v)
	if err == nil {
		return lb, s.ownLBErr
	}
	if s.ownLBErr != "" {
		return nil, s.ownLBErr + "\n" + err.Error()
	}
	return nil, err.Error()
}

func convertService(cluster model.ClusterID, svc *corev1.Service) *svcInfo {
	cs := &model.ClusterService{
		Cluster: cluster, Name: svc.Name, Namespace: intern(svc.Namespace),
		Headless: svc.Spec.ClusterIP == corev1.ClusterIPNone, Created: svc.CreationTimestamp.Time,
	}
	for _, ip := range svc.Spec.ClusterIPs {
		if a, err := netip.ParseAddr(ip); err == nil {
			cs.VIPs = append(cs.VIPs, a)
		}
	}
	for _, sp := range svc.Spec.Ports {
		p := model.Port{Name: intern(sp.Name), Port: uint16(sp.Port), Protocol: model.Protocol(intern(string(sp.Protocol)))}
		if p.Protocol == "" {
			p.Protocol = model.TCP
		}
		if sp.AppProtocol != nil {
			p.AppProtocol = intern(*sp.AppProtocol)
		}
		switch {
		case sp.TargetPort.StrVal != "":
			p.TargetPortName = intern(sp.TargetPort.StrVal)
		case sp.TargetPort.IntVal != 0:
			p.TargetPort = uint16(sp.TargetPort.IntVal)
		default:
			p.TargetPort = p.Port
		}
		cs.Ports = append(cs.Ports, p)
	}
	info := &svcInfo{cs: cs}
	lb, err := LoadBalancingOf(svc)
	info.ownLB = lb
	if err != nil {
		info.ownLBErr = err.Error()
	}
	cs.LoadBalancing, cs.LoadBalancingError = info.ownLB, info.ownLBErr // the view adds the namespace's
	if svc.Spec.Selector != nil && svc.Spec.Type != corev1.ServiceTypeExternalName {
		cs.Selector = internMap(svc.Spec.Selector)
		if cs.Selector == nil {
			cs.Selector = map[string]string{}
		}
		info.selector = labels.SelectorFromSet(cs.Selector)
	}
	if net := svc.Labels[NetworkLabel]; net != "" {
		info.gateway = gatewayOf(cluster, model.Network(net), svc)
	}
	return info
}

// GatewayCandidate returns the east-west gateway candidate a Service of
// cluster describes: nil unless it is labelled with a network
// (topology.istio.io/network) and has an HBONE port. TrustGateway decides
// whether it is trusted.
func GatewayCandidate(cluster model.ClusterID, svc *corev1.Service) *model.NetworkGateway {
	net := svc.Labels[NetworkLabel]
	if net == "" {
		return nil
	}
	return gatewayOf(cluster, model.Network(net), svc)
}

// gatewayOf returns the east-west gateway candidate a Service labelled with
// a network describes: its HBONE port (15008, or the port named tls-hbone),
// its SNI passthrough port if any (the port named tls or numbered 15443),
// its address (load balancer ingress, else external IP; none yet is
// possible) and the service accounts an operator annotated. nil when it has
// no HBONE port. Whether the candidate is trusted, and the identities of its
// pods, are the view's to decide (gatewayList).
func gatewayOf(cluster model.ClusterID, net model.Network, svc *corev1.Service) *model.NetworkGateway {
	var port uint16
	for _, sp := range svc.Spec.Ports {
		if sp.Port == model.HBONEPort || sp.Name == "tls-hbone" {
			port = uint16(sp.Port)
			break
		}
	}
	if port == 0 {
		return nil
	}
	gw := &model.NetworkGateway{Network: net, Cluster: cluster, HBONEPort: port, Source: svc.Namespace + "/" + svc.Name}
	for _, sp := range svc.Spec.Ports {
		if uint16(sp.Port) != port && (sp.Name == "tls" || sp.Port == model.TLSPassthroughPort && sp.Name != "tls-hbone") {
			gw.TLSPassthroughPort = uint16(sp.Port)
			break
		}
	}
	if v := svc.Annotations[model.GatewayServiceAccountsAnnotation]; v != "" {
		for sa := range strings.SplitSeq(v, ",") {
			if sa = strings.TrimSpace(sa); sa != "" {
				gw.ServiceAccounts = append(gw.ServiceAccounts, sa)
			}
		}
		slices.Sort(gw.ServiceAccounts)
		gw.ServiceAccounts = slices.Compact(gw.ServiceAccounts)
	}
	for _, ing := range svc.Status.LoadBalancer.Ingress {
		if a, err := netip.ParseAddr(ing.IP); err == nil {
			gw.Address = a
			return gw
		}
		if ing.Hostname != "" {
			gw.Hostname = ing.Hostname
			return gw
		}
	}
	for _, ip := range svc.Spec.ExternalIPs {
		if a, err := netip.ParseAddr(ip); err == nil {
			gw.Address = a
			return gw
		}
	}
	return gw
}

func serviceEqual(a, b *svcInfo) bool {
	if a == nil || b == nil {
		return a == b
	}
	x, y := a.cs, b.cs
	return x.Name == y.Name && x.Namespace == y.Namespace && slices.Equal(x.VIPs, y.VIPs) && slices.Equal(x.Ports, y.Ports) &&
		x.Headless == y.Headless && maps.Equal(x.Selector, y.Selector) && (x.Selector == nil) == (y.Selector == nil) &&
		x.Exported == y.Exported && x.ExportCreated.Equal(y.ExportCreated) && x.ScopeLocal == y.ScopeLocal && x.Network == y.Network && x.Created.Equal(y.Created) && gatewayEqual(a.gateway, b.gateway) &&
		x.LoadBalancing.Equal(y.LoadBalancing) && x.LoadBalancingError == y.LoadBalancingError
}

func gatewayEqual(a, b *model.NetworkGateway) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Equal(*b)
}

func convertNode(n *corev1.Node) model.Locality {
	return model.Locality{
		Region:  intern(n.Labels[corev1.LabelTopologyRegion]),
		Zone:    intern(n.Labels[corev1.LabelTopologyZone]),
		Subzone: intern(n.Labels[SubzoneLabel]),
	}
}

// sliceInfo is what discovery keeps of an EndpointSlice.
type sliceInfo struct {
	name, ns, service string
	created           int64 // creation time, Unix seconds
	ports             []slicePort
	endpoints         []sliceEndpoint
}

type slicePort struct {
	name string
	port uint16
}

// sliceEndpoint is one address of a slice: 40 bytes, of which the node
// and pod names are a shared handle (most addresses of a selector-less
// service name no pod, so all of one node's share one).
type sliceEndpoint struct {
	addr        netip.Addr
	where       unique.Handle[endpointRef]
	ready       bool
	terminating bool
}

// endpointRef is where a slice address is: its node and targetRef pod.
type endpointRef struct {
	node string
	pod  string // targetRef pod name, if it names a pod of the slice's namespace
}

func (e *sliceEndpoint) node() string { return e.where.Value().node }
func (e *sliceEndpoint) pod() string  { return e.where.Value().pod }

func convertSlice(es *discoveryv1.EndpointSlice) *sliceInfo {
	s := &sliceInfo{name: es.Name, ns: intern(es.Namespace), service: es.Labels[discoveryv1.LabelServiceName], created: es.CreationTimestamp.Unix()}
	for _, p := range es.Ports {
		if p.Port == nil {
			continue
		}
		name := ""
		if p.Name != nil {
			name = intern(*p.Name)
		}
		s.ports = append(s.ports, slicePort{name, uint16(*p.Port)})
	}
	n := 0
	for _, ep := range es.Endpoints {
		n += len(ep.Addresses)
	}
	s.endpoints = make([]sliceEndpoint, 0, n) // exact: kept for the slice's lifetime
	for _, ep := range es.Endpoints {
		ready, term := sliceConditions(ep.Conditions)
		node := ""
		if ep.NodeName != nil {
			node = intern(*ep.NodeName)
		}
		pod := ""
		// A targetRef lends the pod's identity to the address, so only a
		// pod of the slice's own namespace may be named.
		if r := ep.TargetRef; r != nil && r.Kind == "Pod" && (r.Namespace == "" || r.Namespace == es.Namespace) {
			pod = r.Name
		}
		where := unique.Make(endpointRef{node, pod})
		for _, a := range ep.Addresses {
			if addr, err := netip.ParseAddr(a); err == nil {
				s.endpoints = append(s.endpoints, sliceEndpoint{addr, where, ready, term})
			}
		}
	}
	return s
}

// sliceConditions maps an endpoint's conditions to readiness as Kubernetes'
// data plane reads them: ready when Ready says so (unset: Serving, else
// ready) and not terminating.
func sliceConditions(c discoveryv1.EndpointConditions) (ready, terminating bool) {
	terminating = c.Terminating != nil && *c.Terminating
	switch {
	case c.Ready != nil:
		ready = *c.Ready
	case c.Serving != nil:
		ready = *c.Serving
	default:
		ready = true
	}
	return ready && !terminating, terminating
}

func (s *sliceInfo) equal(o *sliceInfo) bool {
	return o != nil && s.name == o.name && s.ns == o.ns && s.service == o.service && s.created == o.created &&
		slices.Equal(s.ports, o.ports) && slices.Equal(s.endpoints, o.endpoints)
}

// namesPods reports whether any address of s names a pod.
func (s *sliceInfo) namesPods() bool {
	return s != nil && slices.ContainsFunc(s.endpoints, func(e sliceEndpoint) bool { return e.pod() != "" })
}

// splitKey splits namespace/name.
func splitKey(key string) (ns, name string) {
	ns, name, ok := strings.Cut(key, "/")
	if !ok {
		return "", key
	}
	return ns, name
}
