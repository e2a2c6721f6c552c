package manifestdiff_test

import (
	"bytes"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/internal/kubeyaml"
	"github.com/isthmus-mesh/isthmus/internal/manifestdiff"
)

const setA = `
apiVersion: apps/v1
kind: Deployment
metadata: {name: istiod, namespace: istio-system}
spec:
  replicas: 1
  template:
    spec:
      containers:
      - {name: discovery, image: pilot:1, args: [--a, --b]}
      - {name: sidecar, image: proxy:1}
---
apiVersion: v1
kind: Service
metadata: {name: isthmusd, namespace: isthmus-system}
spec: {ports: [{name: grpc, port: 15012}]}
---
apiVersion: v1
kind: Service
metadata: {name: isthmusd, namespace: other}
spec: {ports: [{name: grpc, port: 15012}]}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: mesh, namespace: isthmus-system, labels: {app.kubernetes.io/name: mesh}}
data:
  mesh.yaml: |
    trustDomain: cluster.local
    defaultConfig: {}
    enableTracing: false
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: reader}
rules: []
`

const setB = `
apiVersion: apps/v1
kind: Deployment
metadata: {name: isthmusd, namespace: isthmus-system}
spec:
  replicas: 2
  template:
    spec:
      containers:
      - {name: sidecar, image: proxy:1}
      - {name: discovery, image: pilot:2, args: [--a, --b]}
---
apiVersion: v1
kind: Service
metadata: {name: isthmusd, namespace: isthmus-system}
spec: {ports: [{name: grpc, port: 15013}]}
---
apiVersion: v1
kind: Service
metadata: {name: isthmusd, namespace: other}
spec: {ports: [{name: grpc, port: 15012}]}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: mesh, namespace: isthmus-system, labels: {app.kubernetes.io/name: mesh}}
data:
  mesh.yaml: |
    trustDomain: cluster.local
    defaultConfig: {}
    enableTracing: true
---
apiVersion: rbac.authorization.k8s.io/v1beta1
kind: ClusterRole
metadata: {name: reader}
rules: []
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: isthmusd, namespace: isthmus-system}
`

func load(t *testing.T, s string) []kubeyaml.Object {
	t.Helper()
	objs, err := kubeyaml.Decode(strings.NewReader(s), "set")
	require.NoError(t, err)
	return objs
}

// compare runs Compare on the two sets and returns the printed result.
func compare(t *testing.T, opts manifestdiff.Options) (*manifestdiff.Result, string) {
	t.Helper()
	res, err := manifestdiff.Compare(load(t, setA), load(t, setB), opts)
	require.NoError(t, err)
	var b bytes.Buffer
	require.NoError(t, res.Write(&b))
	return res, b.String()
}

func patterns(t *testing.T, s string) []manifestdiff.Pattern {
	t.Helper()
	p, err := manifestdiff.ParsePatterns(s)
	require.NoError(t, err)
	return p
}

// TestCompare: a version change of one group is the same object; list
// items with names are matched by name, not position; multi-line strings
// are shown as a line diff.
func TestCompare(t *testing.T) {
	res, out := compare(t, manifestdiff.Options{})
	require.Equal(t, `~ ClusterRole.rbac.authorization.k8s.io::reader
    apiVersion: "rbac.authorization.k8s.io/v1" -> "rbac.authorization.k8s.io/v1beta1"
~ ConfigMap:isthmus-system:mesh
    data["mesh.yaml"]:
      - enableTracing: false
      + enableTracing: true
~ Service:isthmus-system:isthmusd
    spec.ports[name=grpc].port: 15012 -> 15013
+ Deployment.apps:isthmus-system:isthmusd (only in the second set)
+ ServiceAccount:isthmus-system:isthmusd (only in the second set)
- Deployment.apps:istio-system:istiod (only in the first set)
3 changed, 2 added, 1 removed (4 objects in both sets).
`, out)
	require.False(t, res.Equal())
}

// TestRename maps the renamed Deployment onto its new name, so its field
// changes show instead of a removal and an addition.
func TestRename(t *testing.T) {
	renames, err := manifestdiff.ParseRenames("Deployment:istio-system:istiod->*:isthmus-system:isthmusd, ConfigMap:*:nothing->*:*:else")
	require.NoError(t, err)
	_, out := compare(t, manifestdiff.Options{Renames: renames, Select: patterns(t, "Deployment:*:*")})
	require.Equal(t, `~ Deployment.apps:isthmus-system:isthmusd (renamed from Deployment.apps:istio-system:istiod)
    metadata.name: "istiod" -> "isthmusd"
    metadata.namespace: "istio-system" -> "isthmus-system"
    spec.replicas: 1 -> 2
    spec.template.spec.containers[name=discovery].image: "pilot:1" -> "pilot:2"
1 changed, 0 added, 0 removed (1 objects in both sets).
`, out)

	for _, bad := range []string{"Service:a:b", "Service:a:b->Service:a", "Service:a:b->Service:x*:c"} {
		_, err := manifestdiff.ParseRenames(bad)
		require.Error(t, err, bad)
	}
}

// TestSelect keeps only the matching objects, in either set; a Kind
// pattern matches the kind alone or qualified by its group.
func TestSelect(t *testing.T) {
	_, out := compare(t, manifestdiff.Options{Select: patterns(t, "Service:*:isthmusd")})
	require.Equal(t, `~ Service:isthmus-system:isthmusd
    spec.ports[name=grpc].port: 15012 -> 15013
1 changed, 0 added, 0 removed (2 objects in both sets).
`, out)

	// The ClusterRole moved from v1 to v1beta1: the same object, whose
	// apiVersion changed.
	_, out = compare(t, manifestdiff.Options{Select: patterns(t, "*.rbac.authorization.k8s.io:*:*,ServiceAccount::*")})
	require.Equal(t, `~ ClusterRole.rbac.authorization.k8s.io::reader
    apiVersion: "rbac.authorization.k8s.io/v1" -> "rbac.authorization.k8s.io/v1beta1"
1 changed, 0 added, 0 removed (1 objects in both sets).
`, out)

	res, out := compare(t, manifestdiff.Options{Select: patterns(t, "Service:other:*")})
	require.True(t, res.Equal(), out)
	require.Equal(t, "No differences (1 objects compared).\n", out)

	res, _ = compare(t, manifestdiff.Options{Select: patterns(t, "Deployment.apps:isthmus-*:*")})
	require.Equal(t, []string{"Deployment.apps:isthmus-system:isthmusd"}, ids(res.Added))
	require.Empty(t, res.Removed)
}

// TestIgnore drops the matching objects from both sets.
func TestIgnore(t *testing.T) {
	res, out := compare(t, manifestdiff.Options{Ignore: patterns(t, "Deployment:*:*,ConfigMap:isthmus-system:mesh,ServiceAccount:*:*,ClusterRole::reader")})
	require.Equal(t, `~ Service:isthmus-system:isthmusd
    spec.ports[name=grpc].port: 15012 -> 15013
1 changed, 0 added, 0 removed (2 objects in both sets).
`, out)
	require.Len(t, res.Changed, 1)

	res, _ = compare(t, manifestdiff.Options{Ignore: patterns(t, "*:*:*")})
	require.True(t, res.Equal())
}

func TestDuplicatesAndBadPatterns(t *testing.T) {
	dup := "apiVersion: v1\nkind: Service\nmetadata: {name: a, namespace: ns1}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: a, namespace: ns1}\n"
	_, err := manifestdiff.Compare(load(t, dup), nil, manifestdiff.Options{})
	require.ErrorContains(t, err, "first set: Service:ns1:a appears twice: set:1 and set:2")
	for _, bad := range []string{"Service", "Service:ns", ":ns:name", "Service:ns:", "Service:[:x"} {
		_, err := manifestdiff.ParsePattern(bad)
		require.Error(t, err, bad)
	}
}

func ids(in []manifestdiff.ID) []string {
	var out []string
	for _, id := range in {
		out = append(out, id.String())
	}
	return out
}
