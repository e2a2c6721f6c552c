// Package analysis is what `isthmusctl analyze` checks: a Snapshot of every
// cluster of a federation (read live or from files by analysis/collect), the
// Analyzer interface the checks of analysis/analyzers implement, and Run,
// which runs them and filters their messages by suppression and level.
package analysis

import (
	"slices"
	"strings"
	"time"

	securityv1 "istio.io/client-go/pkg/apis/security/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	mcsv1beta1 "sigs.k8s.io/mcs-api/pkg/apis/v1beta1"

	"github.com/isthmus-mesh/isthmus/controller"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// Mesh is the control plane's configuration that the checks need; the
// same settings as pilot's flags.
type Mesh struct {
	// Namespace is the control-plane namespace (pilot's --namespace).
	Namespace string
	// ConfigCluster is the ID of the cluster pilot runs in (--cluster-id).
	ConfigCluster model.ClusterID
	// TrustDomain of the mesh's SPIFFE identities (--trust-domain).
	TrustDomain string
	// GatewayNamespaces may hold east-west gateways (--gateway-namespaces;
	// empty: the control-plane namespace).
	GatewayNamespaces []string
	// GatewayNamespaceSelector also trusts namespaces whose labels match
	// (--gateway-namespace-selector; nil: none).
	GatewayNamespaceSelector labels.Selector
	// ServiceScope is pilot's service scope configuration (--service-scope,
	// --service-scope-rules; zero: every service global unless labelled).
	ServiceScope controller.ServiceScope
}

// TrustedGatewayNamespaces returns GatewayNamespaces, or the control-plane
// namespace when it is empty.
func (m Mesh) TrustedGatewayNamespaces() []string {
	if len(m.GatewayNamespaces) == 0 {
		return []string{m.Namespace}
	}
	return m.GatewayNamespaces
}

// Snapshot is everything the checks read. Analyzers must not change it.
type Snapshot struct {
	Mesh Mesh
	// Clusters are the config cluster and every remote cluster that was
	// read, sorted by ID.
	Clusters []*Cluster
	// RemoteSecrets are the remote Secrets of the config cluster's
	// control-plane namespace, without their kubeconfigs.
	RemoteSecrets []RemoteSecret
	// Remotes are the results of contacting each remote cluster: one per
	// cluster ID a remote Secret registers (live mode only).
	Remotes []Remote
}

// Cluster returns the cluster with that ID, or nil.
func (s *Snapshot) Cluster(id model.ClusterID) *Cluster {
	for _, c := range s.Clusters {
		if c.ID == id {
			return c
		}
	}
	return nil
}

// RemoteSecret is a remote Secret: where it is and which clusters it
// registers. It never holds a kubeconfig.
type RemoteSecret struct {
	Namespace, Name string
	Created         time.Time
	// Clusters are its data keys, sorted.
	Clusters []model.ClusterID
	// Network is its topology.istio.io/network annotation.
	Network model.Network
}

// Key is namespace/name.
func (r RemoteSecret) Key() string { return r.Namespace + "/" + r.Name }

// Remote is the outcome of contacting one remote cluster with the
// kubeconfig of its Secret, as pilot would.
type Remote struct {
	ID     model.ClusterID
	Secret string // namespace/name
	// Reason is "" when the cluster answered; else a multicluster reason:
	// a KubeconfigError reason (refused by the sanitizer),
	// ReasonUnauthorized, ReasonForbidden, ReasonTLSError or
	// ReasonUnreachable.
	Reason string
	// Detail explains Reason; it never holds credentials.
	Detail string
}

// Kinds a cluster may fail to read (the keys of Cluster.Unread).
const (
	KindNamespaces            = "namespaces"
	KindServices              = "services"
	KindPods                  = "pods"
	KindServiceAccounts       = "serviceaccounts"
	KindServiceExports        = "serviceexports"
	KindAuthorizationPolicies = "authorizationpolicies"
	KindPeerAuthentications   = "peerauthentications"
	KindRootCertificate       = "configmaps"
)

// ReaderOptionalKinds are the kinds pilot's remote reader is not granted
// (remotesecret.ReaderRules): a remote cluster read with its Secret's
// kubeconfig is expected to refuse them, so a refusal is not reported as
// incomplete data; the checks that use them see the clusters that allow
// them (the config cluster, read with the operator's own credentials).
var ReaderOptionalKinds = []string{KindServiceAccounts, KindAuthorizationPolicies, KindPeerAuthentications}

// Cluster is what was read from one cluster.
type Cluster struct {
	ID model.ClusterID
	// Network is the cluster's default network: its remote Secret's
	// annotation, or the mesh's for the config cluster.
	Network model.Network
	// Secret registers the cluster (namespace/name; "" for the config cluster).
	Secret string

	Namespaces      []*corev1.Namespace
	Services        []*corev1.Service
	Pods            []*corev1.Pod
	ServiceAccounts []*corev1.ServiceAccount
	ServiceExports  []*mcsv1beta1.ServiceExport
	// RootCertificate is the ConfigMap of published roots in the
	// control-plane namespace (nil: none).
	RootCertificate       *corev1.ConfigMap
	AuthorizationPolicies []*securityv1.AuthorizationPolicy
	PeerAuthentications   []*securityv1.PeerAuthentication

	// Unread maps a kind (Kind* constants) that could not be read to why
	// (for example "Forbidden"): its list above is then empty.
	Unread map[string]string
}

// Readable reports whether kind was read in the cluster.
func (c *Cluster) Readable(kind string) bool {
	_, bad := c.Unread[kind]
	return !bad
}

// Namespace returns the namespace object of that name, or nil.
func (c *Cluster) Namespace(name string) *corev1.Namespace {
	for _, ns := range c.Namespaces {
		if ns.Name == name {
			return ns
		}
	}
	return nil
}

// NetworkOf returns a pod's network as discovery decides it: its
// topology.istio.io/network label, else that label on the control-plane
// namespace, else the cluster's default network.
func (c *Cluster) NetworkOf(pod *corev1.Pod, controlPlaneNamespace string) model.Network {
	if n := pod.Labels[controller.NetworkLabel]; n != "" {
		return model.Network(n)
	}
	if ns := c.Namespace(controlPlaneNamespace); ns != nil && ns.Labels[controller.NetworkLabel] != "" {
		return model.Network(ns.Labels[controller.NetworkLabel])
	}
	return c.Network
}

// SelectedPods returns the pods a Service selects in its namespace (none
// for a Service without a selector), sorted by name.
func (c *Cluster) SelectedPods(svc *corev1.Service) []*corev1.Pod {
	if len(svc.Spec.Selector) == 0 || svc.Spec.Type == corev1.ServiceTypeExternalName {
		return nil
	}
	sel := labels.SelectorFromSet(svc.Spec.Selector)
	var out []*corev1.Pod
	for _, p := range c.Pods {
		if p.Namespace == svc.Namespace && sel.Matches(labels.Set(p.Labels)) {
			out = append(out, p)
		}
	}
	slices.SortFunc(out, func(a, b *corev1.Pod) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// SortSecrets returns the Secrets oldest first, then by namespace/name:
// the order in which a cluster ID claimed twice is settled.
func SortSecrets(secs []RemoteSecret) []RemoteSecret {
	out := slices.Clone(secs)
	slices.SortFunc(out, func(a, b RemoteSecret) int {
		if c := a.Created.Compare(b.Created); c != 0 {
			return c
		}
		return strings.Compare(a.Key(), b.Key())
	})
	return out
}
