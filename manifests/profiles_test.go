package manifests_test

import (
	"encoding/json"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/releaseutil"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// profiles are the profile names every chart knows.
var profiles = []string{"default", "demo", "remote"}

// dumpTemplate renders the values the chart's templates see, after the
// profile merge (templates/zzz_profile.yaml is rendered before it: Helm
// renders a chart's templates in reverse name order).
const dumpTemplate = `apiVersion: v1
kind: ConfigMap
metadata:
  name: values-dump
data:
  values.json: {{ toJson .Values | quote }}
`

// effectiveValues installs chart dir (dry run, client only, schema
// checked) with values and returns the values its templates saw.
func effectiveValues(t *testing.T, dir string, values map[string]any) (map[string]any, error) {
	t.Helper()
	ch, err := loader.Load(dir)
	require.NoError(t, err)
	ch.Templates = append(ch.Templates, &chart.File{Name: "templates/aaa_values_dump.yaml", Data: []byte(dumpTemplate)})
	inst := action.NewInstall(&action.Configuration{Log: func(string, ...any) {}})
	inst.DryRun, inst.ClientOnly, inst.ReleaseName, inst.Namespace = true, true, "r", namespace
	rel, err := inst.Run(ch, values)
	if err != nil {
		return nil, err
	}
	for _, doc := range releaseutil.SplitManifests(rel.Manifest) {
		var cm corev1.ConfigMap
		if yaml.Unmarshal([]byte(doc), &cm) == nil && cm.Kind == "ConfigMap" && cm.Name == "values-dump" {
			var out map[string]any
			require.NoError(t, json.Unmarshal([]byte(cm.Data["values.json"]), &out))
			return out, nil
		}
	}
	t.Fatalf("chart %s: no values dump rendered", dir)
	return nil, nil
}

// sep separates the keys of a path (keys hold dots and slashes).
const sep = "|"

// leaves returns the paths of m's non-map values; lists and empty maps are
// leaves.
func leaves(m map[string]any, prefix string, out map[string]any) map[string]any {
	for k, v := range m {
		if sub, ok := v.(map[string]any); ok && len(sub) > 0 {
			leaves(sub, prefix+k+sep, out)
			continue
		}
		out[prefix+k] = v
	}
	return out
}

// at returns the value at path in m (nil when absent).
func at(m map[string]any, path string) any {
	var cur any = m
	for p := range strings.SplitSeq(path, sep) {
		mm, ok := cur.(map[string]any)
		if !ok {
			return nil
		}
		cur = mm[p]
	}
	return cur
}

// nested builds {a: {b: v}} from path a|b.
func nested(path string, v any) map[string]any {
	parts := strings.Split(path, sep)
	out := map[string]any{parts[len(parts)-1]: v}
	for i := len(parts) - 2; i >= 0; i-- {
		out = map[string]any{parts[i]: out}
	}
	return out
}

// mergeInto merges src into dst (maps deeply).
func mergeInto(dst, src map[string]any) {
	for k, v := range src {
		if sm, ok := v.(map[string]any); ok {
			if dm, ok := dst[k].(map[string]any); ok {
				mergeInto(dm, sm)
				continue
			}
		}
		dst[k] = v
	}
}

// chartProfile returns the chart's defaults and profile p's settings (a
// "fail" message aside).
func chartProfile(t *testing.T, dir, p string) (defaults, settings map[string]any, fail string) {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(dir, "values.yaml"))
	require.NoError(t, err)
	var vals map[string]any
	require.NoError(t, yaml.Unmarshal(raw, &vals))
	require.Equal(t, "default", vals["profile"], "chart %s: the default profile is default", dir)
	require.Equal(t, []string{"defaults", "profile"}, slices.Sorted(maps.Keys(vals)), "chart %s: values.yaml holds only profile and defaults", dir)
	defaults = vals["defaults"].(map[string]any)
	raw, err = os.ReadFile(filepath.Join(dir, "files", "profiles", p+".yaml"))
	require.NoError(t, err, "chart %s has profile %s", dir, p)
	require.NoError(t, yaml.Unmarshal(raw, &settings))
	if settings == nil {
		settings = map[string]any{}
	}
	if f, ok := settings["fail"].(string); ok {
		delete(settings, "fail")
		fail = f
	}
	return defaults, settings, fail
}

// required are the values a chart cannot render without under a profile
// (the remote profile clears clusterID and asks for pilot's address).
func required(c, p string) map[string]any {
	if p == "remote" && (c == "ztunnel" || c == "eastwest-gateway") {
		return map[string]any{"clusterID": "cluster-9", "xdsAddress": "pilot.example:15012"}
	}
	return map[string]any{}
}

// explicitOverDefault is, per chart, one explicit value that differs from
// the chart's default.
var explicitOverDefault = map[string]map[string]any{
	"base":             {"namespace": map[string]any{"network": "net-x"}},
	"pilot":            {"network": "net-x"},
	"remote":           {"serviceAccount": map[string]any{"annotations": map[string]any{"a": "b"}}},
	"ztunnel":          {"network": "net-x"},
	"eastwest-gateway": {"network": "net-x"},
	"cni":              {"logLevel": "warn"},
}

// TestProfilePrecedence renders every chart with every profile and checks
// the rule: the profile's settings beat the chart's defaults, everything
// else keeps its default, and an explicit value beats both (an explicit
// value equal to the default, false included, beats a profile that
// changes it).
func TestProfilePrecedence(t *testing.T) {
	for _, c := range charts {
		for _, p := range profiles {
			t.Run(c+"/"+p, func(t *testing.T) {
				defaults, settings, fail := chartProfile(t, c, p)
				base := required(c, p)
				base["profile"] = p
				got, err := effectiveValues(t, c, base)
				if fail != "" {
					require.ErrorContains(t, err, fail)
					return
				}
				require.NoError(t, err)
				require.Equal(t, p, got["profile"])
				require.NotContains(t, got, "defaults", "templates see the merged values only")

				set := leaves(settings, "", map[string]any{})
				for path, v := range set {
					if at(base, path) != nil {
						continue
					}
					require.Equal(t, v, at(got, path), "%s: the profile beats the default", path)
					require.NotEqual(t, at(defaults, path), v, "%s: profile %s changes the default", path, p)
				}
				for path, v := range leaves(defaults, "", map[string]any{}) {
					if _, inProfile := set[path]; inProfile || at(base, path) != nil {
						continue
					}
					require.Equal(t, v, at(got, path), "%s keeps the chart default", path)
				}

				// Explicit values: the defaults of everything the profile
				// sets, and one value that differs from its default.
				explicit := map[string]any{"profile": p}
				mergeInto(explicit, required(c, p))
				for path := range set {
					mergeInto(explicit, nested(path, at(defaults, path)))
				}
				mergeInto(explicit, explicitOverDefault[c])
				if c == "ztunnel" || c == "eastwest-gateway" {
					// xdsAddressRequired=false given explicitly: no address needed.
					delete(explicit, "xdsAddress")
				}
				got, err = effectiveValues(t, c, explicit)
				require.NoError(t, err)
				for path, v := range leaves(explicit, "", map[string]any{}) {
					require.Equal(t, v, at(got, path), "%s: the explicit value beats the profile and the default", path)
				}
			})
		}
	}
}

// TestProfileTemplatesIdentical keeps one profile mechanism: the same
// template in every chart, the same profile names (files and schema), and
// an unknown profile refused.
func TestProfileTemplatesIdentical(t *testing.T) {
	first, err := os.ReadFile(filepath.Join(charts[0], "templates", "zzz_profile.yaml"))
	require.NoError(t, err)
	for _, c := range charts {
		tpl, err := os.ReadFile(filepath.Join(c, "templates", "zzz_profile.yaml"))
		require.NoError(t, err)
		require.Equal(t, string(first), string(tpl), "chart %s", c)
		files, err := filepath.Glob(filepath.Join(c, "files", "profiles", "*.yaml"))
		require.NoError(t, err)
		var names []string
		for _, f := range files {
			names = append(names, strings.TrimSuffix(filepath.Base(f), ".yaml"))
		}
		require.ElementsMatch(t, profiles, names, "chart %s", c)
		raw, err := os.ReadFile(filepath.Join(c, "values.schema.json"))
		require.NoError(t, err)
		var schema struct {
			Properties map[string]struct {
				Enum []string `json:"enum"`
			} `json:"properties"`
		}
		require.NoError(t, json.Unmarshal(raw, &schema))
		require.ElementsMatch(t, profiles, schema.Properties["profile"].Enum, "chart %s schema", c)
		_, err = install(t, c, map[string]any{"profile": "tiny"})
		require.ErrorContains(t, err, "/profile", "chart %s", c)
	}
}

// TestProfilesRendered checks what the profiles change in the objects: the
// demo east-west gateway has one replica and no PodDisruptionBudget unless
// asked; under the remote profile the gateways need pilot's address.
func TestProfilesRendered(t *testing.T) {
	objs := render(t, "eastwest-gateway", namespace, map[string]any{"profile": "demo"})
	require.Equal(t, int32(1), *convert[appsv1.Deployment](t, find(t, objs, "Deployment", "isthmus-eastwestgateway")).Spec.Replicas)
	require.NotContains(t, kinds(objs), "PodDisruptionBudget/isthmus-eastwestgateway")
	objs = render(t, "eastwest-gateway", namespace, map[string]any{"profile": "demo", "replicaCount": 3, "podDisruptionBudget": map[string]any{"enabled": true}})
	require.Equal(t, int32(3), *convert[appsv1.Deployment](t, find(t, objs, "Deployment", "isthmus-eastwestgateway")).Spec.Replicas)
	require.Contains(t, kinds(objs), "PodDisruptionBudget/isthmus-eastwestgateway")

	for _, c := range []string{"ztunnel", "eastwest-gateway"} {
		_, err := install(t, c, map[string]any{"profile": "remote", "clusterID": "cluster-2"})
		require.ErrorContains(t, err, "xdsAddress is required", "chart %s", c)
		_, err = install(t, c, map[string]any{"profile": "remote", "xdsAddress": "pilot.example:15012"})
		require.ErrorContains(t, err, "clusterID is required", "chart %s", c)
	}
	_, err := install(t, "pilot", map[string]any{"profile": "remote"})
	require.ErrorContains(t, err, "pilot does not run in a remote cluster")
}
