package manifests_test

import (
	"context"
	"fmt"
	"maps"
	"os"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/releaseutil"
	admissionv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"sigs.k8s.io/yaml"

	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/pilot/mcs"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

var clusters *framework.ClusterSet

func TestMain(m *testing.M) {
	os.Exit(framework.Main(m, framework.Options{Names: []string{"charts"}}, &clusters))
}

const namespace = "isthmus-system"

// render renders chart dir as `helm install --dry-run` (client only) would,
// into namespace, and returns the objects in manifest order.
func render(t *testing.T, dir, ns string, values map[string]any) []*unstructured.Unstructured {
	t.Helper()
	ch, err := loader.Load(dir)
	require.NoError(t, err, "load chart %s", dir)
	inst := action.NewInstall(&action.Configuration{Log: func(string, ...any) {}})
	inst.DryRun, inst.ClientOnly, inst.Replace = true, true, true
	inst.ReleaseName, inst.Namespace = "isthmus-"+strings.ReplaceAll(dir, "/", "-"), ns
	kv, err := chartutil.ParseKubeVersion(serverVersion(t))
	require.NoError(t, err)
	inst.KubeVersion = kv
	rel, err := inst.Run(ch, values)
	require.NoError(t, err, "render chart %s", dir)

	docs := releaseutil.SplitManifests(rel.Manifest)
	keys := make([]string, 0, len(docs))
	for k := range docs {
		keys = append(keys, k)
	}
	sort.Sort(releaseutil.BySplitManifestsOrder(keys))
	var out []*unstructured.Unstructured
	for _, k := range keys {
		m := map[string]any{}
		require.NoError(t, yaml.Unmarshal([]byte(docs[k]), &m), "chart %s: document %s", dir, docs[k])
		if len(m) == 0 {
			continue
		}
		out = append(out, &unstructured.Unstructured{Object: m})
	}
	return out
}

func serverVersion(t *testing.T) string {
	t.Helper()
	v, err := clusters.Clusters[0].Client.Discovery().ServerVersion()
	require.NoError(t, err)
	return v.GitVersion
}

// applier applies objects with server-side apply to the test cluster.
type applier struct {
	dyn    dynamic.Interface
	mapper meta.RESTMapper
}

func newApplier(t *testing.T, cfg *rest.Config) *applier {
	t.Helper()
	dc, err := discovery.NewDiscoveryClientForConfig(cfg)
	require.NoError(t, err)
	dyn, err := dynamic.NewForConfig(cfg)
	require.NoError(t, err)
	return &applier{dyn: dyn, mapper: restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))}
}

// apply server-side applies obj with strict field validation (unknown or
// duplicate fields are errors), as a dry run when dryRun is set.
func (a *applier) apply(ctx context.Context, obj *unstructured.Unstructured, dryRun bool) error {
	gvk := obj.GroupVersionKind()
	m, err := a.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		return fmt.Errorf("%s %s: no API resource: %w", gvk, obj.GetName(), err)
	}
	var ri dynamic.ResourceInterface = a.dyn.Resource(m.Resource)
	if m.Scope.Name() == meta.RESTScopeNameNamespace {
		if obj.GetNamespace() == "" {
			return fmt.Errorf("%s %s: namespaced object without a namespace", gvk.Kind, obj.GetName())
		}
		ri = a.dyn.Resource(m.Resource).Namespace(obj.GetNamespace())
	} else if obj.GetNamespace() != "" {
		return fmt.Errorf("%s %s: cluster-scoped object with namespace %q", gvk.Kind, obj.GetName(), obj.GetNamespace())
	}
	body, err := obj.MarshalJSON()
	if err != nil {
		return err
	}
	opts := metav1.PatchOptions{FieldManager: "charts-test", Force: new(true), FieldValidation: "Strict"}
	if dryRun {
		opts.DryRun = []string{metav1.DryRunAll}
	}
	if _, err := ri.Patch(ctx, obj.GetName(), types.ApplyPatchType, body, opts); err != nil {
		return fmt.Errorf("apply %s %s/%s: %w", gvk.Kind, obj.GetNamespace(), obj.GetName(), err)
	}
	return nil
}

func kinds(objs []*unstructured.Unstructured) []string {
	var out []string
	for _, o := range objs {
		out = append(out, o.GetKind()+"/"+o.GetName())
	}
	slices.Sort(out)
	return out
}

func find(t *testing.T, objs []*unstructured.Unstructured, kind, name string) *unstructured.Unstructured {
	t.Helper()
	for _, o := range objs {
		if o.GetKind() == kind && o.GetName() == name {
			return o
		}
	}
	require.Failf(t, "object not rendered", "%s/%s not in %v", kind, name, kinds(objs))
	return nil
}

func convert[T any](t *testing.T, u *unstructured.Unstructured) *T {
	t.Helper()
	out := new(T)
	require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, out))
	return out
}

// TestChartsApplyToAPIServer renders every chart, with its defaults and with
// the value sets that switch templates on or off, and applies every object
// to a real kube-apiserver (server-side apply, dry run, strict validation).
// The base CRDs and the namespace are installed for real first, as the
// other charts' objects live in the namespace and pilot's RBAC names the
// MCS group.
func TestChartsApplyToAPIServer(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c := clusters.Clusters[0]

	base, err := loader.Load("base")
	require.NoError(t, err)
	crdNames := []string{}
	for _, f := range base.CRDObjects() {
		crdNames = append(crdNames, f.Name)
	}
	require.ElementsMatch(t, []string{"crds/multicluster.x-k8s.io_serviceexports.yaml", "crds/multicluster.x-k8s.io_serviceimports.yaml",
		"crds/security.istio.io_authorizationpolicies.yaml", "crds/security.istio.io_peerauthentications.yaml"}, crdNames,
		"the base chart ships the MCS CRDs and Istio's security CRDs in crds/")
	require.NoError(t, c.InstallCRDs("base/crds"))
	require.NoError(t, c.EnsureNamespace(ctx, namespace, nil))

	a := newApplier(t, c.Config)
	cases := []struct {
		name, chart string
		values      map[string]any
		want        []string
	}{
		{name: "base", chart: "base", want: []string{"Namespace/isthmus-system"}},
		{name: "base with network", chart: "base", values: map[string]any{"namespace": map[string]any{"network": "net-a"}},
			want: []string{"Namespace/isthmus-system"}},
		{name: "pilot", chart: "pilot", want: []string{
			"ClusterRole/isthmusd-isthmus-system", "ClusterRoleBinding/isthmusd-isthmus-system", "Deployment/isthmusd",
			"Role/isthmus-gateways-isthmus-system", "Role/isthmusd", "RoleBinding/isthmus-gateways-isthmus-system", "RoleBinding/isthmusd",
			"Service/isthmusd", "ServiceAccount/isthmusd", "ValidatingAdmissionPolicy/isthmus-imported-endpointslices-isthmus-system", "ValidatingAdmissionPolicyBinding/isthmus-imported-endpointslices-isthmus-system"}},
		{name: "pilot with PDB, network and dashboard", chart: "pilot",
			values: map[string]any{"network": "net-a", "podDisruptionBudget": map[string]any{"enabled": true},
				"dashboards": map[string]any{"enabled": true}},
			want: []string{
				"ClusterRole/isthmusd-isthmus-system", "ClusterRoleBinding/isthmusd-isthmus-system", "ConfigMap/isthmus-pilot-dashboard",
				"Deployment/isthmusd", "PodDisruptionBudget/isthmusd", "Role/isthmus-gateways-isthmus-system", "Role/isthmusd",
				"RoleBinding/isthmus-gateways-isthmus-system", "RoleBinding/isthmusd", "Service/isthmusd", "ServiceAccount/isthmusd", "ValidatingAdmissionPolicy/isthmus-imported-endpointslices-isthmus-system", "ValidatingAdmissionPolicyBinding/isthmus-imported-endpointslices-isthmus-system"}},
		{name: "pilot with exec allowlist and gateway namespaces", chart: "pilot",
			values: map[string]any{"execAllowlist": []any{map[string]any{"command": "/usr/local/bin/token-plugin", "args": []any{"get-token"}}},
				"gatewayNamespaces": []any{"isthmus-system", "edge"}, "gatewayNamespaceSelector": "isthmus.io/gateways=trusted"},
			want: []string{
				"ClusterRole/isthmusd-isthmus-system", "ClusterRoleBinding/isthmusd-isthmus-system", "ConfigMap/isthmusd-exec-allowlist", "Deployment/isthmusd",
				"Role/isthmusd", "RoleBinding/isthmusd", "Service/isthmusd", "ServiceAccount/isthmusd", "ValidatingAdmissionPolicy/isthmus-imported-endpointslices-isthmus-system", "ValidatingAdmissionPolicyBinding/isthmus-imported-endpointslices-isthmus-system"}},
		{name: "remote", chart: "remote", want: []string{
			"ClusterRole/isthmus-reader-isthmus-system", "ClusterRoleBinding/isthmus-reader-isthmus-system",
			"Role/isthmus-gateways-isthmus-system", "RoleBinding/isthmus-gateways-isthmus-system",
			"ServiceAccount/isthmus-reader-service-account", "ValidatingAdmissionPolicy/isthmus-imported-endpointslices-isthmus-system", "ValidatingAdmissionPolicyBinding/isthmus-imported-endpointslices-isthmus-system"}},
		{name: "ztunnel", chart: "ztunnel", want: []string{"DaemonSet/ztunnel", "ServiceAccount/ztunnel"}},
		{name: "ztunnel gateway mode", chart: "ztunnel", values: map[string]any{"mode": "gateway", "network": "net-a"},
			want: []string{"Deployment/ztunnel-gateway", "ServiceAccount/ztunnel"}},
		{name: "cni", chart: "cni", want: []string{
			"ClusterRole/isthmus-cni-isthmus-system", "ClusterRoleBinding/isthmus-cni-isthmus-system",
			"DaemonSet/isthmus-cni", "ServiceAccount/isthmus-cni"}},
		{name: "cni with options", chart: "cni",
			values: map[string]any{"excludedNamespaces": []any{"kube-system", "legacy"}, "redirectDNS": false, "uninstallOnExit": true,
				"ztunnelProtocol": "istio", "ztunnelMarkOnly": true},
			want: []string{
				"ClusterRole/isthmus-cni-isthmus-system", "ClusterRoleBinding/isthmus-cni-isthmus-system",
				"DaemonSet/isthmus-cni", "ServiceAccount/isthmus-cni"}},
		{name: "eastwest-gateway", chart: "eastwest-gateway", want: []string{
			"Deployment/isthmus-eastwestgateway", "PodDisruptionBudget/isthmus-eastwestgateway",
			"Service/isthmus-eastwestgateway", "ServiceAccount/isthmus-eastwestgateway"}},
	}
	t.Run("a misplaced field is refused", func(t *testing.T) {
		// The check has teeth: a template that puts a field at the wrong
		// level (here replicas under metadata) fails the dry run.
		objs := render(t, "pilot", namespace, nil)
		dep := find(t, objs, "Deployment", "isthmusd").DeepCopy()
		require.NoError(t, unstructured.SetNestedField(dep.Object, int64(2), "spec", "template", "spec", "replicas"))
		require.ErrorContains(t, a.apply(ctx, dep, true), "replicas")
	})
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			objs := render(t, tc.chart, namespace, tc.values)
			require.Equal(t, tc.want, kinds(objs))
			var errs []string
			for _, o := range objs {
				if err := a.apply(ctx, o, true); err != nil {
					errs = append(errs, err.Error())
				}
			}
			require.Empty(t, errs, "the API server refused rendered objects")
		})
	}
}

// TestChartValues checks what the templates make of the values: pilot's
// flags and probes, ztunnel's mode switch, the gateway Service pilot
// discovers, and that a bad mode is refused at render time.
func TestChartValues(t *testing.T) {
	t.Run("pilot flags and probes", func(t *testing.T) {
		objs := render(t, "pilot", namespace, map[string]any{"clusterID": "east", "network": "net-a"})
		dep := convert[appsv1.Deployment](t, find(t, objs, "Deployment", "isthmusd"))
		ctr := dep.Spec.Template.Spec.Containers[0]
		require.Equal(t, "docker.io/isthmus/pilot:0.1.0", ctr.Image)
		require.Equal(t, []string{"--namespace=isthmus-system", "--cluster-id=east", "--network=net-a",
			"--xds-addr=:15012", "--monitoring-addr=:15014", "--debug-addr=127.0.0.1:8080",
			"--trust-domain=cluster.local", "--sync-timeout=30s", "--stale-grace=0s", "--debounce-quiet=100ms", "--debounce-max=1s", "--exec-timeout=10s",
			"--log-level=info", "--log-format=json"}, ctr.Args, "no plaintext xDS by default; pilot's own defaults")
		require.Equal(t, "/readyz", ctr.ReadinessProbe.HTTPGet.Path)
		require.Equal(t, int32(15014), ctr.ReadinessProbe.HTTPGet.Port.IntVal)
		require.Equal(t, "/healthz", ctr.LivenessProbe.HTTPGet.Path)
		svc := convert[corev1.Service](t, find(t, objs, "Service", "isthmusd"))
		var ports []int32
		for _, p := range svc.Spec.Ports {
			ports = append(ports, p.Port)
		}
		require.Equal(t, []int32{15012, 15014}, ports)
		for _, e := range ctr.Env {
			require.NotEqual(t, "GOMEMLIMIT", e.Name, "no memory limit, no GOMEMLIMIT")
		}
	})
	t.Run("pilot development plaintext xDS and memory limit", func(t *testing.T) {
		objs := render(t, "pilot", namespace, map[string]any{"devPlaintextXDS": true,
			"resources": map[string]any{"limits": map[string]any{"memory": "1Gi"}}})
		dep := convert[appsv1.Deployment](t, find(t, objs, "Deployment", "isthmusd"))
		ctr := dep.Spec.Template.Spec.Containers[0]
		require.Contains(t, ctr.Args, "--xds-plaintext-addr=:15010")
		svc := convert[corev1.Service](t, find(t, objs, "Service", "isthmusd"))
		require.Equal(t, "grpc-xds", svc.Spec.Ports[0].Name)
		require.Equal(t, int32(15010), svc.Spec.Ports[0].Port)
		var limit *corev1.ResourceFieldSelector
		for _, e := range ctr.Env {
			if e.Name == "GOMEMLIMIT" {
				limit = e.ValueFrom.ResourceFieldRef
			}
		}
		require.NotNil(t, limit)
		require.Equal(t, "limits.memory", limit.Resource)
		require.Equal(t, "pilot", limit.ContainerName)
	})
	t.Run("pilot image values", func(t *testing.T) {
		objs := render(t, "pilot", namespace, map[string]any{"image": map[string]any{"registry": "reg.example", "tag": "v9"}})
		dep := find(t, objs, "Deployment", "isthmusd")
		ctrs, _, _ := unstructured.NestedSlice(dep.Object, "spec", "template", "spec", "containers")
		require.Equal(t, "reg.example/isthmus/pilot:v9", ctrs[0].(map[string]any)["image"])
	})
	t.Run("ztunnel node mode is a DaemonSet without host network", func(t *testing.T) {
		objs := render(t, "ztunnel", namespace, nil)
		ds := find(t, objs, "DaemonSet", "ztunnel")
		hn, found, _ := unstructured.NestedBool(ds.Object, "spec", "template", "spec", "hostNetwork")
		require.True(t, found)
		require.False(t, hn)
		args, _, _ := unstructured.NestedSlice(ds.Object, "spec", "template", "spec", "containers")
		require.Contains(t, args[0].(map[string]any)["args"], "--mode=node")
		require.Contains(t, args[0].(map[string]any)["args"], "--xds-address=isthmusd.isthmus-system.svc:15012")
	})
	t.Run("ztunnel access log: on by default at the documented rate, off by a value", func(t *testing.T) {
		ds := convert[appsv1.DaemonSet](t, find(t, render(t, "ztunnel", namespace, nil), "DaemonSet", "ztunnel"))
		require.Subset(t, ds.Spec.Template.Spec.Containers[0].Args, []string{"--access-log=true", "--access-log-rate=100", "--access-log-burst=200"})
		ds = convert[appsv1.DaemonSet](t, find(t, render(t, "ztunnel", namespace, map[string]any{
			"accessLog": map[string]any{"enabled": false, "rate": 0.5}}), "DaemonSet", "ztunnel"))
		require.Subset(t, ds.Spec.Template.Spec.Containers[0].Args, []string{"--access-log=false", "--access-log-rate=0.5", "--access-log-burst=200"})
	})
	t.Run("ztunnel drain: flags, and the grace period derived from them", func(t *testing.T) {
		ds := convert[appsv1.DaemonSet](t, find(t, render(t, "ztunnel", namespace, nil), "DaemonSet", "ztunnel"))
		require.Subset(t, ds.Spec.Template.Spec.Containers[0].Args, []string{"--handoff-wait=10s", "--drain-grace=30s"})
		require.Equal(t, int64(10+30+10), *ds.Spec.Template.Spec.TerminationGracePeriodSeconds)
		require.Equal(t, intstr.FromInt32(1), *ds.Spec.UpdateStrategy.RollingUpdate.MaxSurge, "the new ztunnel starts before the old one stops")

		ds = convert[appsv1.DaemonSet](t, find(t, render(t, "ztunnel", namespace, map[string]any{
			"drain": map[string]any{"handoffWaitSeconds": 5, "graceSeconds": 60}}), "DaemonSet", "ztunnel"))
		require.Subset(t, ds.Spec.Template.Spec.Containers[0].Args, []string{"--handoff-wait=5s", "--drain-grace=60s"})
		require.Equal(t, int64(75), *ds.Spec.Template.Spec.TerminationGracePeriodSeconds)
		ds = convert[appsv1.DaemonSet](t, find(t, render(t, "ztunnel", namespace, map[string]any{
			"terminationGracePeriodSeconds": 120}), "DaemonSet", "ztunnel"))
		require.Equal(t, int64(120), *ds.Spec.Template.Spec.TerminationGracePeriodSeconds, "a longer one set is kept")

		ch, err := loader.Load("ztunnel")
		require.NoError(t, err)
		inst := action.NewInstall(&action.Configuration{Log: func(string, ...any) {}})
		inst.DryRun, inst.ClientOnly, inst.ReleaseName, inst.Namespace = true, true, "z", namespace
		_, err = inst.Run(ch, map[string]any{"terminationGracePeriodSeconds": 30})
		require.ErrorContains(t, err, "terminationGracePeriodSeconds 30 is shorter than the drain")
	})
	t.Run("east-west gateway drain: a surge rollout, flags, and the grace period derived from them", func(t *testing.T) {
		vals := map[string]any{"clusterID": "c1", "network": "n1"}
		dep := convert[appsv1.Deployment](t, find(t, render(t, "eastwest-gateway", namespace, vals), "Deployment", "isthmus-eastwestgateway"))
		require.Subset(t, dep.Spec.Template.Spec.Containers[0].Args, []string{"--handoff-wait=5s", "--drain-grace=30s"})
		require.Equal(t, int64(5+30+10), *dep.Spec.Template.Spec.TerminationGracePeriodSeconds)
		require.Equal(t, intstr.FromInt32(0), *dep.Spec.Strategy.RollingUpdate.MaxUnavailable, "a new gateway is Ready before an old one stops")
		require.Equal(t, intstr.FromInt32(1), *dep.Spec.Strategy.RollingUpdate.MaxSurge)

		ch, err := loader.Load("eastwest-gateway")
		require.NoError(t, err)
		inst := action.NewInstall(&action.Configuration{Log: func(string, ...any) {}})
		inst.DryRun, inst.ClientOnly, inst.ReleaseName, inst.Namespace = true, true, "e", namespace
		_, err = inst.Run(ch, map[string]any{"clusterID": "c1", "network": "n1", "terminationGracePeriodSeconds": 20})
		require.ErrorContains(t, err, "terminationGracePeriodSeconds 20 is shorter than the drain")
	})
	t.Run("ztunnel gateway mode", func(t *testing.T) {
		objs := render(t, "ztunnel", namespace, map[string]any{"mode": "gateway", "gateway": map[string]any{"replicas": 3}})
		dep := convert[appsv1.Deployment](t, find(t, objs, "Deployment", "ztunnel-gateway"))
		require.Equal(t, int32(3), *dep.Spec.Replicas)
		require.Contains(t, dep.Spec.Template.Spec.Containers[0].Args, "--mode=gateway")
		require.NotContains(t, kinds(objs), "DaemonSet/ztunnel")
	})
	t.Run("ztunnel refuses an unknown mode", func(t *testing.T) {
		ch, err := loader.Load("ztunnel")
		require.NoError(t, err)
		inst := action.NewInstall(&action.Configuration{Log: func(string, ...any) {}})
		inst.DryRun, inst.ClientOnly, inst.ReleaseName, inst.Namespace = true, true, "z", namespace
		_, err = inst.Run(ch, map[string]any{"mode": "sidecar"})
		require.ErrorContains(t, err, `at '/mode': value must be one of 'node', 'gateway'`, "the schema refuses it before the template's own check")
	})
	t.Run("cni agent: host network, the three capabilities, the mounts its README names", func(t *testing.T) {
		objs := render(t, "cni", namespace, map[string]any{"excludedNamespaces": []any{"kube-system", "legacy"}})
		ds := convert[appsv1.DaemonSet](t, find(t, objs, "DaemonSet", "isthmus-cni"))
		spec := ds.Spec.Template.Spec
		require.True(t, spec.HostNetwork)
		require.Equal(t, corev1.DNSClusterFirstWithHostNet, spec.DNSPolicy)
		ctr := spec.Containers[0]
		sc := ctr.SecurityContext
		require.False(t, *sc.Privileged)
		require.False(t, *sc.AllowPrivilegeEscalation)
		require.True(t, *sc.ReadOnlyRootFilesystem)
		require.Equal(t, []corev1.Capability{"ALL"}, sc.Capabilities.Drop)
		require.Equal(t, []corev1.Capability{"NET_ADMIN", "SYS_ADMIN", "SYS_PTRACE"}, sc.Capabilities.Add)
		require.Equal(t, corev1.SeccompProfileTypeRuntimeDefault, sc.SeccompProfile.Type)
		require.Equal(t, "/readyz", ctr.ReadinessProbe.HTTPGet.Path)
		require.Equal(t, "/healthz", ctr.LivenessProbe.HTTPGet.Path)
		require.Equal(t, int32(15014), ctr.ReadinessProbe.HTTPGet.Port.IntVal)

		hostPaths := map[string]string{}
		for _, v := range spec.Volumes {
			require.NotNil(t, v.HostPath, "volume %s", v.Name)
			hostPaths[v.Name] = v.HostPath.Path
		}
		require.Equal(t, map[string]string{"cni-bin": "/opt/cni/bin", "cni-conf": "/etc/cni/net.d", "netns": "/var/run/netns",
			"host-proc": "/proc", "sockets": "/var/run/isthmus/cni", "state": "/var/run/isthmus/cni-state"}, hostPaths)
		mounts := map[string]corev1.VolumeMount{}
		for _, m := range ctr.VolumeMounts {
			mounts[m.Name] = m
		}
		require.Equal(t, corev1.MountPropagationHostToContainer, *mounts["netns"].MountPropagation,
			"namespaces the runtime mounts after the agent started must be visible")
		require.True(t, mounts["host-proc"].ReadOnly)
		require.Equal(t, "/var/run/isthmus/cni", mounts["sockets"].MountPath, "the plugin uses the same socket path on the node")
		require.Equal(t, "/var/run/isthmus/cni-state", mounts["state"].MountPath, "sandbox records survive the agent's restarts")
		require.False(t, mounts["state"].ReadOnly)
		for _, want := range []string{"agent", "--cni-bin-dir=/host/opt/cni/bin", "--cni-conf-dir=/host/etc/cni/net.d",
			"--plugin-socket=/var/run/isthmus/cni/plugin.sock", "--ztunnel-socket=/var/run/isthmus/cni/ztunnel.sock",
			"--netns-dir=/var/run/netns", "--proc-dir=/host/proc", "--excluded-namespaces=kube-system,legacy",
			"--state-dir=/var/run/isthmus/cni-state", "--pod-cgroup-root=/kubepods", "--pod-cgroup-root=/kubepods.slice"} {
			require.Contains(t, ctr.Args, want)
		}
		require.Contains(t, ctr.Args, "--redirect-dns", "DNS capture is on by default, as Istio's")
		off := render(t, "cni", namespace, map[string]any{"redirectDNS": false})
		offArgs := convert[appsv1.DaemonSet](t, find(t, off, "DaemonSet", "isthmus-cni")).Spec.Template.Spec.Containers[0].Args
		require.NotContains(t, offArgs, "--redirect-dns", "and can be turned off")
		require.Equal(t, "system-node-critical", spec.PriorityClassName)
		require.Equal(t, int32(0), ds.Spec.UpdateStrategy.RollingUpdate.MaxSurge.IntVal, "two agents never share a node")
	})
	t.Run("cni agent serving Istio's ztunnel (ZDS)", func(t *testing.T) {
		ctrOf := func(values map[string]any) (corev1.Container, corev1.PodSpec) {
			objs := render(t, "cni", namespace, values)
			spec := convert[appsv1.DaemonSet](t, find(t, objs, "DaemonSet", "isthmus-cni")).Spec.Template.Spec
			return spec.Containers[0], spec
		}
		ctr, spec := ctrOf(nil)
		require.NotContains(t, ctr.Args, "--ztunnel-protocol=istio", "Isthmus's protocol by default")
		require.Len(t, spec.Volumes, 6, "no Istio socket folder by default")
		ctr, spec = ctrOf(map[string]any{"ztunnelProtocol": "istio"})
		require.Contains(t, ctr.Args, "--ztunnel-protocol=istio")
		require.Contains(t, ctr.Args, "--ztunnel-socket=/var/run/ztunnel/ztunnel.sock", "Istio's path")
		require.NotContains(t, ctr.Args, "--ztunnel-socket=/var/run/isthmus/cni/ztunnel.sock")
		require.NotContains(t, ctr.Args, "--ztunnel-mark-only", "refused when its cgroup is unknown, by default")
		require.Contains(t, ctr.Args, "--plugin-socket=/var/run/isthmus/cni/plugin.sock")
		hostPaths, mounts := map[string]string{}, map[string]string{}
		for _, v := range spec.Volumes {
			hostPaths[v.Name] = v.HostPath.Path
		}
		for _, m := range ctr.VolumeMounts {
			mounts[m.Name] = m.MountPath
		}
		require.Equal(t, "/var/run/ztunnel", hostPaths["istio-ztunnel-socket"])
		require.Equal(t, "/var/run/ztunnel", mounts["istio-ztunnel-socket"])
		ctr, _ = ctrOf(map[string]any{"ztunnelProtocol": "istio", "ztunnelMarkOnly": true})
		require.Contains(t, ctr.Args, "--ztunnel-mark-only")
	})
	t.Run("east-west gateway Service", func(t *testing.T) {
		objs := render(t, "eastwest-gateway", namespace, map[string]any{"network": "net-b"})
		svc := convert[corev1.Service](t, find(t, objs, "Service", "isthmus-eastwestgateway"))
		require.Equal(t, corev1.ServiceTypeLoadBalancer, svc.Spec.Type)
		require.Equal(t, "net-b", svc.Labels["topology.istio.io/network"])
		require.Len(t, svc.Spec.Ports, 1, "HBONE only: SNI passthrough is off unless tlsPassthrough")
		require.Equal(t, "tls-hbone", svc.Spec.Ports[0].Name)
		require.Equal(t, int32(15008), svc.Spec.Ports[0].Port)
		dep := find(t, objs, "Deployment", "isthmus-eastwestgateway")
		ctrs, _, _ := unstructured.NestedSlice(dep.Object, "spec", "template", "spec", "containers")
		args := ctrs[0].(map[string]any)["args"].([]any)
		require.Contains(t, args, "--mode=gateway")
		require.Contains(t, args, "--network=net-b")
		for _, a := range args {
			require.NotContains(t, a, "--gateway-tls-addr")
		}

		// SNI passthrough for clients that cannot speak HBONE (Istio's tls
		// port), when asked for.
		objs = render(t, "eastwest-gateway", namespace, map[string]any{"network": "net-b", "tlsPassthrough": true})
		svc = convert[corev1.Service](t, find(t, objs, "Service", "isthmus-eastwestgateway"))
		require.Len(t, svc.Spec.Ports, 2)
		require.Equal(t, "tls", svc.Spec.Ports[1].Name)
		require.Equal(t, int32(15443), svc.Spec.Ports[1].Port)
		dep = find(t, objs, "Deployment", "isthmus-eastwestgateway")
		ctrs, _, _ = unstructured.NestedSlice(dep.Object, "spec", "template", "spec", "containers")
		require.Contains(t, ctrs[0].(map[string]any)["args"], "--gateway-tls-addr=0.0.0.0:15443")
	})
}

// TestRemoteChartRulesAreReaderRules keeps the remote chart and
// remotesecret.EnsureReader consistent: same names, same rules.
func TestRemoteChartRulesAreReaderRules(t *testing.T) {
	objs := render(t, "remote", namespace, nil)
	role := convert[rbacv1.ClusterRole](t, find(t, objs, "ClusterRole", "isthmus-reader-"+namespace))
	require.Equal(t, remotesecret.ReaderRules(), role.Rules)
	binding := convert[rbacv1.ClusterRoleBinding](t, find(t, objs, "ClusterRoleBinding", "isthmus-reader-"+namespace))
	require.Equal(t, rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role.Name}, binding.RoleRef)
	require.Equal(t, []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: "isthmus-reader-service-account", Namespace: namespace}}, binding.Subjects)
	requireGatewayRoles(t, objs, "isthmus-reader-service-account", namespace, []string{namespace})
	requireGatewayRoles(t, render(t, "remote", namespace, map[string]any{"gatewayNamespaces": []any{"edge", "edge-2"}}),
		"isthmus-reader-service-account", namespace, []string{"edge", "edge-2"})
}

// TestRemoteChartThenCreateRemoteSecret installs the remote chart for real
// in its own namespace, then runs what `isthmusctl create-remote-secret`
// runs there (remotesecret.EnsureReader): it adopts the chart's objects
// without changing their rules, and its token can read the cluster.
func TestRemoteChartThenCreateRemoteSecret(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := clusters.Clusters[0]
	const ns = "isthmus-remote-chart"
	require.NoError(t, c.EnsureNamespace(ctx, ns, nil))
	a := newApplier(t, c.Config)
	for _, o := range render(t, "remote", ns, nil) {
		require.NoError(t, a.apply(ctx, o, false))
	}
	token, err := remotesecret.EnsureReader(ctx, c.Client, remotesecret.ReaderOptions{Namespace: ns, TokenWait: time.Millisecond})
	require.NoError(t, err)
	role, err := c.Client.RbacV1().ClusterRoles().Get(ctx, "isthmus-reader-"+ns, metav1.GetOptions{})
	require.NoError(t, err)
	require.Equal(t, remotesecret.ReaderRules(), role.Rules)
	require.Equal(t, "Helm", role.Labels["app.kubernetes.io/managed-by"], "EnsureReader keeps the chart's labels")

	reader, err := kubernetes.NewForConfig(&rest.Config{Host: c.Host(), BearerToken: token,
		TLSClientConfig: rest.TLSClientConfig{CAData: c.CAData()}})
	require.NoError(t, err)
	_, err = reader.CoreV1().Pods("").List(ctx, metav1.ListOptions{Limit: 1})
	require.NoError(t, err, "the reader token lists pods in every namespace")
	_, err = reader.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{Limit: 1})
	require.Error(t, err, "the reader token cannot read Secrets")

	// Gateways' Deployments may be written in the gateway namespace (the
	// chart's default, the release namespace) and nowhere else.
	dryRun := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
	dep := func(namespace string) *appsv1.Deployment {
		labels := map[string]string{"app": "x"}
		return &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: "x", Namespace: namespace}, Spec: appsv1.DeploymentSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "x", Image: "x"}}}}}}
	}
	_, err = reader.AppsV1().Deployments(ns).Create(ctx, dep(ns), dryRun)
	require.NoError(t, err, "the reader deploys gateways in the gateway namespace")
	_, err = reader.AppsV1().Deployments("default").Create(ctx, dep("default"), dryRun)
	require.True(t, apierrors.IsForbidden(err), "the reader deploys nothing elsewhere: %v", err)

	// EndpointSlices: only imported ones (the chart's admission policy).
	slice := func(labels map[string]string) *discoveryv1.EndpointSlice {
		return &discoveryv1.EndpointSlice{ObjectMeta: metav1.ObjectMeta{Name: "x", Namespace: "default", Labels: labels},
			AddressType: discoveryv1.AddressTypeIPv4, Endpoints: []discoveryv1.Endpoint{{Addresses: []string{"10.9.0.1"}}}}
	}
	imported := map[string]string{discoveryv1.LabelManagedBy: mcs.SliceManagedBy, "multicluster.kubernetes.io/service-name": "x"}
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		_, err := reader.DiscoveryV1().EndpointSlices("default").Create(ctx, slice(map[string]string{discoveryv1.LabelServiceName: "kubernetes"}), dryRun)
		require.True(ct, apierrors.IsForbidden(err), "a Service's slice is refused: %v", err)
	}, 30*time.Second, 50*time.Millisecond, "the admission policy is in force")
	hijack := maps.Clone(imported)
	hijack[discoveryv1.LabelServiceName] = "kubernetes"
	_, err = reader.DiscoveryV1().EndpointSlices("default").Create(ctx, slice(hijack), dryRun)
	require.True(t, apierrors.IsForbidden(err), "an imported slice that names a Service is refused: %v", err)
	_, err = reader.DiscoveryV1().EndpointSlices("default").Create(ctx, slice(nil), dryRun)
	require.True(t, apierrors.IsForbidden(err), "a slice without labels is refused: %v", err)
	_, err = reader.DiscoveryV1().EndpointSlices("default").Create(ctx, slice(imported), dryRun)
	require.NoError(t, err, "an imported slice is allowed")
	foreign, err := c.Client.DiscoveryV1().EndpointSlices("default").Create(ctx, slice(map[string]string{discoveryv1.LabelManagedBy: "someone-else"}), metav1.CreateOptions{})
	require.NoError(t, err)
	defer func() {
		_ = c.Client.DiscoveryV1().EndpointSlices("default").Delete(context.Background(), foreign.Name, metav1.DeleteOptions{})
	}()
	err = reader.DiscoveryV1().EndpointSlices("default").Delete(ctx, foreign.Name, metav1.DeleteOptions{DryRun: []string{metav1.DryRunAll}})
	require.True(t, apierrors.IsForbidden(err), "another controller's slice cannot be deleted: %v", err)
	foreign.Labels = imported
	_, err = reader.DiscoveryV1().EndpointSlices("default").Update(ctx, foreign, metav1.UpdateOptions{DryRun: []string{metav1.DryRunAll}})
	require.True(t, apierrors.IsForbidden(err), "nor taken over: %v", err)
}

// TestSlicePolicyIsRemoteSecrets keeps the charts' admission policy for
// pilot's EndpointSlice writes equal to remotesecret.SlicePolicy (what
// create-remote-secret installs), for each chart's ServiceAccount.
func TestSlicePolicyIsRemoteSecrets(t *testing.T) {
	for chart, sa := range map[string]string{"remote": "isthmus-reader-service-account", "pilot": "isthmusd"} {
		objs := render(t, chart, namespace, nil)
		wantPolicy, wantBinding := remotesecret.SlicePolicy(namespace, sa)
		policy := convert[admissionv1.ValidatingAdmissionPolicy](t, find(t, objs, "ValidatingAdmissionPolicy", wantPolicy.Name))
		require.Equal(t, wantPolicy.Spec, policy.Spec, chart)
		binding := convert[admissionv1.ValidatingAdmissionPolicyBinding](t, find(t, objs, "ValidatingAdmissionPolicyBinding", wantBinding.Name))
		require.Equal(t, wantBinding.Spec, binding.Spec, chart)
	}
}

// TestCNIAgentRBAC installs the cni chart's RBAC for real and asks the API
// server what the agent may do: read pods and namespaces everywhere and its
// Node, write Events, and nothing else it was not given (no Secrets, no
// other writes).
func TestCNIAgentRBAC(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := clusters.Clusters[0]
	const ns = "isthmus-cni-rbac"
	require.NoError(t, c.EnsureNamespace(ctx, ns, nil))
	a := newApplier(t, c.Config)
	for _, o := range render(t, "cni", ns, nil) {
		if o.GetKind() != "DaemonSet" {
			require.NoError(t, a.apply(ctx, o, false))
		}
	}
	user := "system:serviceaccount:" + ns + ":isthmus-cni"
	allowed := func(resource, verb string) bool {
		sar := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{User: user,
			Groups:             []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"},
			ResourceAttributes: &authorizationv1.ResourceAttributes{Namespace: "app", Resource: resource, Verb: verb}}}
		res, err := c.Client.AuthorizationV1().SubjectAccessReviews().Create(ctx, sar, metav1.CreateOptions{})
		if err != nil {
			t.Errorf("SubjectAccessReview %s %s: %v", verb, resource, err) // goroutine-safe, unlike require
			return false
		}
		return res.Status.Allowed
	}
	// The API server's RBAC authorizer learns the new binding from its
	// informer: wait for the first grant before checking the others.
	require.Eventually(t, func() bool { return allowed("pods", "get") }, 30*time.Second, 50*time.Millisecond, "get pods")
	for _, r := range []string{"pods", "namespaces"} {
		for _, v := range []string{"get", "list", "watch"} {
			require.True(t, allowed(r, v), "%s %s", v, r)
		}
	}
	require.True(t, allowed("nodes", "get"))
	require.True(t, allowed("events", "create"), "Events on pods whose sandbox is not trusted")
	require.True(t, allowed("events", "patch"), "the count of a repeated Event")
	for _, denied := range [][2]string{{"secrets", "get"}, {"pods", "update"}, {"pods", "delete"}, {"nodes", "list"}, {"configmaps", "get"}, {"events", "delete"}} {
		require.False(t, allowed(denied[0], denied[1]), "%s %s must be denied", denied[1], denied[0])
	}
}

// TestPilotRBACCoversReaderRules installs the pilot chart's RBAC for real
// and asks the API server (SubjectAccessReview) whether pilot's
// ServiceAccount may do, in its own cluster, everything ReaderRules and
// GatewayRules let it do in a remote (ConfigMaps only in its namespace,
// GatewayRules in its gateway namespace), plus its own duties:
// Secrets, Leases and Events in its namespace.
func TestPilotRBACCoversReaderRules(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := clusters.Clusters[0]
	const ns = "isthmus-pilot-rbac"
	require.NoError(t, c.EnsureNamespace(ctx, ns, nil))
	a := newApplier(t, c.Config)
	for _, o := range render(t, "pilot", ns, nil) {
		switch o.GetKind() {
		case "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding":
			require.NoError(t, a.apply(ctx, o, false))
		}
	}
	type access struct{ group, resource, subresource, verb string }
	var want []access
	// GatewayRules: the chart's Role in the gateway namespace, by default
	// this release's, where the checks below ask.
	for _, r := range append(remotesecret.ReaderRules(), remotesecret.GatewayRules()...) {
		for _, g := range r.APIGroups {
			for _, res := range r.Resources {
				resource, sub, _ := strings.Cut(res, "/")
				for _, v := range r.Verbs {
					want = append(want, access{g, resource, sub, v})
				}
			}
		}
	}
	for _, v := range []string{"get", "list", "watch", "create", "update"} {
		want = append(want, access{"", "secrets", "", v})
	}
	for _, v := range []string{"get", "create", "update"} {
		want = append(want, access{"coordination.k8s.io", "leases", "", v})
	}
	want = append(want, access{"", "events", "", "create"}, access{"events.k8s.io", "events", "", "create"})

	user := "system:serviceaccount:" + ns + ":isthmusd"
	deniedNow := func() []string {
		var denied []string
		for _, w := range want {
			sar := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
				User: user, Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"},
				ResourceAttributes: &authorizationv1.ResourceAttributes{Namespace: ns, Group: w.group, Resource: w.resource,
					Subresource: w.subresource, Verb: w.verb},
			}}
			res, err := c.Client.AuthorizationV1().SubjectAccessReviews().Create(ctx, sar, metav1.CreateOptions{})
			if err != nil {
				denied = append(denied, "review failed: "+err.Error())
				continue
			}
			if !res.Status.Allowed {
				denied = append(denied, fmt.Sprintf("%s %s.%s/%s", w.verb, w.resource, w.group, w.subresource))
			}
		}
		return denied
	}
	// The API server's RBAC authorizer learns new bindings from its
	// informer: what is still denied after it caught up is missing.
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		assert.Empty(ct, deniedNow(), "pilot's chart must grant these in the config cluster")
	}, 30*time.Second, 100*time.Millisecond)

	// Secrets are readable in pilot's namespace only.
	sar := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{User: user,
		ResourceAttributes: &authorizationv1.ResourceAttributes{Namespace: "default", Resource: "secrets", Verb: "get"}}}
	res, err := c.Client.AuthorizationV1().SubjectAccessReviews().Create(ctx, sar, metav1.CreateOptions{})
	require.NoError(t, err)
	require.False(t, res.Status.Allowed, "pilot must not read Secrets outside its namespace")
}
