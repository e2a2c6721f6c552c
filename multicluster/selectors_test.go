package multicluster_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/multicluster"
)

// TestParseDiscoverySelectors: YAML and JSON lists parse; unknown fields,
// invalid operators, values and oversized text are specific errors; the
// selection ORs its selectors, an empty list selects all, and only a single
// selector is handed to the API server.
func TestParseDiscoverySelectors(t *testing.T) {
	sels, err := multicluster.ParseDiscoverySelectors("- matchLabels: {team: a}\n- matchExpressions: [{key: env, operator: In, values: [prod, stage]}]\n")
	require.NoError(t, err)
	require.Len(t, sels, 2)
	js, err := multicluster.ParseDiscoverySelectors(`[{"matchLabels":{"team":"a"}},{"matchExpressions":[{"key":"env","operator":"In","values":["prod","stage"]}]}]`)
	require.NoError(t, err)
	assert.Equal(t, sels, js)

	sel, err := multicluster.NewNamespaceSelection(sels)
	require.NoError(t, err)
	assert.False(t, sel.All())
	assert.True(t, sel.Matches(map[string]string{"team": "a"}))
	assert.True(t, sel.Matches(map[string]string{"env": "stage"}))
	assert.False(t, sel.Matches(map[string]string{"team": "b", "env": "dev"}))
	assert.Nil(t, sel.ServerSelector(), "two selectors are OR-ed on the client")
	assert.Equal(t, "{team=a} OR {env in (prod,stage)}", sel.String())

	one, err := multicluster.NewNamespaceSelection(sels[:1])
	require.NoError(t, err)
	require.NotNil(t, one.ServerSelector())
	assert.Equal(t, "team=a", one.ServerSelector().String())

	for _, text := range []string{"", "[]"} {
		empty, err := multicluster.ParseDiscoverySelectors(text)
		require.NoError(t, err, "%q", text)
		all, err := multicluster.NewNamespaceSelection(empty)
		require.NoError(t, err)
		assert.True(t, all.All(), "%q selects all", text)
		assert.True(t, all.Matches(nil))
	}
	var nilSel *multicluster.NamespaceSelection
	assert.True(t, nilSel.Matches(map[string]string{"x": "y"}))

	for text, want := range map[string]string{
		"- matchLabel: {a: b}":                                                `unknown field "matchLabel"`,
		"matchLabels: {a: b}":                                                 "not a list of label selectors",
		"- matchExpressions: [{key: k, operator: Near}]":                      `discovery selector 0: "Near" is not a valid label selector operator`,
		"- {}\n- matchExpressions: [{key: k, operator: Exists, values: [x]}]": "discovery selector 1:",
		"- matchLabels: {a: 'b c'}":                                           "discovery selector 0:",
		strings.Repeat(" ", 65<<10):                                           "at most 65536",
	} {
		_, err := multicluster.ParseDiscoverySelectors(text)
		require.Error(t, err, "%q", text)
		assert.Contains(t, err.Error(), want)
	}
	_, err = multicluster.NewNamespaceSelection([]metav1.LabelSelector{{MatchExpressions: []metav1.LabelSelectorRequirement{{Key: "k", Operator: "Near"}}}})
	assert.Error(t, err)
}
