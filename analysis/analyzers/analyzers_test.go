package analyzers_test

import (
	"maps"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	securityv1beta1 "istio.io/api/security/v1beta1"
	typev1beta1 "istio.io/api/type/v1beta1"
	securityv1 "istio.io/client-go/pkg/apis/security/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	mcsv1beta1 "sigs.k8s.io/mcs-api/pkg/apis/v1beta1"

	"github.com/isthmus-mesh/isthmus/analysis"
	"github.com/isthmus-mesh/isthmus/analysis/analyzers"
	"github.com/isthmus-mesh/isthmus/analysis/msg"
	"github.com/isthmus-mesh/isthmus/controller"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func meta(ns, name string, created time.Time) metav1.ObjectMeta {
	return metav1.ObjectMeta{Namespace: ns, Name: name, CreationTimestamp: metav1.NewTime(created)}
}

func service(ns, name string, created time.Time, ports ...corev1.ServicePort) *corev1.Service {
	return &corev1.Service{ObjectMeta: meta(ns, name, created), Spec: corev1.ServiceSpec{Selector: map[string]string{"app": name}, Ports: ports}}
}

func pod(ns, name, app, sa string) *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{"app": app}},
		Spec: corev1.PodSpec{ServiceAccountName: sa}}
}

func codes(msgs []msg.Message) []string {
	out := []string{}
	for _, m := range msgs {
		out = append(out, m.Type.Code+" "+m.Resource.String()+" "+m.Resource.Cluster)
	}
	return out
}

func mesh() analysis.Mesh {
	return analysis.Mesh{Namespace: "isthmus-system", ConfigCluster: "primary", TrustDomain: "cluster.local"}
}

// TestServicePorts: a protocol differing is a conflict like a number; the
// oldest definition is the reference, ties broken by cluster ID.
func TestServicePorts(t *testing.T) {
	tcp := corev1.ServicePort{Name: "dns", Port: 53}
	udp := corev1.ServicePort{Name: "dns", Port: 53, Protocol: corev1.ProtocolUDP}
	snap := &analysis.Snapshot{Mesh: mesh(), Clusters: []*analysis.Cluster{
		{ID: "a", Services: []*corev1.Service{service("x", "dns", t0, udp)}},
		{ID: "b", Services: []*corev1.Service{service("x", "dns", t0, tcp)}},
		{ID: "c", Services: []*corev1.Service{service("x", "dns", t0.Add(-time.Hour), udp)}},
		{ID: "d", Services: []*corev1.Service{service("kube-system", "dns", t0, tcp)}},
	}}
	msgs := analyzers.ServicePorts{}.Analyze(snap)
	require.Equal(t, []string{"ISM0008 Service/x/dns b"}, codes(msgs))
	require.Equal(t, "port dns is 53/TCP in cluster b but 53/UDP in cluster c (the oldest definition, which is used)", msgs[0].Text())
}

// TestNetworkGateways: one network needs no gateway; a trusted gateway
// serves its network; a gateway outside the trusted namespaces does not.
func TestNetworkGateways(t *testing.T) {
	gw := func(ns string) *corev1.Service {
		s := service(ns, "gw", t0, corev1.ServicePort{Name: "tls-hbone", Port: 15008})
		s.Labels = map[string]string{"topology.istio.io/network": "n2"}
		s.Spec.ExternalIPs = []string{"192.0.2.9"}
		return s
	}
	build := func(gwNS string, clientNet model.Network) *analysis.Snapshot {
		return &analysis.Snapshot{Mesh: mesh(), Clusters: []*analysis.Cluster{
			{ID: "primary", Network: clientNet, Pods: []*corev1.Pod{pod("demo", "sleep", "sleep", "sleep")}},
			{ID: "c2", Network: "n2", Services: []*corev1.Service{service("demo", "echo", t0), gw(gwNS)},
				Pods: []*corev1.Pod{pod("demo", "echo-0", "echo", "echo"), pod(gwNS, "gw-0", "gw", "gw")}},
		}}
	}
	require.Empty(t, analyzers.NetworkGateways{}.Analyze(build("isthmus-system", "n1")))
	require.Empty(t, analyzers.NetworkGateways{}.Analyze(build("tenant", "n2")), "one network: no gateway needed")
	msgs := analyzers.NetworkGateways{}.Analyze(build("tenant", "n1"))
	require.Equal(t, []string{"ISM0005 Network/n2 "}, codes(msgs))
	require.Equal(t, "network n2 has no trusted east-west gateway, but service demo/echo, tenant/gw has endpoints there and is used from network(s) n1", msgs[0].Text())
	require.Equal(t, []string{"ISM0006 Service/tenant/gw c2"}, codes(analyzers.GatewayCandidates{}.Analyze(build("tenant", "n1"))))
}

// TestPrincipals: a ServiceAccount object or a pod makes a principal
// known; wildcards, other trust domains and malformed principals are left
// alone; each unknown principal is reported once per policy.
func TestPrincipals(t *testing.T) {
	ap := &securityv1.AuthorizationPolicy{ObjectMeta: meta("demo", "ap", t0), Spec: securityv1beta1.AuthorizationPolicy{
		Rules: []*securityv1beta1.Rule{
			{From: []*securityv1beta1.Rule_From{{Source: &securityv1beta1.Source{
				Principals:    []string{"cluster.local/ns/demo/sa/object", "cluster.local/ns/demo/sa/runs", "*", "cluster.local/ns/*/sa/x", "other/ns/demo/sa/none", "not-a-principal"},
				NotPrincipals: []string{"spiffe://cluster.local/ns/demo/sa/ghost"},
			}}}},
			{From: []*securityv1beta1.Rule_From{{Source: &securityv1beta1.Source{Principals: []string{"spiffe://cluster.local/ns/demo/sa/ghost"}}}}},
		}}}
	snap := &analysis.Snapshot{Mesh: mesh(), Clusters: []*analysis.Cluster{
		{ID: "primary", AuthorizationPolicies: []*securityv1.AuthorizationPolicy{ap},
			ServiceAccounts: []*corev1.ServiceAccount{{ObjectMeta: meta("demo", "object", t0)}}},
		{ID: "c2", Pods: []*corev1.Pod{pod("demo", "p", "p", "runs")}},
	}}
	msgs := analyzers.Principals{}.Analyze(snap)
	require.Equal(t, []string{"ISM0015 AuthorizationPolicy/demo/ap primary"}, codes(msgs))
	require.Equal(t, "principal spiffe://cluster.local/ns/demo/sa/ghost names service account demo/ghost, which no cluster has", msgs[0].Text())
}

// TestDuplicateClusterIDs: every Secret after the oldest is reported.
func TestDuplicateClusterIDs(t *testing.T) {
	snap := &analysis.Snapshot{RemoteSecrets: []analysis.RemoteSecret{
		{Namespace: "ns", Name: "b", Created: t0, Clusters: []model.ClusterID{"c2", "c3"}},
		{Namespace: "ns", Name: "a", Created: t0.Add(time.Hour), Clusters: []model.ClusterID{"c2"}},
		{Namespace: "ns", Name: "c", Created: t0.Add(time.Hour), Clusters: []model.ClusterID{"c2", "c4"}},
	}}
	msgs := analyzers.DuplicateClusterIDs{}.Analyze(snap)
	require.Equal(t, []string{"ISM0004 Secret/ns/a ", "ISM0004 Secret/ns/c "}, codes(msgs))
	require.Equal(t, "cluster ID c2 is claimed by secret ns/b and by secret ns/a; only one is used", msgs[0].Text())
}

// TestServiceExports: a ServiceExport without its Service exports nothing;
// conflicting ports are reported on the overruled clusters.
func TestServiceExports(t *testing.T) {
	export := func(created time.Time) *mcsv1beta1.ServiceExport {
		return &mcsv1beta1.ServiceExport{ObjectMeta: meta("demo", "echo", created)}
	}
	snap := &analysis.Snapshot{Mesh: mesh(), Clusters: []*analysis.Cluster{
		{ID: "a", Services: []*corev1.Service{service("demo", "echo", t0, corev1.ServicePort{Name: "http", Port: 80})},
			ServiceExports: []*mcsv1beta1.ServiceExport{export(t0)}},
		{ID: "b", Services: []*corev1.Service{service("demo", "echo", t0, corev1.ServicePort{Name: "http", Port: 81})},
			ServiceExports: []*mcsv1beta1.ServiceExport{export(t0.Add(time.Hour))}},
		{ID: "c", ServiceExports: []*mcsv1beta1.ServiceExport{export(t0.Add(-time.Hour))}},
	}}
	msgs := analyzers.ServiceExports{}.Analyze(snap)
	require.Equal(t, []string{"ISM0011 ServiceExport/demo/echo b"}, codes(msgs))
	require.Contains(t, msgs[0].Text(), "PortConflict")
}

// TestRootCertificates: without a config cluster the first publishing
// cluster is the reference; a bundle that is not PEM is missing roots.
func TestRootCertificates(t *testing.T) {
	cm := func(data string) *corev1.ConfigMap {
		return &corev1.ConfigMap{Data: map[string]string{"root-cert.pem": data}}
	}
	snap := &analysis.Snapshot{Mesh: mesh(), Clusters: []*analysis.Cluster{
		{ID: "a", RootCertificate: cm("garbage")},
		{ID: "b", Unread: map[string]string{analysis.KindRootCertificate: "Forbidden"}},
		{ID: "c"},
	}}
	msgs := analyzers.RootCertificates{}.Analyze(snap)
	require.Equal(t, []string{"ISM0014 ConfigMap/isthmus-system/isthmus-ca-root-cert a", "ISM0014 ConfigMap/isthmus-system/isthmus-ca-root-cert c"}, codes(msgs))
	require.Contains(t, msgs[0].Text(), "root-cert.pem holds no PEM certificate")
}

// TestAmbientEnrollment: a namespace in one cluster only, or the
// control-plane namespace, is never a mismatch.
func TestAmbientEnrollment(t *testing.T) {
	ns := func(name string, ambient bool) *corev1.Namespace {
		n := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
		if ambient {
			n.Labels = map[string]string{"istio.io/dataplane-mode": "ambient"}
		}
		return n
	}
	snap := &analysis.Snapshot{Mesh: mesh(), Clusters: []*analysis.Cluster{
		{ID: "a", Namespaces: []*corev1.Namespace{ns("only-here", true), ns("isthmus-system", true), ns("shop", true)}},
		{ID: "b", Namespaces: []*corev1.Namespace{ns("isthmus-system", false), ns("shop", false)}},
		{ID: "c", Namespaces: []*corev1.Namespace{ns("shop", true)}},
	}}
	msgs := analyzers.AmbientEnrollment{}.Analyze(snap)
	require.Equal(t, []string{"ISM0010 Namespace/shop "}, codes(msgs))
	require.Equal(t, "namespace is enrolled in ambient in cluster(s) a, c but not in cluster(s) b", msgs[0].Text())
}

// TestAllHaveDistinctNames keeps analyzer names unique.
func TestAllHaveDistinctNames(t *testing.T) {
	seen := map[string]bool{}
	for _, a := range analyzers.All() {
		require.False(t, seen[a.Name()], a.Name())
		seen[a.Name()] = true
	}
	require.Len(t, seen, len(analyzers.All()))
}

// TestRootPeerAuthentications: only a root-namespace PeerAuthentication
// whose selector has labels is reported (Istio applies it to no workload);
// no selector or `selector: {}` there is mesh-wide, and a selector
// elsewhere is workload-specific.
func TestRootPeerAuthentications(t *testing.T) {
	peerAuth := func(ns, name string, sel *typev1beta1.WorkloadSelector) *securityv1.PeerAuthentication {
		return &securityv1.PeerAuthentication{ObjectMeta: meta(ns, name, t0), Spec: securityv1beta1.PeerAuthentication{Selector: sel,
			Mtls: &securityv1beta1.PeerAuthentication_MutualTLS{Mode: securityv1beta1.PeerAuthentication_MutualTLS_PERMISSIVE}}}
	}
	legacy := &typev1beta1.WorkloadSelector{MatchLabels: map[string]string{"app": "legacy", "tier": "old"}}
	snap := &analysis.Snapshot{Mesh: mesh(), Clusters: []*analysis.Cluster{{ID: "primary", PeerAuthentications: []*securityv1.PeerAuthentication{
		peerAuth("isthmus-system", "legacy", legacy),
		peerAuth("isthmus-system", "default", nil),
		peerAuth("isthmus-system", "empty", &typev1beta1.WorkloadSelector{}),
		peerAuth("demo", "legacy", legacy),
	}}}}
	msgs := analyzers.RootPeerAuthentications{}.Analyze(snap)
	require.Equal(t, []string{"ISM0017 PeerAuthentication/isthmus-system/legacy primary"}, codes(msgs))
	require.Equal(t, msg.Warning, msgs[0].Type.Level)
	require.Equal(t, "PeerAuthentication in the root namespace with selector {app=legacy, tier=old} (mode PERMISSIVE) applies to no workload: "+
		"Istio ignores a root-namespace PeerAuthentication with a selector; it is not mesh-wide and does not apply to the workloads it selects", msgs[0].Text())
	require.Contains(t, analyzers.All(), analysis.Analyzer(analyzers.RootPeerAuthentications{}))
}

// TestServiceScopes: a service global in one cluster and local in another
// is reported with the local clusters as its resource, by the mesh's own
// rule (Service label over Namespace label over rules over default);
// agreeing clusters and single-cluster services are not.
func TestServiceScopes(t *testing.T) {
	labelled := func(s *corev1.Service, l map[string]string) *corev1.Service { s.Labels = l; return s }
	ns := func(name string, l map[string]string) *corev1.Namespace {
		return &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: l}}
	}
	snap := &analysis.Snapshot{Mesh: mesh(), Clusters: []*analysis.Cluster{
		{ID: "a", Namespaces: []*corev1.Namespace{ns("x", nil), ns("y", map[string]string{"istio.io/global": "false"})}, Services: []*corev1.Service{
			service("x", "web", t0), service("x", "same", t0), service("y", "db", t0), service("x", "only-a", t0),
		}},
		{ID: "b", Namespaces: []*corev1.Namespace{ns("x", nil), ns("y", nil)}, Services: []*corev1.Service{
			labelled(service("x", "web", t0), map[string]string{"istio.io/global": "false"}), service("x", "same", t0), service("y", "db", t0),
		}},
		{ID: "c", Namespaces: []*corev1.Namespace{ns("y", map[string]string{"istio.io/global": "false"})}, Services: []*corev1.Service{
			labelled(service("y", "db", t0), map[string]string{"istio.io/global": "true"}),
		}},
		{ID: "d", Unread: map[string]string{analysis.KindNamespaces: "Forbidden"}, Services: []*corev1.Service{service("x", "web", t0)}},
	}}
	msgs := analyzers.ServiceScopes{}.Analyze(snap)
	require.Equal(t, []string{"ISM0018 Service/x/web b", "ISM0018 Service/y/db a"}, codes(msgs))
	require.Equal(t, "service is global in cluster(s) a and local in cluster(s) b: only the global clusters' endpoints are shared (b: Service label istio.io/global=false)", msgs[0].Text())
	require.Equal(t, "service is global in cluster(s) b,c and local in cluster(s) a: only the global clusters' endpoints are shared (a: Namespace label istio.io/global=false)", msgs[1].Text())

	// In a local-default mesh with a rule making namespace x global, web is
	// still split (b's label wins), db is local in a and b, global in c.
	snap.Mesh.ServiceScope = controller.ServiceScope{Default: controller.ScopeLocal, Rules: []controller.ServiceScopeRule{
		{NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"kubernetes.io/metadata.name": "x"}}, Scope: controller.ScopeGlobal},
	}}
	for _, c := range snap.Clusters {
		for _, n := range c.Namespaces {
			n.Labels = mergeLabels(n.Labels, map[string]string{"kubernetes.io/metadata.name": n.Name})
		}
	}
	msgs = analyzers.ServiceScopes{}.Analyze(snap)
	require.Equal(t, []string{"ISM0018 Service/x/web b", "ISM0018 Service/y/db a,b"}, codes(msgs))
	require.Contains(t, msgs[1].Text(), "b: service scope rules or the mesh default")
}

func mergeLabels(a, b map[string]string) map[string]string {
	out := map[string]string{}
	maps.Copy(out, a)
	maps.Copy(out, b)
	return out
}
