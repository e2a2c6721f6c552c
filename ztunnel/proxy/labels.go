package proxy

import (
	"slices"
	"strings"

	"github.com/isthmus-mesh/isthmus/ztunnel/hbone"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// Telemetry labels come from the store's workloads and services, or from
// a verified identity; never from request data. These helpers fill them.

// withSource fills the source side of l from workload w.
func withSource(l metrics.ConnLabels, w *state.Workload) metrics.ConnLabels {
	l.SourcePrincipal = w.Identity().String()
	l.SourceCluster, l.SourceNetwork = w.Cluster, w.Network
	l.SourceWorkload, l.SourceNamespace = w.WorkloadName, w.Namespace
	l.SourceCanonicalService, l.SourceCanonicalRevision = w.CanonicalName, w.CanonicalRevision
	return l
}

// withDestination fills the destination side of l from workload w.
func withDestination(l metrics.ConnLabels, w *state.Workload) metrics.ConnLabels {
	l.DestinationPrincipal = w.Identity().String()
	l.DestinationCluster, l.DestinationNetwork = w.Cluster, w.Network
	if !w.Synthetic() {
		l.DestinationWorkload, l.DestinationNamespace = w.WorkloadName, w.Namespace
		l.DestinationCanonicalService, l.DestinationCanonicalRevision = w.CanonicalName, w.CanonicalRevision
	}
	return l
}

// withService fills the destination service of l.
func withService(l metrics.ConnLabels, svc *state.Service) metrics.ConnLabels {
	if svc != nil {
		l.DestinationService, l.DestinationServiceName, l.DestinationServiceNamespace = svc.Hostname, svc.Name, svc.Namespace
	}
	return l
}

// serviceServing returns the service of w (in snap) whose port maps to
// target port p on w: the service an inbound connection most likely
// addressed (the first by key when several do), or nil.
func serviceServing(snap *state.Snapshot, w *state.Workload, p uint16) *state.Service {
	keys := make([]string, 0, len(w.Services))
	for k, pm := range w.Services {
		for sp, tp := range pm {
			if tp == p || (tp == 0 && sp == p) {
				keys = append(keys, k)
				break
			}
		}
	}
	slices.Sort(keys)
	for _, k := range keys {
		_, host, _ := strings.Cut(k, "/")
		if svc, ok := snap.ServiceByHostname(host); ok {
			return svc
		}
	}
	return nil
}

// inboundSource fills the source side of an inbound connection's labels:
// from the source workload when its address can be trusted (sourceIP: a
// workload running as the verified peer identity); otherwise from the
// identity alone, and the cluster and network the baggage names when the
// store knows them.
func inboundSource(l metrics.ConnLabels, snap *state.Snapshot, req *hbone.Request) metrics.ConnLabels {
	if a := sourceIP(snap, req); a.IsValid() {
		if w, ok := snap.WorkloadByAddr(a); ok {
			return withSource(l, w)
		}
	}
	l.SourcePrincipal, l.SourceNamespace = req.Peer.String(), req.Peer.Namespace
	l.SourceCluster, l.SourceNetwork = sourcePlace(snap, req.Header)
	return l
}
