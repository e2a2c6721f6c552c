package main

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"
)

// The testdata mesh has two findings: an Error (port http is 80 in
// primary, 8080 in cluster-2) and a Warning (namespace shop is ambient in
// primary only).
const (
	analyzeData = "testdata/analyze"
	portFinding = "ISM0008 Error Service/demo/web cluster-2"
	shopFinding = "ISM0010 Warning Namespace/shop "
)

type jsonFinding struct {
	Code     string `json:"code"`
	Level    string `json:"level"`
	Message  string `json:"message"`
	Resource struct {
		Cluster, Kind, Namespace, Name string
	} `json:"resource"`
	Args map[string]any `json:"args"`
}

func (f jsonFinding) String() string {
	r := f.Resource.Kind + "/"
	if f.Resource.Namespace != "" {
		r += f.Resource.Namespace + "/"
	}
	return f.Code + " " + f.Level + " " + r + f.Resource.Name + " " + f.Resource.Cluster
}

// analyzeFiles runs analyze -f on the testdata with args, returns the
// findings of its JSON output and its exit code (0, or exitError's).
func analyzeFiles(t *testing.T, args ...string) ([]string, int) {
	t.Helper()
	stdout, stderr, err := runCtl(t, append([]string{"analyze", "-f", analyzeData, "-o", "json"}, args...)...)
	code := 0
	if err != nil {
		exit, ok := err.(*exitError)
		require.True(t, ok, "unexpected error: %v\n%s", err, stderr)
		code = exit.code
	}
	var found []jsonFinding
	require.NoError(t, json.Unmarshal([]byte(stdout), &found), stdout)
	out := []string{}
	for _, f := range found {
		out = append(out, f.String())
	}
	return out, code
}

// TestAnalyzeFiles reads the per-cluster folders and reports both
// findings, the Error first, with exit code 79; the JSON carries the
// rendered message and the named arguments.
func TestAnalyzeFiles(t *testing.T) {
	got, code := analyzeFiles(t)
	require.Equal(t, []string{portFinding, shopFinding}, got)
	require.Equal(t, exitAnalyzeIssues, code)

	stdout, _, err := runCtl(t, "analyze", "-f", analyzeData, "-o", "json")
	require.Error(t, err)
	var found []jsonFinding
	require.NoError(t, json.Unmarshal([]byte(stdout), &found))
	require.Equal(t, "port http is 8080/TCP in cluster cluster-2 but 80/TCP in cluster primary (the oldest definition, which is used)", found[0].Message)
	require.Equal(t, map[string]any{"port": "http", "definition": "8080/TCP", "cluster": "cluster-2", "used": "80/TCP", "usedCluster": "primary"}, found[0].Args)

	stdout, _, err = runCtl(t, "analyze", "-f", analyzeData)
	require.ErrorContains(t, err, "analyze found issues at level Error or above")
	require.Equal(t, "Error [ISM0008] (Service/demo/web in cluster-2) port http is 8080/TCP in cluster cluster-2 but 80/TCP in cluster primary (the oldest definition, which is used)\n"+
		"Warning [ISM0010] (Namespace/shop) namespace is enrolled in ambient in cluster(s) primary but not in cluster(s) cluster-2\n", stdout)

	stdout, _, err = runCtl(t, "analyze", "-f", analyzeData, "-o", "yaml")
	require.Error(t, err)
	var asYAML []jsonFinding
	require.NoError(t, yaml.Unmarshal([]byte(stdout), &asYAML))
	require.Len(t, asYAML, 2)
	require.Equal(t, "ISM0010", asYAML[1].Code)

	_, _, err = runCtl(t, "analyze", "-f", "testdata/no-such-folder")
	require.ErrorContains(t, err, "no-such-folder")
}

// TestAnalyzeFailureThreshold: the exit code follows the most serious
// remaining message against --failure-threshold.
func TestAnalyzeFailureThreshold(t *testing.T) {
	onlyWarning := "--suppress=ISM0008=Service/demo/web"
	for _, tc := range []struct {
		args []string
		want int
	}{
		{nil, exitAnalyzeIssues},
		{[]string{onlyWarning}, 0},
		{[]string{onlyWarning, "--failure-threshold", "Warning"}, exitAnalyzeIssues},
		{[]string{onlyWarning, "--failure-threshold", "info"}, exitAnalyzeIssues},
		{[]string{onlyWarning, "--suppress", "ISM0010=Namespace/shop", "--failure-threshold", "Info"}, 0},
	} {
		_, code := analyzeFiles(t, tc.args...)
		require.Equal(t, tc.want, code, "%v", tc.args)
	}
	_, _, err := runCtl(t, "analyze", "-f", analyzeData, "--failure-threshold", "Fatal")
	require.ErrorContains(t, err, `unknown level "Fatal"`)
}

// TestAnalyzeSuppress: --suppress silences exactly the findings of its
// code whose resource its pattern matches.
func TestAnalyzeSuppress(t *testing.T) {
	for _, tc := range []struct {
		suppress []string
		want     []string
	}{
		{[]string{"ISM0008=Service/demo/web"}, []string{shopFinding}},
		{[]string{"ISM0008=Service/*/web"}, []string{shopFinding}},
		{[]string{"ISM0008=Service/demo/*"}, []string{shopFinding}},
		{[]string{"ISM0008=*"}, []string{shopFinding}},
		{[]string{"ISM0008=Service/other/*"}, []string{portFinding, shopFinding}},
		{[]string{"ISM0010=Service/demo/web"}, []string{portFinding, shopFinding}}, // another code
		{[]string{"ISM0010=Namespace/sh*"}, []string{portFinding}},
		{[]string{"ISM0010=Namespace/shop", "ISM0008=Service/demo/web"}, []string{}},
	} {
		var args []string
		for _, s := range tc.suppress {
			args = append(args, "--suppress", s)
		}
		got, _ := analyzeFiles(t, args...)
		require.Equal(t, tc.want, got, "%v", tc.suppress)
	}
	for _, bad := range []string{"ISM0008", "ISM9999=Service/a/b", "ISM0008=Service/[", "=Service/a/b"} {
		_, _, err := runCtl(t, "analyze", "-f", analyzeData, "--suppress", bad)
		require.ErrorContains(t, err, "--suppress", bad)
	}
}
