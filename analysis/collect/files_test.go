package collect_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/analysis"
	"github.com/isthmus-mesh/isthmus/analysis/collect"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	require.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
	require.NoError(t, os.WriteFile(path, []byte(content), 0o644))
}

// TestFiles reads one folder per cluster: the config cluster's remote
// Secret names the other cluster's network and never yields a
// kubeconfig; unknown kinds are skipped.
func TestFiles(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "primary", "a.yaml"), `
apiVersion: v1
kind: Secret
metadata: {name: remote, namespace: isthmus-system, labels: {isthmus.io/multiCluster: "true"}, annotations: {topology.istio.io/network: net-2}}
stringData: {cluster-2: "not a kubeconfig"}
---
# a comment-only document
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: skipped, namespace: demo}
`)
	writeFile(t, filepath.Join(dir, "cluster-2", "deep", "b.yml"), `
apiVersion: v1
kind: Service
metadata: {name: echo, namespace: demo}
spec: {ports: [{name: http, port: 80}]}
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: ap, namespace: demo}
spec: {rules: [{from: [{source: {principals: [cluster.local/ns/demo/sa/x]}}]}]}
`)
	snap, err := collect.Files(dir, collect.FilesConfig{ConfigNetwork: "net-1"})
	require.NoError(t, err)
	require.Len(t, snap.Clusters, 2)
	require.Equal(t, []analysis.RemoteSecret{{Namespace: "isthmus-system", Name: "remote", Clusters: []model.ClusterID{"cluster-2"}, Network: "net-2"}},
		snap.RemoteSecrets)
	c2, primary := snap.Cluster("cluster-2"), snap.Cluster("primary")
	require.Equal(t, "net-2", string(c2.Network))
	require.Equal(t, "isthmus-system/remote", c2.Secret)
	require.Equal(t, "net-1", string(primary.Network))
	require.Len(t, c2.Services, 1)
	require.Equal(t, []string{"cluster.local/ns/demo/sa/x"}, c2.AuthorizationPolicies[0].Spec.GetRules()[0].GetFrom()[0].GetSource().GetPrincipals())
	require.Empty(t, snap.Remotes, "files mode contacts nothing")
}

// TestFilesErrors: a folder not named by a cluster ID, or a document that
// is not an object, is an error naming it.
func TestFilesErrors(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "Not_A_Cluster", "a.yaml"), "apiVersion: v1\nkind: Namespace\nmetadata: {name: a}\n")
	_, err := collect.Files(dir, collect.FilesConfig{})
	require.ErrorContains(t, err, "Not_A_Cluster: a cluster folder must be named by a cluster ID")

	dir = t.TempDir()
	writeFile(t, filepath.Join(dir, "c1", "a.yaml"), "apiVersion: v1\nkind: Namespace\nmetadata: {name: a}\n---\njust: data\n")
	_, err = collect.Files(dir, collect.FilesConfig{})
	require.ErrorContains(t, err, "a.yaml:2: not a Kubernetes object")

	dir = t.TempDir()
	writeFile(t, filepath.Join(dir, "c1", "a.yaml"), "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {ports: 7}\n")
	_, err = collect.Files(dir, collect.FilesConfig{})
	require.ErrorContains(t, err, "a.yaml:1: Service /a")

	_, err = collect.Files(t.TempDir(), collect.FilesConfig{})
	require.ErrorContains(t, err, "no cluster folders")
}
