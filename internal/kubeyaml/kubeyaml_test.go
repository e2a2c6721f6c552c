package kubeyaml_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/internal/kubeyaml"
)

func sources(objs []kubeyaml.Object) []string {
	var out []string
	for _, o := range objs {
		out = append(out, o.GetKind()+"/"+o.GetName()+"@"+o.Source)
	}
	return out
}

// TestDecode: documents are numbered from 1; empty and comment-only
// documents are skipped; Lists are expanded; JSON is accepted.
func TestDecode(t *testing.T) {
	objs, err := kubeyaml.Decode(strings.NewReader(`---
# only a comment
---
apiVersion: v1
kind: ConfigMap
metadata: {name: a}
---
apiVersion: v1
kind: List
items:
- {apiVersion: v1, kind: Service, metadata: {name: b}}
- {apiVersion: v1, kind: Service, metadata: {name: c}}
---
{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "d"}}
`), "f.yaml")
	require.NoError(t, err)
	require.Equal(t, []string{"ConfigMap/a@f.yaml:2", "Service/b@f.yaml:3[0]", "Service/c@f.yaml:3[1]", "Secret/d@f.yaml:4"}, sources(objs))

	_, err = kubeyaml.Decode(strings.NewReader("apiVersion: v1\nkind: ConfigMap\n---\n- a list\n"), "g.yaml")
	require.ErrorContains(t, err, "g.yaml: document 2")
	_, err = kubeyaml.Decode(strings.NewReader("kind: ConfigMap\n"), "h.yaml")
	require.ErrorContains(t, err, "h.yaml:1: not a Kubernetes object")
}

// TestLoad reads a folder recursively, in lexical order, only files with
// a manifest extension.
func TestLoad(t *testing.T) {
	dir := t.TempDir()
	for path, content := range map[string]string{
		"b.yaml":        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: b}\n",
		"a/c.yml":       "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n",
		"a/d.json":      `{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "d"}}`,
		"a/README.md":   "not a manifest",
		"a/e.yaml.orig": "not a manifest",
	} {
		require.NoError(t, os.MkdirAll(filepath.Join(dir, filepath.Dir(path)), 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(dir, path), []byte(content), 0o644))
	}
	objs, err := kubeyaml.Load(dir)
	require.NoError(t, err)
	var names []string
	for _, o := range objs {
		names = append(names, o.GetName())
	}
	require.Equal(t, []string{"c", "d", "b"}, names)

	_, err = kubeyaml.Load(filepath.Join(dir, "missing"))
	require.ErrorContains(t, err, "missing")
}
