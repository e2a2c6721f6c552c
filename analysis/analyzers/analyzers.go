// Package analyzers holds the checks of `isthmusctl analyze`, one
// analysis.Analyzer per kind of cross-cluster misconfiguration, each a pure
// function of an analysis.Snapshot.
package analyzers

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/isthmus-mesh/isthmus/analysis"
	"github.com/isthmus-mesh/isthmus/analysis/msg"
)

// All returns every analyzer, in a fixed order.
func All() []analysis.Analyzer {
	return []analysis.Analyzer{
		RemoteClusters{},
		DuplicateClusterIDs{},
		NetworkGateways{},
		GatewayCandidates{},
		ServicePorts{},
		ServiceIdentities{},
		AmbientEnrollment{},
		ServiceExports{},
		ServiceScopes{},
		TrafficDistribution{},
		RootCertificates{},
		Principals{},
		RootPeerAuthentications{},
		DataCompleteness{},
	}
}

// objectResource names a Kubernetes object of kind in cluster.
func objectResource(cluster, kind, ns, name string) msg.Resource {
	return msg.Resource{Cluster: cluster, Kind: kind, Namespace: ns, Name: name}
}

// clusterService is one cluster's Service of a federated service.
type clusterService struct {
	c   *analysis.Cluster
	svc *corev1.Service
}

// federatedServices groups every cluster's Services by namespace/name
// (namespace sameness), without the cluster-local ones pilot never
// federates (kube-system, kubernetes.default). Within a group, the oldest
// Service comes first, then by cluster ID: the registry's merge order.
func federatedServices(s *analysis.Snapshot) map[string][]clusterService {
	out := map[string][]clusterService{}
	for _, c := range s.Clusters {
		for _, svc := range c.Services {
			if clusterLocal(svc.Namespace, svc.Name) {
				continue
			}
			k := svc.Namespace + "/" + svc.Name
			out[k] = append(out[k], clusterService{c, svc})
		}
	}
	for _, defs := range out {
		slices.SortFunc(defs, func(a, b clusterService) int {
			return cmp.Or(a.svc.CreationTimestamp.Compare(b.svc.CreationTimestamp.Time), cmp.Compare(a.c.ID, b.c.ID))
		})
	}
	return out
}

// clusterLocal reports whether pilot keeps a service within its cluster
// (the registry's default ClusterLocalHosts).
func clusterLocal(ns, name string) bool {
	return ns == "kube-system" || (ns == "default" && name == "kubernetes")
}

// sortedKeys returns the keys of m in order.
func sortedKeys[V any](m map[string]V) []string { return slices.Sorted(maps.Keys(m)) }

// serviceAccount is a pod's service account ("default" when unnamed).
func serviceAccount(p *corev1.Pod) string { return cmp.Or(p.Spec.ServiceAccountName, "default") }

// podReady reports whether a pod is ready and not terminating.
func podReady(p *corev1.Pod) bool {
	if p.DeletionTimestamp != nil {
		return false
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// list joins a sorted, de-duplicated copy of items, shortening long lists.
func list(items []string) string {
	items = slices.Compact(slices.Sorted(slices.Values(items)))
	const max = 5
	if len(items) > max {
		return strings.Join(items[:max], ", ") + fmt.Sprintf(" (and %d more)", len(items)-max)
	}
	return strings.Join(items, ", ")
}
