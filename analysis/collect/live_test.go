package collect_test

import (
	"context"
	"net/netip"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	securityv1beta1 "istio.io/api/security/v1beta1"
	typev1beta1 "istio.io/api/type/v1beta1"
	securityv1 "istio.io/client-go/pkg/apis/security/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/isthmus-mesh/isthmus/analysis"
	"github.com/isthmus-mesh/isthmus/controller"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// TestCleanTopologyReportsNothing: the demo-like topology is clean, and
// both clusters were read.
func TestCleanTopologyReportsNothing(t *testing.T) {
	snap, msgs := analyzeLive(t, analysis.Mesh{})
	requireOnly(t, msgs)
	require.Len(t, snap.Clusters, 2)
	require.Equal(t, []analysis.Remote{{ID: "cluster-2", Secret: cpNS + "/" + mainSecret}}, snap.Remotes)
	c2 := snap.Cluster("cluster-2")
	require.Equal(t, "network-2", string(c2.Network))
	require.NotEmpty(t, c2.Pods)
	require.Contains(t, c2.Unread, analysis.KindServiceAccounts, "pilot's reader may not list ServiceAccounts")
}

// TestUnreachableRemote (ISM0001): a remote Secret whose API server is
// not listening.
func TestUnreachableRemote(t *testing.T) {
	_, c2 := topology(t)
	kc := kubeconfig(t, "cluster-9", "https://127.0.0.1:1", c2.CAData(), "a-token-that-must-not-show")
	addSecret(t, "remote-cluster-9", map[string][]byte{"cluster-9": kc})
	_, msgs := analyzeLive(t, analysis.Mesh{})
	requireOnly(t, msgs, "ISM0001 Secret/isthmus-system/remote-cluster-9 cluster-9")
	require.Contains(t, msgs[0].Text(), "Unreachable")
	require.NotContains(t, texts(msgs), "a-token-that-must-not-show")
}

// TestUnauthorizedRemote (ISM0002): a remote Secret whose token the API
// server refuses.
func TestUnauthorizedRemote(t *testing.T) {
	_, c2 := topology(t)
	kc := kubeconfig(t, "cluster-8", c2.Host(), c2.CAData(), "revoked-token")
	addSecret(t, "remote-cluster-8", map[string][]byte{"cluster-8": kc})
	_, msgs := analyzeLive(t, analysis.Mesh{})
	requireOnly(t, msgs, "ISM0002 Secret/isthmus-system/remote-cluster-8 cluster-8")
	require.Contains(t, msgs[0].Text(), "Unauthorized")
	require.NotContains(t, texts(msgs), "revoked-token")
}

// TestRefusedKubeconfig (ISM0003): pilot's sanitizer refuses an exec
// kubeconfig, and analyze runs nothing.
func TestRefusedKubeconfig(t *testing.T) {
	_, c2 := topology(t)
	cfg, err := clientcmd.Load(kubeconfig(t, "cluster-7", c2.Host(), c2.CAData(), ""))
	require.NoError(t, err)
	marker := filepath.Join(t.TempDir(), "ran")
	cfg.AuthInfos["cluster-7"].Exec = &clientcmdapi.ExecConfig{Command: "/bin/sh", Args: []string{"-c", "touch " + marker}, APIVersion: "client.authentication.k8s.io/v1"}
	kc, err := clientcmd.Write(*cfg)
	require.NoError(t, err)
	addSecret(t, "remote-cluster-7", map[string][]byte{"cluster-7": kc})
	_, msgs := analyzeLive(t, analysis.Mesh{})
	requireOnly(t, msgs, "ISM0003 Secret/isthmus-system/remote-cluster-7 cluster-7")
	require.Contains(t, msgs[0].Text(), "ExecNotAllowed")
	require.NoFileExists(t, marker, "the exec plugin never ran")
}

// TestDuplicateClusterID (ISM0004): a second Secret claims cluster-2.
func TestDuplicateClusterID(t *testing.T) {
	topology(t)
	addSecret(t, "zz-another-cluster-2", map[string][]byte{"cluster-2": readerKubeconfig})
	_, msgs := analyzeLive(t, analysis.Mesh{})
	requireOnly(t, msgs, "ISM0004 Secret/isthmus-system/zz-another-cluster-2 ")
	require.Contains(t, msgs[0].Text(), mainSecret)
}

// TestNetworkWithoutGateway (ISM0005): a workload of a service on
// network-3, which has no gateway, while clients run on networks 1 and 2.
func TestNetworkWithoutGateway(t *testing.T) {
	_, c2 := topology(t)
	ctx := context.Background()
	_, err := c2.CreateService(ctx, demoNS, "ledger", map[string]string{"app": "ledger"}, framework.ServicePort{Name: "http", Port: 80, TargetPort: 8080})
	require.NoError(t, err)
	cleanup(t, func(ctx context.Context) error {
		return c2.Client.CoreV1().Services(demoNS).Delete(ctx, "ledger", metav1.DeleteOptions{})
	})
	_, err = c2.CreatePod(ctx, framework.PodOptions{Namespace: demoNS, Name: "ledger-0", ServiceAccount: "ledger",
		Labels: map[string]string{"app": "ledger", "topology.istio.io/network": "network-3"}, IP: netip.MustParseAddr("10.3.0.10"), Ready: true})
	require.NoError(t, err)
	cleanup(t, func(ctx context.Context) error {
		return c2.Client.CoreV1().Pods(demoNS).Delete(ctx, "ledger-0", metav1.DeleteOptions{})
	})

	_, msgs := analyzeLive(t, analysis.Mesh{})
	requireOnly(t, msgs, "ISM0005 Network/network-3 ")
	require.Equal(t, "network network-3 has no trusted east-west gateway, but service demo/ledger has endpoints there and is used from network(s) network-1, network-2", msgs[0].Text())
}

// TestGatewayInUntrustedNamespace (ISM0006): a tenant's Service posing as
// network-2's gateway is reported, unless its namespace is trusted by the
// same selector flag as pilot's.
func TestGatewayInUntrustedNamespace(t *testing.T) {
	_, c2 := topology(t)
	require.NoError(t, createGateway(context.Background(), c2, demoNS, "fake-gateway", "network-2", "192.0.2.66"))
	cleanup(t, func(ctx context.Context) error {
		return c2.Client.CoreV1().Services(demoNS).Delete(ctx, "fake-gateway", metav1.DeleteOptions{})
	})
	_, msgs := analyzeLive(t, analysis.Mesh{})
	requireOnly(t, msgs, "ISM0006 Service/demo/fake-gateway cluster-2")

	// Trusting the namespace by a label selector, as pilot's flag does: the
	// candidate is no longer untrusted, but it has no pods, so no identity.
	sel, err := labels.Parse("istio.io/dataplane-mode=ambient")
	require.NoError(t, err)
	_, msgs = analyzeLive(t, analysis.Mesh{GatewayNamespaceSelector: sel})
	requireOnly(t, msgs, "ISM0007 Service/demo/fake-gateway cluster-2")
}

// TestGatewayCandidateUnusable (ISM0007): a gateway Service in the
// control-plane namespace without an address.
func TestGatewayCandidateUnusable(t *testing.T) {
	_, c2 := topology(t)
	require.NoError(t, createGateway(context.Background(), c2, cpNS, "pending-gateway", "network-2", ""))
	cleanup(t, func(ctx context.Context) error {
		return c2.Client.CoreV1().Services(cpNS).Delete(ctx, "pending-gateway", metav1.DeleteOptions{})
	})
	_, msgs := analyzeLive(t, analysis.Mesh{})
	requireOnly(t, msgs, "ISM0007 Service/isthmus-system/pending-gateway cluster-2")
	require.Contains(t, msgs[0].Text(), "no address")
}

// TestServicePortConflict (ISM0008): port http is 80 in the older Service
// and 8080 in the newer one.
func TestServicePortConflict(t *testing.T) {
	primary, c2 := topology(t)
	ctx := context.Background()
	_, err := primary.CreateService(ctx, demoNS, "web", map[string]string{"app": "web"}, framework.ServicePort{Name: "http", Port: 80, TargetPort: 8080})
	require.NoError(t, err)
	cleanup(t, func(ctx context.Context) error {
		return primary.Client.CoreV1().Services(demoNS).Delete(ctx, "web", metav1.DeleteOptions{})
	})
	waitNewerSecond(t)
	_, err = c2.CreateService(ctx, demoNS, "web", map[string]string{"app": "web"}, framework.ServicePort{Name: "http", Port: 8080, TargetPort: 8080})
	require.NoError(t, err)
	cleanup(t, func(ctx context.Context) error {
		return c2.Client.CoreV1().Services(demoNS).Delete(ctx, "web", metav1.DeleteOptions{})
	})

	_, msgs := analyzeLive(t, analysis.Mesh{})
	requireOnly(t, msgs, "ISM0008 Service/demo/web cluster-2")
	require.Equal(t, "port http is 8080/TCP in cluster cluster-2 but 80/TCP in cluster primary (the oldest definition, which is used)", msgs[0].Text())
}

// TestServiceIdentitySplit (ISM0009): echo also runs in primary, as
// another service account.
func TestServiceIdentitySplit(t *testing.T) {
	primary, _ := topology(t)
	_, err := primary.CreatePod(context.Background(), framework.PodOptions{Namespace: demoNS, Name: "echo-local", ServiceAccount: "echo-v2",
		Labels: map[string]string{"app": "echo"}, IP: netip.MustParseAddr("10.1.0.11"), Ready: true})
	require.NoError(t, err)
	cleanup(t, func(ctx context.Context) error {
		return primary.Client.CoreV1().Pods(demoNS).Delete(ctx, "echo-local", metav1.DeleteOptions{})
	})
	_, msgs := analyzeLive(t, analysis.Mesh{})
	requireOnly(t, msgs, "ISM0009 Service/demo/echo primary")
	require.Equal(t, "service runs as echo-v2 in cluster primary but as echo in cluster cluster-2", msgs[0].Text())
}

// TestAmbientEnrollmentMismatch (ISM0010): namespace shop is enrolled in
// primary (Isthmus's label) but not in cluster-2.
func TestAmbientEnrollmentMismatch(t *testing.T) {
	primary, c2 := topology(t)
	ctx := context.Background()
	require.NoError(t, primary.EnsureNamespace(ctx, "shop", map[string]string{"isthmus.io/dataplane-mode": "ambient"}))
	require.NoError(t, c2.EnsureNamespace(ctx, "shop", nil))
	// Test clusters run no namespace controller, so a deleted namespace
	// would stay terminating: unenrol it instead.
	cleanup(t, func(ctx context.Context) error { return primary.EnsureNamespace(ctx, "shop", nil) })
	_, msgs := analyzeLive(t, analysis.Mesh{})
	requireOnly(t, msgs, "ISM0010 Namespace/shop ")
	require.Equal(t, "namespace is enrolled in ambient in cluster(s) primary but not in cluster(s) cluster-2", msgs[0].Text())
}

var serviceExportGVR = schema.GroupVersionResource{Group: "multicluster.x-k8s.io", Version: "v1beta1", Resource: "serviceexports"}

// TestServiceExportConflict (ISM0011): echo is exported by both clusters,
// headless in the newer export: a type conflict by the KEP's rules.
func TestServiceExportConflict(t *testing.T) {
	primary, c2 := topology(t)
	ctx := context.Background()
	crds := filepath.Join("..", "..", "manifests", "base", "crds")
	_, err := c2.CreateService(ctx, demoNS, "catalog", map[string]string{"app": "catalog"}, framework.ServicePort{Name: "http", Port: 80, TargetPort: 8080})
	require.NoError(t, err)
	cleanup(t, func(ctx context.Context) error {
		return c2.Client.CoreV1().Services(demoNS).Delete(ctx, "catalog", metav1.DeleteOptions{})
	})
	headless := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "catalog", Namespace: demoNS}, Spec: corev1.ServiceSpec{
		ClusterIP: corev1.ClusterIPNone, Selector: map[string]string{"app": "catalog"},
		Ports: []corev1.ServicePort{{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP}}}}
	_, err = primary.Client.CoreV1().Services(demoNS).Create(ctx, headless, metav1.CreateOptions{})
	require.NoError(t, err)
	cleanup(t, func(ctx context.Context) error {
		return primary.Client.CoreV1().Services(demoNS).Delete(ctx, "catalog", metav1.DeleteOptions{})
	})
	for i, c := range []*framework.Cluster{c2, primary} { // cluster-2 exports first: its type wins
		require.NoError(t, c.InstallCRDs(crds))
		if i > 0 {
			waitNewerSecond(t)
		}
		dyn := dynamic.NewForConfigOrDie(c.Config).Resource(serviceExportGVR).Namespace(demoNS)
		exp := &unstructured.Unstructured{Object: map[string]any{"apiVersion": "multicluster.x-k8s.io/v1beta1", "kind": "ServiceExport",
			"metadata": map[string]any{"name": "catalog", "namespace": demoNS}}}
		_, err := dyn.Create(ctx, exp, metav1.CreateOptions{})
		require.NoError(t, err)
		cleanup(t, func(ctx context.Context) error { return dyn.Delete(ctx, "catalog", metav1.DeleteOptions{}) })
	}
	_, msgs := analyzeLive(t, analysis.Mesh{})
	requireOnly(t, msgs, "ISM0011 ServiceExport/demo/catalog primary")
	require.Contains(t, msgs[0].Text(), "conflicting exports (TypeConflict)")
}

// TestRootCertificates (ISM0012, ISM0013, ISM0014): cluster-2 publishes
// another root, then both roots, then none.
func TestRootCertificates(t *testing.T) {
	_, c2 := topology(t)
	ctx := context.Background()
	t.Cleanup(func() { require.NoError(t, setRoots(context.Background(), c2, rootA)) })
	res := "ConfigMap/isthmus-system/isthmus-ca-root-cert cluster-2"

	require.NoError(t, setRoots(ctx, c2, rootB))
	_, msgs := analyzeLive(t, analysis.Mesh{})
	requireOnly(t, msgs, "ISM0012 "+res)

	require.NoError(t, setRoots(ctx, c2, rootA+rootB))
	_, msgs = analyzeLive(t, analysis.Mesh{})
	requireOnly(t, msgs, "ISM0013 "+res)

	require.NoError(t, c2.Client.CoreV1().ConfigMaps(cpNS).Delete(ctx, "isthmus-ca-root-cert", metav1.DeleteOptions{}))
	_, msgs = analyzeLive(t, analysis.Mesh{})
	requireOnly(t, msgs, "ISM0014 "+res)
}

// TestUnknownPrincipal (ISM0015): an AuthorizationPolicy in primary allows
// sleep (a pod runs as it in primary), echo (only in cluster-2, whose
// ServiceAccounts pilot's reader cannot list: its pod counts) and a typo.
func TestUnknownPrincipal(t *testing.T) {
	primary, _ := topology(t)
	ctx := context.Background()
	require.NoError(t, primary.InstallCRDs(authorizationPolicyCRD(t)))
	ap := &securityv1.AuthorizationPolicy{
		TypeMeta:   metav1.TypeMeta{APIVersion: "security.istio.io/v1", Kind: "AuthorizationPolicy"},
		ObjectMeta: metav1.ObjectMeta{Name: "allow-callers", Namespace: demoNS},
		Spec: securityv1beta1.AuthorizationPolicy{Rules: []*securityv1beta1.Rule{{From: []*securityv1beta1.Rule_From{{Source: &securityv1beta1.Source{
			Principals: []string{"cluster.local/ns/demo/sa/sleep", "cluster.local/ns/demo/sa/echo", "cluster.local/ns/demo/sa/sleeep",
				"cluster.local/ns/demo/sa/*", "other.domain/ns/demo/sa/nobody"},
		}}}}}},
	}
	obj, err := runtime.DefaultUnstructuredConverter.ToUnstructured(ap)
	require.NoError(t, err)
	gvr := schema.GroupVersionResource{Group: "security.istio.io", Version: "v1", Resource: "authorizationpolicies"}
	dyn := dynamic.NewForConfigOrDie(primary.Config).Resource(gvr).Namespace(demoNS)
	_, err = dyn.Create(ctx, &unstructured.Unstructured{Object: obj}, metav1.CreateOptions{})
	require.NoError(t, err)
	cleanup(t, func(ctx context.Context) error { return dyn.Delete(ctx, "allow-callers", metav1.DeleteOptions{}) })

	_, msgs := analyzeLive(t, analysis.Mesh{TrustDomain: "cluster.local"})
	requireOnly(t, msgs, "ISM0015 AuthorizationPolicy/demo/allow-callers primary")
	require.Equal(t, "principal cluster.local/ns/demo/sa/sleeep names service account demo/sleeep, which no cluster has", msgs[0].Text())
}

// TestRootPeerAuthenticationSelector (ISM0017): in primary, the operator
// exempts a legacy app with a PERMISSIVE PeerAuthentication in the root
// namespace whose selector is {app: legacy}, next to the STRICT default
// and a `selector: {}` one (both mesh-wide), and a tenant does the same in
// its own namespace (workload-specific). Only the root-namespace one with
// labels is reported: it applies to no workload.
func TestRootPeerAuthenticationSelector(t *testing.T) {
	primary, _ := topology(t)
	ctx := context.Background()
	require.NoError(t, primary.InstallCRDs(filepath.Join("..", "..", "manifests", "base", "crds", "security.istio.io_peerauthentications.yaml")))
	gvr := schema.GroupVersionResource{Group: "security.istio.io", Version: "v1", Resource: "peerauthentications"}
	create := func(ns, name string, sel *typev1beta1.WorkloadSelector, mode securityv1beta1.PeerAuthentication_MutualTLS_Mode) {
		t.Helper()
		pa := &securityv1.PeerAuthentication{
			TypeMeta:   metav1.TypeMeta{APIVersion: "security.istio.io/v1", Kind: "PeerAuthentication"},
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
			Spec:       securityv1beta1.PeerAuthentication{Selector: sel, Mtls: &securityv1beta1.PeerAuthentication_MutualTLS{Mode: mode}},
		}
		obj, err := runtime.DefaultUnstructuredConverter.ToUnstructured(pa)
		require.NoError(t, err)
		dyn := dynamic.NewForConfigOrDie(primary.Config).Resource(gvr).Namespace(ns)
		_, err = dyn.Create(ctx, &unstructured.Unstructured{Object: obj}, metav1.CreateOptions{})
		require.NoError(t, err)
		cleanup(t, func(ctx context.Context) error { return dyn.Delete(ctx, name, metav1.DeleteOptions{}) })
	}
	legacy := &typev1beta1.WorkloadSelector{MatchLabels: map[string]string{"app": "legacy"}}
	create(cpNS, "legacy", legacy, securityv1beta1.PeerAuthentication_MutualTLS_PERMISSIVE)
	create(cpNS, "default", nil, securityv1beta1.PeerAuthentication_MutualTLS_STRICT)
	create(cpNS, "everyone", &typev1beta1.WorkloadSelector{}, securityv1beta1.PeerAuthentication_MutualTLS_STRICT)
	create(demoNS, "legacy", legacy, securityv1beta1.PeerAuthentication_MutualTLS_PERMISSIVE)

	snap, msgs := analyzeLive(t, analysis.Mesh{})
	require.Len(t, snap.Cluster("primary").PeerAuthentications, 4)
	requireOnly(t, msgs, "ISM0017 PeerAuthentication/isthmus-system/legacy primary")
	require.Contains(t, msgs[0].Text(), "with selector {app=legacy} (mode PERMISSIVE) applies to no workload")
}

// TestClusterDataIncomplete (ISM0016): a remote whose credentials may list
// namespaces and pods but not Services or ServiceExports.
func TestClusterDataIncomplete(t *testing.T) {
	_, c2 := topology(t)
	ctx := context.Background()
	require.NoError(t, c2.InstallCRDs(filepath.Join("..", "..", "manifests", "base", "crds")))
	const sa = "namespace-reader"
	_, err := c2.Client.CoreV1().ServiceAccounts(cpNS).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa, Namespace: cpNS}}, metav1.CreateOptions{})
	require.NoError(t, err)
	cleanup(t, func(ctx context.Context) error {
		return c2.Client.CoreV1().ServiceAccounts(cpNS).Delete(ctx, sa, metav1.DeleteOptions{})
	})
	rbac := c2.Client.RbacV1()
	_, err = rbac.ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: sa},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"namespaces", "pods", "configmaps"}, Verbs: []string{"get", "list"}}}}, metav1.CreateOptions{})
	require.NoError(t, err)
	cleanup(t, func(ctx context.Context) error { return rbac.ClusterRoles().Delete(ctx, sa, metav1.DeleteOptions{}) })
	_, err = rbac.ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: sa},
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: sa},
		Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Name: sa, Namespace: cpNS}}}, metav1.CreateOptions{})
	require.NoError(t, err)
	cleanup(t, func(ctx context.Context) error {
		return rbac.ClusterRoleBindings().Delete(ctx, sa, metav1.DeleteOptions{})
	})
	tr, err := c2.Client.CoreV1().ServiceAccounts(cpNS).CreateToken(ctx, sa, &authenticationv1.TokenRequest{}, metav1.CreateOptions{})
	require.NoError(t, err)

	// The same API server, registered a second time under another ID.
	addSecret(t, "remote-cluster-6", map[string][]byte{"cluster-6": kubeconfig(t, "cluster-6", c2.Host(), c2.CAData(), tr.Status.Token)})
	snap, msgs := analyzeLive(t, analysis.Mesh{})
	requireOnly(t, msgs, "ISM0016 Cluster/cluster-6 ", "ISM0016 Cluster/cluster-6 ")
	require.Equal(t, "cluster cluster-6: serviceexports could not be read (Forbidden); checks that use them saw only the other clusters", msgs[0].Text())
	require.Equal(t, "cluster cluster-6: services could not be read (Forbidden); checks that use them saw only the other clusters", msgs[1].Text())
	require.Equal(t, map[string]string{"services": "Forbidden", "serviceexports": "Forbidden", "serviceaccounts": "Forbidden", "authorizationpolicies": "Forbidden", "peerauthentications": "Forbidden"},
		snap.Cluster("cluster-6").Unread)
}

// TestServiceScopeConflict (ISM0018): service scoped is labelled
// istio.io/global=false in cluster-2 only; in a mesh whose default is
// local, it is local in both clusters and nothing is reported.
func TestServiceScopeConflict(t *testing.T) {
	primary, c2 := topology(t)
	ctx := context.Background()
	for _, c := range []*framework.Cluster{primary, c2} {
		svc, err := c.CreateService(ctx, demoNS, "scoped", map[string]string{"app": "scoped"}, framework.ServicePort{Name: "http", Port: 80, TargetPort: 8080})
		require.NoError(t, err)
		if c == c2 {
			svc.Labels = map[string]string{"istio.io/global": "false"}
			_, err = c.Client.CoreV1().Services(demoNS).Update(ctx, svc, metav1.UpdateOptions{})
			require.NoError(t, err)
		}
		cleanup(t, func(ctx context.Context) error {
			return c.Client.CoreV1().Services(demoNS).Delete(ctx, "scoped", metav1.DeleteOptions{})
		})
	}
	_, msgs := analyzeLive(t, analysis.Mesh{})
	requireOnly(t, msgs, "ISM0018 Service/demo/scoped cluster-2")
	require.Equal(t, "service is global in cluster(s) primary and local in cluster(s) cluster-2: only the global clusters' endpoints are shared (cluster-2: Service label istio.io/global=false)", msgs[0].Text())

	_, msgs = analyzeLive(t, analysis.Mesh{ServiceScope: controller.ServiceScope{Default: controller.ScopeLocal}})
	requireOnly(t, msgs)
}

// TestRoutingPreference (ISM0019, ISM0020): service routed has a routing
// preference annotation with a misspelt scope in the primary and
// PreferSameZone in cluster-2: the annotation is reported as ignored, and
// the clusters as disagreeing (the primary's falls back to the default
// order).
func TestRoutingPreference(t *testing.T) {
	primary, c2 := topology(t)
	ctx := context.Background()
	// cluster-2's first: the oldest definition (a tie in the same second
	// goes to the smaller cluster ID, cluster-2 too).
	for _, c := range []*framework.Cluster{c2, primary} {
		svc, err := c.CreateService(ctx, demoNS, "routed", map[string]string{"app": "routed"}, framework.ServicePort{Name: "http", Port: 80, TargetPort: 8080})
		require.NoError(t, err)
		if c == primary {
			svc.Annotations = map[string]string{controller.RoutingPreferenceAnnotation: "NETWORK,CLUSTR"}
		} else {
			zone := corev1.ServiceTrafficDistributionPreferSameZone
			svc.Spec.TrafficDistribution = &zone
		}
		_, err = c.Client.CoreV1().Services(demoNS).Update(ctx, svc, metav1.UpdateOptions{})
		require.NoError(t, err)
		cleanup(t, func(ctx context.Context) error {
			return c.Client.CoreV1().Services(demoNS).Delete(ctx, "routed", metav1.DeleteOptions{})
		})
	}
	_, msgs := analyzeLive(t, analysis.Mesh{})
	requireOnly(t, msgs, "ISM0019 Service/demo/routed primary", "ISM0020 Service/demo/routed cluster-2")
	for _, m := range msgs {
		if m.Type.Code == "ISM0019" {
			require.Contains(t, m.Text(), `"CLUSTR" is not a scope`)
		}
	}
}
