// Package mcs writes MCS API ServiceImports (sigs.k8s.io/mcs-api, v1beta1)
// for the federation's exported services: one per exported service in every
// cluster where its namespace exists, with the type, the ports and the
// allocated clusterset IP, removed when no cluster exports the service any
// more. Conflicting exports are settled by the KEP's rules (the oldest
// export wins; ports are the union by name) and reported as a Conflict
// condition on the ServiceImport and through Writer.Conflicts for the
// ServiceExports. Beside each ServiceImport it keeps the imported
// EndpointSlices of the exporting clusters (slices.go says which
// endpoints).
package mcs

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	mcsv1beta1 "sigs.k8s.io/mcs-api/pkg/apis/v1beta1"
)

// Port is one service port as exported.
type Port struct {
	Name        string
	Protocol    corev1.Protocol // "" is TCP
	AppProtocol string
	Port        int32
}

func (p Port) protocol() corev1.Protocol { return cmp.Or(p.Protocol, corev1.ProtocolTCP) }

func (p Port) String() string {
	s := fmt.Sprintf("%s %d/%s", cmp.Or(p.Name, `""`), p.Port, p.protocol())
	if p.AppProtocol != "" {
		s += " (" + p.AppProtocol + ")"
	}
	return s
}

// ClusterExport is one cluster's export of a service: its Service's type
// and ports, when its ServiceExport was created, and its endpoints (for the
// imported EndpointSlices).
type ClusterExport struct {
	Cluster   string
	Created   time.Time
	Headless  bool
	Ports     []Port
	Endpoints []Endpoint
}

// Endpoint is one endpoint of an exporting cluster's service.
type Endpoint struct {
	// Addresses are the endpoint's (pod) addresses, at most one per family
	// is used.
	Addresses []netip.Addr
	// Network is the network the addresses are reachable on: imported
	// EndpointSlices carry the endpoint only in clusters of that network.
	Network string
	// Zone is the endpoint's zone ("" when unknown).
	Zone string
	// Ready, Serving and Terminating are the EndpointSlice conditions.
	Ready, Serving, Terminating bool
	// Ports are the ports the endpoint serves: the service port's name,
	// protocol and app protocol with the endpoint's target port number.
	Ports []Port
}

// Service is an exported service of the federation: the input of the
// writer.
type Service struct {
	Namespace string
	Name      string
	// IPs are the clusterset addresses allocated to it (at most one per
	// family); unused for a headless service.
	IPs []netip.Addr
	// Exports lists the clusters that export it; a Service with none has
	// no ServiceImport.
	Exports []ClusterExport
}

// Conflict reasons, as the MCS API names them on ServiceExports.
const (
	ReasonPortConflict = string(mcsv1beta1.ServiceExportReasonPortConflict)
	ReasonTypeConflict = string(mcsv1beta1.ServiceExportReasonTypeConflict)
	ReasonNoConflicts  = string(mcsv1beta1.ServiceExportReasonNoConflicts)
)

// Conflict is a property on which exporting clusters disagree; the oldest
// export's definition is used.
type Conflict struct {
	// Reason is ReasonPortConflict or ReasonTypeConflict.
	Reason string
	// Message says what differs and what was used.
	Message string
	// Clusters are the clusters whose definition was overruled.
	Clusters []string
}

// Import is the merged form of a Service: what its ServiceImports carry.
type Import struct {
	Namespace, Name string
	Type            mcsv1beta1.ServiceImportType
	Ports           []Port
	IPs             []netip.Addr
	// Clusters are the exporting clusters, sorted.
	Clusters  []string
	Conflicts []Conflict
	// Endpoints are each exporting cluster's endpoints.
	Endpoints map[string][]Endpoint
}

// Merge applies the MCS KEP's conflict rules to the exports of s: exports
// are ranked by ServiceExport age (the oldest first, ties by cluster
// name); the oldest export's type wins; ports are the union by name, and a
// name (or a port number and protocol) defined differently by two exports
// keeps the older definition. Every overruled definition is a Conflict.
func Merge(s Service) Import {
	exps := slices.Clone(s.Exports)
	slices.SortFunc(exps, func(a, b ClusterExport) int {
		return cmp.Or(a.Created.Compare(b.Created), cmp.Compare(a.Cluster, b.Cluster))
	})
	imp := Import{Namespace: s.Namespace, Name: s.Name, Type: mcsv1beta1.ClusterSetIP}
	if len(exps) == 0 {
		return imp
	}
	oldest := exps[0]
	if oldest.Headless {
		imp.Type = mcsv1beta1.Headless
	}
	var typeLosers, portLosers []string
	var portMsgs []string
	byName := map[string]Port{}
	byNumber := map[string]Port{} // "<port>/<protocol>"
	for _, e := range exps {
		imp.Clusters = append(imp.Clusters, e.Cluster)
		if len(e.Endpoints) > 0 {
			if imp.Endpoints == nil {
				imp.Endpoints = map[string][]Endpoint{}
			}
			imp.Endpoints[e.Cluster] = e.Endpoints
		}
		if e.Headless != oldest.Headless {
			typeLosers = append(typeLosers, e.Cluster)
		}
		lost := false
		for _, p := range e.Ports {
			num := fmt.Sprintf("%d/%s", p.Port, p.protocol())
			if q, ok := byName[p.Name]; ok {
				if !samePort(p, q) {
					portMsgs = append(portMsgs, fmt.Sprintf("port %s in cluster %s differs from %s, used", p, e.Cluster, q))
					lost = true
				}
				continue
			}
			if q, ok := byNumber[num]; ok {
				portMsgs = append(portMsgs, fmt.Sprintf("port %s in cluster %s clashes with %s, used", p, e.Cluster, q))
				lost = true
				continue
			}
			byName[p.Name], byNumber[num] = p, p
			imp.Ports = append(imp.Ports, p)
		}
		if lost {
			portLosers = append(portLosers, e.Cluster)
		}
	}
	slices.Sort(imp.Clusters)
	slices.SortFunc(imp.Ports, func(a, b Port) int { return cmp.Or(cmp.Compare(a.Port, b.Port), cmp.Compare(a.Name, b.Name)) })
	if imp.Type == mcsv1beta1.ClusterSetIP {
		imp.IPs = clusterSetIPs(s.IPs)
	}
	if len(typeLosers) > 0 {
		imp.Conflicts = append(imp.Conflicts, Conflict{Reason: ReasonTypeConflict, Clusters: typeLosers,
			Message: fmt.Sprintf("type %s of the oldest export (cluster %s) used; clusters %s export another type",
				imp.Type, oldest.Cluster, strings.Join(typeLosers, ", "))})
	}
	if len(portMsgs) > 0 {
		imp.Conflicts = append(imp.Conflicts, Conflict{Reason: ReasonPortConflict, Clusters: portLosers,
			Message: strings.Join(portMsgs, "; ")})
	}
	return imp
}

func samePort(a, b Port) bool {
	return a.Port == b.Port && a.protocol() == b.protocol() && a.AppProtocol == b.AppProtocol
}

// clusterSetIPs keeps one valid address per family, IPv4 first.
func clusterSetIPs(ips []netip.Addr) []netip.Addr {
	var v4, v6 netip.Addr
	for _, a := range ips {
		a = a.Unmap()
		switch {
		case a.Is4() && !v4.IsValid():
			v4 = a
		case a.Is6() && !v6.IsValid():
			v6 = a
		}
	}
	var out []netip.Addr
	for _, a := range []netip.Addr{v4, v6} {
		if a.IsValid() {
			out = append(out, a)
		}
	}
	return out
}
