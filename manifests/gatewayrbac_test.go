package manifests_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
)

// requireGatewayRoles checks that objs grant remotesecret.GatewayRules to
// the ServiceAccount sa of namespace in each of the gateway namespaces,
// and nowhere else.
func requireGatewayRoles(t *testing.T, objs []*unstructured.Unstructured, sa, namespace string, gatewayNamespaces []string) {
	t.Helper()
	name := remotesecret.GatewayRoleName(namespace)
	var in []string
	for _, o := range objs {
		switch {
		case o.GetKind() == "Role" && o.GetName() == name:
			in = append(in, o.GetNamespace())
			require.Equal(t, remotesecret.GatewayRules(), convert[rbacv1.Role](t, o).Rules)
		case o.GetKind() == "RoleBinding" && o.GetName() == name:
			b := convert[rbacv1.RoleBinding](t, o)
			require.Equal(t, rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: name}, b.RoleRef)
			require.Equal(t, []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: sa, Namespace: namespace}}, b.Subjects)
		}
	}
	require.Equal(t, gatewayNamespaces, in)
}

// TestPilotChartGatewayRules: the pilot chart grants what it deploys for
// Gateways in the gateway namespaces only; with a namespace selector (a set
// it cannot know) in its ClusterRole; with the GatewayClass disabled,
// nowhere.
func TestPilotChartGatewayRules(t *testing.T) {
	requireGatewayRoles(t, render(t, "pilot", namespace, nil), "isthmusd", namespace, []string{namespace})
	requireGatewayRoles(t, render(t, "pilot", namespace, map[string]any{"gatewayNamespaces": []any{namespace, "edge"}}),
		"isthmusd", namespace, []string{namespace, "edge"})
	requireGatewayRoles(t, render(t, "pilot", namespace, map[string]any{"gatewayClass": map[string]any{"enabled": false}}),
		"isthmusd", namespace, nil)

	cluster := func(values map[string]any) []rbacv1.PolicyRule {
		objs := render(t, "pilot", namespace, values)
		return convert[rbacv1.ClusterRole](t, find(t, objs, "ClusterRole", "isthmusd-"+namespace)).Rules
	}
	for _, r := range remotesecret.GatewayRules() {
		require.NotContains(t, cluster(nil), r, "no cluster-wide gateway writes by default")
	}
	selected := map[string]any{"gatewayNamespaceSelector": "isthmus.io/gateways=trusted"}
	requireGatewayRoles(t, render(t, "pilot", namespace, selected), "isthmusd", namespace, nil)
	for _, r := range remotesecret.GatewayRules() {
		require.Contains(t, cluster(selected), r, "a namespace selector needs them cluster-wide")
	}
}
