package endpoints_test

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/xds"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// The oracle: what pilot should serve, computed afresh from listing the
// clusters' objects with the documented rules (docs/architecture.md),
// written independently of the controller and registry code.

// endpoint is what the test compares of one endpoint.
type endpoint struct {
	Cluster, UID, Addr string
	Ready, Terminating bool
	Identity, Node     string // identity: namespace/service account
	Locality           string
	Ports              string // service port:target port,...
	created            int64
	services           []string // hostnames the workload is bound to
	pod                bool     // a pod's (else a slice address's)
	claims             bool     // it claims its address (not a hostNetwork pod)
}

func (e endpoint) String() string {
	return fmt.Sprintf("%s %s %s ready=%v term=%v %s node=%s loc=%s ports=%s", e.Cluster, e.UID, e.Addr, e.Ready, e.Terminating,
		e.Identity, e.Node, e.Locality, e.Ports)
}

// world is the expected state of the test's namespaces.
type world struct {
	// endpoints of each service hostname, per cluster that defines it,
	// rendered and sorted.
	endpoints map[string]map[model.ClusterID][]string
	// eds is each load assignment's endpoints, "locality|addr:port|health",
	// sorted.
	eds map[string][]string
	// owners are the workloads served for their addresses: "uid status
	// identity services".
	owners []string
	raw    map[string]map[model.ClusterID][]endpoint
	// pods are the claims of every pod, services or not.
	pods []endpoint
	// ports are the service ports of each hostname.
	ports map[string][]int32
}

// clusterObjects are one cluster's objects in the test's namespaces.
type clusterObjects struct {
	id       model.ClusterID
	nodes    map[string]string // name -> locality
	pods     []corev1.Pod
	services []corev1.Service
	slices   []discoveryv1.EndpointSlice
}

func list(ctx context.Context, c *framework.Cluster, namespaces []string) (*clusterObjects, error) {
	out := &clusterObjects{id: model.ClusterID(c.Name), nodes: map[string]string{}}
	nodes, err := c.Client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	for _, n := range nodes.Items {
		out.nodes[n.Name] = model.Locality{Region: n.Labels[corev1.LabelTopologyRegion], Zone: n.Labels[corev1.LabelTopologyZone]}.String()
	}
	for _, ns := range namespaces {
		pods, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return nil, err
		}
		svcs, err := c.Client.CoreV1().Services(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return nil, err
		}
		sls, err := c.Client.DiscoveryV1().EndpointSlices(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return nil, err
		}
		out.pods, out.services, out.slices = append(out.pods, pods.Items...), append(out.services, svcs.Items...), append(out.slices, sls.Items...)
	}
	return out, nil
}

// expect lists the objects of namespaces in every cluster and derives the
// expected state.
func expect(ctx context.Context, namespaces []string) (*world, error) {
	w := &world{raw: map[string]map[model.ClusterID][]endpoint{}, ports: map[string][]int32{}}
	for _, c := range clusters.Clusters {
		objs, err := list(ctx, c, namespaces)
		if err != nil {
			return nil, fmt.Errorf("list %s: %w", c.Name, err)
		}
		for _, s := range objs.services {
			host := model.Hostname(s.Name, s.Namespace, "")
			if w.raw[host] == nil {
				w.raw[host] = map[model.ClusterID][]endpoint{}
			}
			w.raw[host][objs.id] = objs.endpointsOf(&s)
			for _, sp := range s.Spec.Ports {
				if !slices.Contains(w.ports[host], sp.Port) {
					w.ports[host] = append(w.ports[host], sp.Port)
				}
			}
		}
		for i := range objs.pods {
			if p := &objs.pods[i]; p.Status.PodIP != "" {
				e := objs.podEndpoint(p, "")
				e.services = objs.podServices(p)
				w.pods = append(w.pods, e)
			}
		}
	}
	w.resolve()
	return w, nil
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue && p.DeletionTimestamp == nil
		}
	}
	return false
}

func saOf(p *corev1.Pod) string {
	return p.Namespace + "/" + cmp.Or(p.Spec.ServiceAccountName, "default")
}

// endpointsOf returns the endpoints cluster o gives service s.
func (o *clusterObjects) endpointsOf(s *corev1.Service) []endpoint {
	var out []endpoint
	if s.Spec.Selector != nil {
		sel := labels.SelectorFromSet(s.Spec.Selector)
		if sel.Empty() {
			return nil
		}
		for i := range o.pods {
			p := &o.pods[i]
			if p.Namespace != s.Namespace || p.Status.PodIP == "" || !sel.Matches(labels.Set(p.Labels)) {
				continue
			}
			var ports []string
			for _, sp := range s.Spec.Ports {
				ports = append(ports, fmt.Sprintf("%d:%d", sp.Port, sp.TargetPort.IntVal))
			}
			out = append(out, o.podEndpoint(p, strings.Join(ports, ",")))
		}
		return out
	}
	// Selector-less: every slice address, one endpoint per address (a
	// ready listing first, else the first slice by name).
	var sls []*discoveryv1.EndpointSlice
	for i := range o.slices {
		if sl := &o.slices[i]; sl.Namespace == s.Namespace && sl.Labels[discoveryv1.LabelServiceName] == s.Name {
			sls = append(sls, sl)
		}
	}
	slices.SortFunc(sls, func(a, b *discoveryv1.EndpointSlice) int { return strings.Compare(a.Name, b.Name) })
	byAddr := map[string]endpoint{}
	for _, sl := range sls {
		ports := slicePorts(s, sl)
		for _, ep := range sl.Endpoints {
			for _, a := range ep.Addresses {
				e := o.sliceEndpoint(s, sl, ep, a, ports)
				if prev, ok := byAddr[e.Addr]; !ok || (!prev.Ready && e.Ready) {
					byAddr[e.Addr] = e
				}
			}
		}
	}
	for _, e := range byAddr {
		out = append(out, e)
	}
	return out
}

func (o *clusterObjects) podEndpoint(p *corev1.Pod, ports string) endpoint {
	return endpoint{Cluster: string(o.id), UID: model.WorkloadUID(o.id, p.Namespace, p.Name), Addr: p.Status.PodIP,
		Ready: podReady(p), Terminating: p.DeletionTimestamp != nil, Identity: saOf(p), Node: p.Spec.NodeName,
		Locality: o.nodes[p.Spec.NodeName], Ports: ports, created: p.CreationTimestamp.Unix(), pod: true, claims: !p.Spec.HostNetwork}
}

// podServices returns the hostnames of the services pod p backs: those
// selecting it, and the selector-less ones whose slices name it at its
// address.
func (o *clusterObjects) podServices(p *corev1.Pod) []string {
	var out []string
	for _, s := range o.services {
		if s.Namespace != p.Namespace {
			continue
		}
		host := model.Hostname(s.Name, s.Namespace, "")
		if s.Spec.Selector != nil {
			if sel := labels.SelectorFromSet(s.Spec.Selector); !sel.Empty() && sel.Matches(labels.Set(p.Labels)) {
				out = append(out, host)
			}
			continue
		}
		for _, sl := range o.slices {
			if sl.Namespace != s.Namespace || sl.Labels[discoveryv1.LabelServiceName] != s.Name || p.Spec.HostNetwork {
				continue
			}
			for _, ep := range sl.Endpoints {
				if r := ep.TargetRef; r != nil && r.Kind == "Pod" && r.Name == p.Name && (r.Namespace == "" || r.Namespace == p.Namespace) &&
					slices.Contains(ep.Addresses, p.Status.PodIP) && !slices.Contains(out, host) {
					out = append(out, host)
				}
			}
		}
	}
	slices.Sort(out)
	return out
}

func slicePorts(s *corev1.Service, sl *discoveryv1.EndpointSlice) string {
	var ports []string
	for _, sp := range s.Spec.Ports {
		for _, p := range sl.Ports {
			if p.Port != nil && cmp.Or(ptrValue(p.Name), "") == sp.Name {
				ports = append(ports, fmt.Sprintf("%d:%d", sp.Port, *p.Port))
				break
			}
		}
	}
	return strings.Join(ports, ",")
}

func ptrValue[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}

// sliceEndpoint applies the rule: readiness from the slice's conditions;
// identity and placement from the pod the targetRef names in the slice's
// namespace, if it has the address and is no hostNetwork pod.
func (o *clusterObjects) sliceEndpoint(s *corev1.Service, sl *discoveryv1.EndpointSlice, ep discoveryv1.Endpoint, addr, ports string) endpoint {
	c := ep.Conditions
	term := ptrValue(c.Terminating)
	ready := true
	switch {
	case c.Ready != nil:
		ready = *c.Ready
	case c.Serving != nil:
		ready = *c.Serving
	}
	e := endpoint{Cluster: string(o.id), UID: model.SliceWorkloadPrefix(o.id, model.ServiceKey{Namespace: s.Namespace, Name: s.Name}) + addr,
		Addr: addr, Ready: ready && !term, Terminating: term, Identity: s.Namespace + "/default", Node: ptrValue(ep.NodeName),
		Ports: ports, created: sl.CreationTimestamp.Unix(), claims: true, services: []string{model.Hostname(s.Name, s.Namespace, "")}}
	e.Locality = o.nodes[e.Node]
	if r := ep.TargetRef; r != nil && r.Kind == "Pod" && (r.Namespace == "" || r.Namespace == sl.Namespace) {
		for i := range o.pods {
			if p := &o.pods[i]; p.Namespace == sl.Namespace && p.Name == r.Name && p.Status.PodIP == addr && !p.Spec.HostNetwork {
				e.Identity, e.Node, e.Locality = saOf(p), p.Spec.NodeName, o.nodes[p.Spec.NodeName]
			}
		}
	}
	return e
}

// resolve applies one owner per address: pods before slice addresses, then
// the oldest, then the smallest UID; it drops slice addresses owned by a
// pod of another namespace and renders the expectations.
func (w *world) resolve() {
	claims := map[string][]endpoint{}
	for _, e := range w.pods {
		if e.claims {
			claims[e.Addr] = append(claims[e.Addr], e)
		}
	}
	for _, byCluster := range w.raw {
		for _, eps := range byCluster {
			for _, e := range eps {
				if !e.pod {
					claims[e.Addr] = append(claims[e.Addr], e)
				}
			}
		}
	}
	owner := map[string]endpoint{}
	for addr, cs := range claims {
		owner[addr] = slices.MinFunc(cs, func(a, b endpoint) int {
			if a.pod != b.pod {
				if a.pod {
					return -1
				}
				return 1
			}
			return cmp.Or(cmp.Compare(a.created, b.created), strings.Compare(a.UID, b.UID))
		})
		o := owner[addr]
		status := "HEALTHY"
		if !o.Ready {
			status = "UNHEALTHY"
		}
		w.owners = append(w.owners, o.UID+" "+status+" "+o.Identity+" "+strings.Join(o.services, ","))
	}
	slices.Sort(w.owners)
	w.endpoints = map[string]map[model.ClusterID][]string{}
	w.eds = map[string][]string{}
	for host, byCluster := range w.raw {
		w.endpoints[host] = map[model.ClusterID][]string{}
		edsPorts := map[string][]string{}
		for _, p := range w.ports[host] {
			edsPorts[xds.ClusterName(host, uint16(p))] = []string{}
		}
		for cl, eps := range byCluster {
			rendered := []string{}
			for _, e := range eps {
				ns := strings.Split(e.UID, "/")[1]
				if o := owner[e.Addr]; !e.pod && o.pod && strings.Split(o.UID, "/")[1] != ns {
					continue // a slice may not list another namespace's pod
				}
				rendered = append(rendered, e.String())
				for _, m := range strings.Split(e.Ports, ",") {
					if m == "" {
						continue
					}
					sp, tp, _ := strings.Cut(m, ":")
					health := "HEALTHY"
					switch {
					case e.Terminating:
						health = "DRAINING"
					case !e.Ready:
						health = "UNHEALTHY"
					}
					port, _ := strconv.Atoi(sp)
					name := xds.ClusterName(host, uint16(port))
					edsPorts[name] = append(edsPorts[name], e.Locality+"|"+e.Addr+":"+tp+"|"+health)
				}
			}
			slices.Sort(rendered)
			w.endpoints[host][cl] = rendered
		}
		for name, eps := range edsPorts {
			slices.Sort(eps)
			w.eds[name] = eps
		}
	}
}

func itoa(v uint32) string { return strconv.FormatUint(uint64(v), 10) }

func ipString(b []byte) string {
	a, ok := netip.AddrFromSlice(b)
	if !ok {
		return fmt.Sprintf("bad address %x", b)
	}
	return a.Unmap().String()
}

// inNamespaces reports whether hostname or workload UID s belongs to one
// of namespaces.
func inNamespaces(s string, namespaces []string) bool {
	for _, ns := range namespaces {
		if strings.Contains(s, "/"+ns+"/") || strings.Contains(s, "."+ns+".svc.") {
			return true
		}
	}
	return false
}

// compare asserts that pilot's registry, its EDS client and its workload
// client hold exactly what w expects for namespaces, and that no two
// workloads served carry one address.
func (p *pilot) compare(c *assert.CollectT, w *world, namespaces []string) {
	got := map[string]map[model.ClusterID][]string{}
	for _, s := range p.Registry.Services() {
		if !inNamespaces(s.Hostname, namespaces) {
			continue
		}
		got[s.Hostname] = map[model.ClusterID][]string{}
		for _, cl := range s.Clusters {
			rendered := []string{}
			for _, e := range s.Shards[cl] {
				var ports []string
				for _, m := range e.Ports {
					ports = append(ports, fmt.Sprintf("%d:%d", m.ServicePort, m.TargetPort))
				}
				rendered = append(rendered, endpoint{Cluster: string(cl), UID: e.WorkloadUID(), Addr: e.Address().String(), Ready: e.Ready(),
					Terminating: e.Terminating(), Identity: e.Namespace() + "/" + e.ServiceAccount(), Node: e.Node(),
					Locality: e.Locality().String(), Ports: strings.Join(ports, ",")}.String())
			}
			slices.Sort(rendered)
			got[s.Hostname][cl] = rendered
		}
	}
	require.ElementsMatch(c, slices.Collect(maps.Keys(w.endpoints)), slices.Collect(maps.Keys(got)), "registry services")
	for host, want := range w.endpoints {
		assert.Equal(c, want, got[host], "registry endpoints of %s", host)
	}

	eds := map[string][]string{}
	for name, cla := range p.loadAssignments(c) {
		if !inNamespaces(name, namespaces) {
			continue
		}
		eps := []string{}
		for _, l := range cla.GetEndpoints() {
			loc := model.Locality{Region: l.GetLocality().GetRegion(), Zone: l.GetLocality().GetZone(), Subzone: l.GetLocality().GetSubZone()}.String()
			for _, e := range l.GetLbEndpoints() {
				sa := e.GetEndpoint().GetAddress().GetSocketAddress()
				eps = append(eps, loc+"|"+sa.GetAddress()+":"+itoa(sa.GetPortValue())+"|"+e.GetHealthStatus().String())
			}
		}
		slices.Sort(eps)
		eds[name] = eps
	}
	require.ElementsMatch(c, slices.Collect(maps.Keys(w.eds)), slices.Collect(maps.Keys(eds)), "EDS load assignments")
	for name, want := range w.eds {
		assert.Equal(c, want, eds[name], "EDS %s", name)
	}

	owners := []string{}
	byAddr := map[string]string{}
	for name, wl := range p.workloads(c) {
		for _, a := range wl.GetAddresses() {
			if other, dup := byAddr[ipString(a)]; dup {
				require.Failf(c, "two workloads served for one address", "%s: %s and %s", ipString(a), other, name)
			}
			byAddr[ipString(a)] = name
		}
		if inNamespaces(name, namespaces) {
			var hosts []string
			for key := range wl.GetServices() {
				_, host, _ := strings.Cut(key, "/")
				hosts = append(hosts, host)
			}
			slices.Sort(hosts)
			owners = append(owners, name+" "+wl.GetStatus().String()+" "+wl.GetNamespace()+"/"+wl.GetServiceAccount()+" "+strings.Join(hosts, ","))
		}
	}
	slices.Sort(owners)
	require.Equal(c, w.owners, owners, "workloads served")
}
