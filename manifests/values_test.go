package manifests_test

import (
	"encoding/json"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/release"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/isthmus-mesh/isthmus/internal/imagebuild"
	"github.com/isthmus-mesh/isthmus/multicluster"
)

// install runs `helm install --dry-run` (client only) of chart dir with
// values and returns the release (manifest and NOTES) or the error.
func install(t *testing.T, dir string, values map[string]any) (*release.Release, error) {
	t.Helper()
	ch, err := loader.Load(dir)
	require.NoError(t, err)
	inst := action.NewInstall(&action.Configuration{Log: func(string, ...any) {}})
	inst.DryRun, inst.ClientOnly, inst.ReleaseName, inst.Namespace = true, true, "r", namespace
	return inst.Run(ch, values)
}

// projectVersion is the VERSION file: the version make build and make
// images stamp and tag.
func projectVersion(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("../VERSION")
	require.NoError(t, err)
	return strings.TrimSpace(string(b))
}

// TestChartsFollowProjectVersion: every chart's appVersion is the project
// version, and each workload's default image is the reference `make
// images` tags and `make push` pushes (docker.io/isthmus/<name>:<version>).
func TestChartsFollowProjectVersion(t *testing.T) {
	v := projectVersion(t)
	for _, c := range charts {
		ch, err := loader.Load(c)
		require.NoError(t, err)
		require.Equal(t, v, ch.Metadata.AppVersion, "chart %s", c)
	}
	ref := func(name string) string { return imagebuild.Config{Version: v}.Ref(imagebuild.Image{Name: name}) }
	pilot := convert[appsv1.Deployment](t, find(t, render(t, "pilot", namespace, nil), "Deployment", "isthmusd"))
	require.Equal(t, ref("pilot"), pilot.Spec.Template.Spec.Containers[0].Image)
	zt := convert[appsv1.DaemonSet](t, find(t, render(t, "ztunnel", namespace, nil), "DaemonSet", "ztunnel"))
	require.Equal(t, ref("ztunnel"), zt.Spec.Template.Spec.Containers[0].Image)
	gw := convert[appsv1.Deployment](t, find(t, render(t, "eastwest-gateway", namespace, nil), "Deployment", "isthmus-eastwestgateway"))
	require.Equal(t, ref("ztunnel"), gw.Spec.Template.Spec.Containers[0].Image)
	cni := convert[appsv1.DaemonSet](t, find(t, render(t, "cni", namespace, nil), "DaemonSet", "isthmus-cni"))
	require.Equal(t, ref("isthmus-cni"), cni.Spec.Template.Spec.Containers[0].Image)
	var names []string
	for _, im := range imagebuild.Images() {
		names = append(names, im.Name)
	}
	require.Subset(t, names, []string{"pilot", "ztunnel", "isthmus-cni"}, "the charts' images are built by make images")
}

// TestSchemasRefuseWrongValues: in every chart a value of the wrong type
// (or an unknown key, where the chart closes its keys) fails the install
// and the strict lint, naming the value; the defaults pass both.
func TestSchemasRefuseWrongValues(t *testing.T) {
	cases := []struct {
		chart  string
		values map[string]any
		want   string
	}{
		{"pilot", map[string]any{"replicaCount": "two"}, "/replicaCount"},
		{"pilot", map[string]any{"exportMode": "yes"}, "/exportMode"},
		{"pilot", map[string]any{"syncTimeout": 30}, "/syncTimeout"},
		{"pilot", map[string]any{"staleGrace": "forever"}, "/staleGrace"},
		{"pilot", map[string]any{"debounce": map[string]any{"quiet": true}}, "/debounce/quiet"},
		{"pilot", map[string]any{"allowedKubeconfigOptions": []any{"gcp-magic"}}, "/allowedKubeconfigOptions/0"},
		{"pilot", map[string]any{"ports": map[string]any{"xds": "15012"}}, "/ports/xds"},
		{"pilot", map[string]any{"clusterID": "Not_A_Label"}, "/clusterID"},
		{"pilot", map[string]any{"syncTimout": "1m"}, "syncTimout"},
		{"pilot", map[string]any{"dashboards": map[string]any{"enabled": "true"}}, "/dashboards/enabled"},
		{"pilot", map[string]any{"allowedKubeconfigOptions": []any{"exec"}}, "/allowedKubeconfigOptions/0"},
		{"pilot", map[string]any{"execAllowlist": []any{map[string]any{"command": "token-plugin"}}}, "/execAllowlist/0/command"},
		{"pilot", map[string]any{"execAllowlist": []any{map[string]any{"command": "/bin/p", "argz": []any{"x"}}}}, "argz"},
		{"pilot", map[string]any{"execTimeout": "soon"}, "/execTimeout"},
		{"pilot", map[string]any{"gatewayNamespaces": "gw"}, "/gatewayNamespaces"},
		{"pilot", map[string]any{"gatewayNamespaceSelector": []any{"a=b"}}, "/gatewayNamespaceSelector"},
		{"cni", map[string]any{"redirectDNS": "yes"}, "/redirectDNS"},
		{"cni", map[string]any{"pluginTimeout": "forever"}, "/pluginTimeout"},
		{"cni", map[string]any{"cniBinDir": "opt/cni/bin"}, "/cniBinDir"},
		{"cni", map[string]any{"logLevel": "verbose"}, "/logLevel"},
		{"cni", map[string]any{"socketdir": "/run"}, "socketdir"},
		{"cni", map[string]any{"ztunnelProtocol": "grpc"}, "/ztunnelProtocol"},
		{"ztunnel", map[string]any{"mode": "sidecar"}, "/mode"},
		{"ztunnel", map[string]any{"ports": map[string]any{"hbone": "15008"}}, "/ports/hbone"},
		{"eastwest-gateway", map[string]any{"replicaCount": "2"}, "/replicaCount"},
		{"eastwest-gateway", map[string]any{"service": map[string]any{"type": "Ingress"}}, "/service/type"},
		{"base", map[string]any{"namespace": map[string]any{"create": "true"}}, "/namespace/create"},
		{"remote", map[string]any{"serviceAccount": map[string]any{"name": 5}}, "/serviceAccount/name"},
	}
	for _, tc := range cases {
		t.Run(tc.chart+" "+tc.want, func(t *testing.T) {
			_, err := install(t, tc.chart, tc.values)
			require.ErrorContains(t, err, "values don't meet the specifications of the schema")
			require.ErrorContains(t, err, tc.want)

			l := action.NewLint()
			l.Strict, l.Namespace = true, namespace
			res := l.Run([]string{tc.chart}, tc.values)
			require.NotEmpty(t, res.Errors, "lint --strict accepts %v", tc.values)
		})
	}
	for _, c := range charts {
		_, err := install(t, c, nil)
		require.NoError(t, err, "chart %s with its defaults", c)
	}
}

// TestPilotOperatorValues: every pilot flag an operator needs is a value,
// rendered as its flag; the defaults are pilot's own.
func TestPilotOperatorValues(t *testing.T) {
	objs := render(t, "pilot", namespace, map[string]any{
		"clusterID": "east", "trustDomain": "mesh.example", "exportMode": true, "syncTimeout": "45s", "staleGrace": "10m",
		"debounce":                 map[string]any{"quiet": "50ms", "max": "2s"},
		"allowedKubeconfigOptions": []any{"tokenFile", "auth-provider:gcp"}, "servingSANs": []any{"pilot.example"},
		"log":                map[string]any{"level": "debug", "format": "text"},
		"discoverySelectors": []any{map[string]any{"matchLabels": map[string]any{"isthmus.io/discovery": "enabled"}}},
	})
	args := convert[appsv1.Deployment](t, find(t, objs, "Deployment", "isthmusd")).Spec.Template.Spec.Containers[0].Args
	for _, want := range []string{"--trust-domain=mesh.example", "--export-mode", "--sync-timeout=45s", "--stale-grace=10m",
		"--debounce-quiet=50ms", "--debounce-max=2s", "--allow-kubeconfig-option=tokenFile", "--allow-kubeconfig-option=auth-provider:gcp",
		"--serving-san=pilot.example", "--log-level=debug", "--log-format=text"} {
		require.Contains(t, args, want)
	}
	// An extra SAN adds to the Service's name (pilot's default, which any
	// --serving-san replaces): the cluster's ztunnels still verify pilot.
	require.Contains(t, args, "--serving-san=isthmusd."+namespace+".svc")
	const selFlag = "--discovery-selectors="
	i := slices.IndexFunc(args, func(a string) bool { return strings.HasPrefix(a, selFlag) })
	require.GreaterOrEqual(t, i, 0, "--discovery-selectors")
	sels, err := multicluster.ParseDiscoverySelectors(strings.TrimPrefix(args[i], selFlag))
	require.NoError(t, err, "pilot parses the rendered flag")
	require.Equal(t, []metav1.LabelSelector{{MatchLabels: map[string]string{"isthmus.io/discovery": "enabled"}}}, sels)
}

// TestNotes: each chart's NOTES.txt renders with the release's values and
// names the next step.
func TestNotes(t *testing.T) {
	for _, tc := range []struct {
		chart  string
		values map[string]any
		want   []string
	}{
		{"pilot", map[string]any{"clusterID": "cluster-1", "network": "network1"}, []string{
			`as cluster "cluster-1" on network "network1"`, "rollout status deployment/isthmusd",
			"helm install isthmus-ztunnel manifests/ztunnel -n isthmus-system --set clusterID=cluster-1 --set network=network1",
			"isthmusctl create-remote-secret", "port-forward deployment/isthmusd 8080:8080", "isthmusctl version", "--set dashboards.enabled=true"}},
		{"pilot", map[string]any{"dashboards": map[string]any{"enabled": true}}, []string{"ConfigMap isthmus-pilot-dashboard (grafana_dashboard=1)"}},
		{"pilot", nil, []string{"helm install isthmus-cni manifests/cni -n isthmus-system", "isthmus-remote, isthmus-cni, isthmus-ztunnel"}},
		{"ztunnel", nil, []string{"rollout status daemonset/ztunnel", "isthmusd.isthmus-system.svc:15012", "isthmus-ca-root-cert",
			"/var/run/isthmus/cni/ztunnel.sock; without that chart", "helm install isthmus-cni manifests/cni -n isthmus-system"}},
		{"ztunnel", map[string]any{"mode": "gateway"}, []string{"rollout status deployment/ztunnel-gateway"}},
		{"eastwest-gateway", map[string]any{"network": "network2"}, []string{`network "network2"`, "get service isthmus-eastwestgateway"}},
		{"base", nil, []string{"namespace isthmus-system is created", "helm install isthmus-pilot manifests/pilot", "isthmus-cni and isthmus-ztunnel"}},
		{"remote", nil, []string{"isthmusctl create-remote-secret", "--namespace isthmus-system"}},
		{"cni", nil, []string{"rollout status daemonset/isthmus-cni", "/var/run/isthmus/cni/ztunnel.sock", "never: kube-system, isthmus-system",
			"istio.io/dataplane-mode=ambient", "set uninstallOnExit=true"}},
		{"cni", map[string]any{"excludedNamespaces": []any{"legacy"}, "uninstallOnExit": true}, []string{"never: legacy)"}},
		{"cni", map[string]any{"ztunnelProtocol": "istio"}, []string{"serves ztunnel at /var/run/ztunnel/ztunnel.sock (Istio's ZDS"}},
	} {
		rel, err := install(t, tc.chart, tc.values)
		require.NoError(t, err)
		for _, w := range tc.want {
			require.Contains(t, rel.Info.Notes, w, "NOTES of %s", tc.chart)
		}
	}
	// Only a node-mode ztunnel in-pod needs the CNI agent.
	for _, values := range []map[string]any{{"mode": "gateway"}, {"inpod": map[string]any{"enabled": false}}} {
		rel, err := install(t, "ztunnel", values)
		require.NoError(t, err)
		require.NotContains(t, rel.Info.Notes, "In-pod mode", "NOTES of ztunnel with %v", values)
	}
}

// TestDashboardConfigMap: with dashboards.enabled the pilot chart ships
// dashboards/pilot.json unchanged in a ConfigMap Grafana's sidecar picks
// up; without, no ConfigMap.
func TestDashboardConfigMap(t *testing.T) {
	require.NotContains(t, kinds(render(t, "pilot", namespace, nil)), "ConfigMap/isthmus-pilot-dashboard")
	objs := render(t, "pilot", namespace, map[string]any{"dashboards": map[string]any{"enabled": true}})
	cm := convert[corev1.ConfigMap](t, find(t, objs, "ConfigMap", "isthmus-pilot-dashboard"))
	require.Equal(t, "1", cm.Labels["grafana_dashboard"])
	file, err := os.ReadFile("pilot/dashboards/pilot.json")
	require.NoError(t, err)
	require.Equal(t, strings.TrimRight(string(file), "\n"), cm.Data["isthmus-pilot.json"])
	var dash map[string]any
	require.NoError(t, json.Unmarshal([]byte(cm.Data["isthmus-pilot.json"]), &dash))
	require.Equal(t, "isthmus-pilot", dash["uid"])
}

// TestPilotGatewayNamespaces: the trusted gateway namespaces and the
// namespace selector are values rendered as pilot's flags, and absent
// (pilot's own default: its namespace) when empty.
func TestPilotGatewayNamespaces(t *testing.T) {
	args := func(values map[string]any) []string {
		objs := render(t, "pilot", namespace, values)
		return convert[appsv1.Deployment](t, find(t, objs, "Deployment", "isthmusd")).Spec.Template.Spec.Containers[0].Args
	}
	def := args(nil)
	for _, a := range def {
		require.False(t, strings.HasPrefix(a, "--gateway-namespace"), "no gateway namespace flag by default: %s", a)
	}
	got := args(map[string]any{"gatewayNamespaces": []any{"isthmus-system", "edge"}, "gatewayNamespaceSelector": "isthmus.io/gateways=trusted"})
	require.Contains(t, got, "--gateway-namespaces=isthmus-system,edge")
	require.Contains(t, got, "--gateway-namespace-selector=isthmus.io/gateways=trusted")
}

// TestPilotGatewayClass: the GatewayClass controller is on by default with
// pilot's own defaults (no flag), off with gatewayClass.enabled=false, and
// its image and xDS address are rendered as flags.
func TestPilotGatewayClass(t *testing.T) {
	args := func(values map[string]any) []string {
		objs := render(t, "pilot", namespace, values)
		return convert[appsv1.Deployment](t, find(t, objs, "Deployment", "isthmusd")).Spec.Template.Spec.Containers[0].Args
	}
	for _, a := range args(nil) {
		require.False(t, strings.HasPrefix(a, "--gateway-") || a == "--no-gateway-class", "no GatewayClass flag by default: %s", a)
	}
	require.Contains(t, args(map[string]any{"gatewayClass": map[string]any{"enabled": false}}), "--no-gateway-class")
	got := args(map[string]any{"gatewayClass": map[string]any{"image": "r.example/ztunnel:1", "xdsAddress": "pilot.example:15012", "xdsServerName": "pilot.example"}})
	require.Contains(t, got, "--gateway-image=r.example/ztunnel:1")
	require.Contains(t, got, "--gateway-xds-address=pilot.example:15012")
	require.Contains(t, got, "--gateway-xds-server-name=pilot.example")
}

// TestPilotExecAllowlist: execAllowlist becomes a ConfigMap in the file
// format pilot parses (multicluster.ParseExecAllowlist gives back the same
// rules), mounted into pilot and passed as --exec-allowlist, with a
// checksum annotation that rolls pilot when it changes; without rules
// there is no ConfigMap, mount or flag. execTimeout is --exec-timeout.
func TestPilotExecAllowlist(t *testing.T) {
	objs := render(t, "pilot", namespace, nil)
	require.NotContains(t, kinds(objs), "ConfigMap/isthmusd-exec-allowlist")
	dep := convert[appsv1.Deployment](t, find(t, objs, "Deployment", "isthmusd"))
	ctr := dep.Spec.Template.Spec.Containers[0]
	require.Contains(t, ctr.Args, "--exec-timeout=10s")
	for _, a := range ctr.Args {
		require.False(t, strings.HasPrefix(a, "--exec-allowlist"), a)
	}
	require.Empty(t, ctr.VolumeMounts)
	require.Empty(t, dep.Spec.Template.Spec.Volumes)

	rules := []any{
		map[string]any{"command": "/usr/local/bin/token-plugin", "args": []any{"get-token", "--cluster", "prod-*"}, "env": []any{"PLUGIN_PROFILE"}},
		map[string]any{"command": "/opt/aws/aws-iam-authenticator", "args": []any{"token", "-i", "*"}},
	}
	render2 := func(rules []any) ([]*unstructured.Unstructured, *appsv1.Deployment) {
		objs := render(t, "pilot", namespace, map[string]any{"execAllowlist": rules, "execTimeout": "30s"})
		return objs, convert[appsv1.Deployment](t, find(t, objs, "Deployment", "isthmusd"))
	}
	objs, dep = render2(rules)
	cm := convert[corev1.ConfigMap](t, find(t, objs, "ConfigMap", "isthmusd-exec-allowlist"))
	parsed, err := multicluster.ParseExecAllowlist([]byte(cm.Data["allowlist.yaml"]))
	require.NoError(t, err, cm.Data["allowlist.yaml"])
	require.Equal(t, []multicluster.ExecRule{
		{Command: "/usr/local/bin/token-plugin", Args: []string{"get-token", "--cluster", "prod-*"}, Env: []string{"PLUGIN_PROFILE"}},
		{Command: "/opt/aws/aws-iam-authenticator", Args: []string{"token", "-i", "*"}},
	}, parsed)
	ctr = dep.Spec.Template.Spec.Containers[0]
	require.Contains(t, ctr.Args, "--exec-allowlist=/etc/isthmus/exec-allowlist/allowlist.yaml")
	require.Contains(t, ctr.Args, "--exec-timeout=30s")
	require.Equal(t, []corev1.VolumeMount{{Name: "exec-allowlist", MountPath: "/etc/isthmus/exec-allowlist", ReadOnly: true}}, ctr.VolumeMounts)
	require.Equal(t, "isthmusd-exec-allowlist", dep.Spec.Template.Spec.Volumes[0].ConfigMap.Name)
	for _, a := range ctr.Args {
		require.NotEqual(t, "--allow-kubeconfig-option=exec", a, "pilot refuses it")
	}
	sum := dep.Spec.Template.Annotations["checksum/exec-allowlist"]
	require.Len(t, sum, 64)
	_, dep2 := render2(rules[:1])
	require.NotEqual(t, sum, dep2.Spec.Template.Annotations["checksum/exec-allowlist"], "another allowlist rolls pilot")
}
