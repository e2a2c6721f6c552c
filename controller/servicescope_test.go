package controller_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/controller"
)

// TestServiceScopePrecedence: the Service's istio.io/global label wins over
// its namespace's, which wins over the rules; among the rules GLOBAL wins
// over LOCAL, whatever their order; then the default decides.
func TestServiceScopePrecedence(t *testing.T) {
	rules := []controller.ServiceScopeRule{
		{ServicesSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"private": "yes"}}, Scope: controller.ScopeLocal},
		{NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"team": "a"}}, Scope: controller.ScopeGlobal},
		{ServicesSelector: &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{Key: "tier", Operator: metav1.LabelSelectorOpIn, Values: []string{"db"}}}},
			NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"env": "prod"}}, Scope: controller.ScopeLocal},
	}
	g, l := map[string]string{controller.GlobalLabel: "true"}, map[string]string{controller.GlobalLabel: "false"}
	for _, tc := range []struct {
		name      string
		def       controller.Scope
		svc, ns   map[string]string
		wantLocal bool
	}{
		{"default global", "", nil, nil, false},
		{"default local", controller.ScopeLocal, nil, nil, true},
		{"service label true over local default", controller.ScopeLocal, g, nil, false},
		{"service label false over global namespace", "", l, g, true},
		{"service label true over local namespace", "", g, l, false},
		{"namespace label false", "", nil, l, true},
		{"namespace label true over a LOCAL rule", "", map[string]string{"private": "yes"}, g, false},
		{"namespace label false over a GLOBAL rule", "", nil, map[string]string{controller.GlobalLabel: "false", "team": "a"}, true},
		{"other label values are ignored", controller.ScopeLocal, map[string]string{controller.GlobalLabel: "yes"}, map[string]string{controller.GlobalLabel: "1"}, true},
		{"LOCAL rule in a global mesh", "", map[string]string{"private": "yes"}, nil, true},
		{"GLOBAL rule in a local mesh", controller.ScopeLocal, nil, map[string]string{"team": "a"}, false},
		{"GLOBAL wins over an earlier LOCAL rule", "", map[string]string{"private": "yes"}, map[string]string{"team": "a"}, false},
		{"both selectors of a rule must match", "", map[string]string{"tier": "db"}, map[string]string{"env": "dev"}, false},
		{"both selectors match", "", map[string]string{"tier": "db"}, map[string]string{"env": "prod"}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sc, err := controller.ServiceScope{Default: tc.def, Rules: rules}.Compile()
			require.NoError(t, err)
			require.Equal(t, tc.wantLocal, sc.Local(tc.svc, tc.ns))
		})
	}
	var nilScoper *controller.Scoper
	require.False(t, nilScoper.Local(nil, nil), "a nil scoper is the zero configuration")
}

// TestServiceScopeParsing: rules parse from YAML as Istio writes them; bad
// input is an error that says what is wrong.
func TestServiceScopeParsing(t *testing.T) {
	rules, err := controller.ParseServiceScopeRules(`
- servicesSelector:
    matchExpressions:
    - {key: istio.io/global, operator: Exists}
  scope: GLOBAL
- namespaceSelector: {matchLabels: {team: a}}
  scope: LOCAL`)
	require.NoError(t, err)
	require.Len(t, rules, 2)
	require.Equal(t, controller.ScopeLocal, rules[1].Scope)
	sc, err := controller.ServiceScope{Default: controller.ScopeLocal, Rules: rules}.Compile()
	require.NoError(t, err)
	require.False(t, sc.Local(map[string]string{controller.GlobalLabel: "maybe"}, nil), "the Exists rule selects any value")

	for text, want := range map[string]string{
		`[{scope: REGIONAL}]`: `scope "REGIONAL"`,
		`[{scope: GLOBAL, servicesSelector: {matchExpressions: [{key: a, operator: Near}]}}]`: "servicesSelector",
		`[{scope: GLOBAL, nameSelector: {}}]`:                                                 "nameSelector",
		`{scope: GLOBAL}`:                                                                     "not a list",
	} {
		_, err := controller.ParseServiceScopeRules(text)
		require.ErrorContains(t, err, want, text)
	}
	for text, want := range map[string]controller.Scope{"global": controller.ScopeGlobal, "LOCAL": controller.ScopeLocal} {
		got, err := controller.ParseScope(text)
		require.NoError(t, err)
		require.Equal(t, want, got)
	}
	_, err = controller.ParseScope("cluster")
	require.ErrorContains(t, err, "want global or local")
	require.ErrorContains(t, controller.ServiceScope{Default: "everywhere"}.Validate(), "everywhere")
}
