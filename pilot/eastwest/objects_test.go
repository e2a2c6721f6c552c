package eastwest

import (
	"encoding/json"
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/releaseutil"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	gwv1 "sigs.k8s.io/gateway-api/apis/v1"
	"sigs.k8s.io/yaml"
)

// renderChart renders the eastwest-gateway chart (client only) and
// returns its Deployment and Service.
func renderChart(t *testing.T, ns string, values map[string]any) (*appsv1.Deployment, *corev1.Service) {
	t.Helper()
	ch, err := loader.Load("../../manifests/eastwest-gateway")
	require.NoError(t, err)
	inst := action.NewInstall(&action.Configuration{Log: func(string, ...any) {}})
	inst.DryRun, inst.ClientOnly, inst.Replace = true, true, true
	inst.ReleaseName, inst.Namespace = "eastwest", ns
	rel, err := inst.Run(ch, values)
	require.NoError(t, err)
	var dep *appsv1.Deployment
	var svc *corev1.Service
	for _, doc := range releaseutil.SplitManifests(rel.Manifest) {
		var tm metav1.TypeMeta
		require.NoError(t, yaml.Unmarshal([]byte(doc), &tm))
		switch tm.Kind {
		case "Deployment":
			dep = &appsv1.Deployment{}
			require.NoError(t, yaml.Unmarshal([]byte(doc), dep))
		case "Service":
			svc = &corev1.Service{}
			require.NoError(t, yaml.Unmarshal([]byte(doc), svc))
		}
	}
	require.NotNil(t, dep)
	require.NotNil(t, svc)
	return dep, svc
}

// typed converts an apply configuration into its API type.
func typed[T any](t *testing.T, ac any) *T {
	t.Helper()
	b, err := json.Marshal(ac)
	require.NoError(t, err)
	var out T
	require.NoError(t, json.Unmarshal(b, &out))
	return &out
}

// TestDeploymentMirrorsChart proves a Gateway is deployed as the
// eastwest-gateway chart deploys a gateway: the same container (image
// aside), arguments, ports, environment, probe, security context and
// volumes, and the same Service port; pilot adds only the gateway's
// namespace and pilot's certificate name to the arguments.
func TestDeploymentMirrorsChart(t *testing.T) {
	passthrough := gwv1.TLSModePassthrough
	for _, tc := range []struct {
		name      string
		listeners []gwv1.Listener
		values    map[string]any
	}{
		{"HBONE only, as the chart's default", nil, nil},
		{"with a TLS Passthrough listener on 15443, as tlsPassthrough=true", []gwv1.Listener{
			{Name: "tls", Port: TLSPassthroughPort, Protocol: gwv1.TLSProtocolType, TLS: &gwv1.ListenerTLSConfig{Mode: &passthrough}},
		}, map[string]any{"tlsPassthrough": true}},
	} {
		t.Run(tc.name, func(t *testing.T) { mirrorsChart(t, tc.listeners, tc.values) })
	}
}

// mirrorsChart compares the objects of a Gateway with listeners with the
// chart rendered with values.
func mirrorsChart(t *testing.T, listeners []gwv1.Listener, values map[string]any) {
	const ns = "isthmus-system"
	gw := &gwv1.Gateway{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "eastwest", UID: "u1"}, Spec: gwv1.GatewaySpec{Listeners: listeners}}
	cfg := Config{Namespace: ns, Image: "registry.test/ztunnel:1"}.withDefaults()
	objs := build(cfg, "cluster-2", gw, "network-2")
	dep := typed[appsv1.Deployment](t, objs.deployment)
	svc := typed[corev1.Service](t, objs.service)
	vals := map[string]any{"network": "network-2", "clusterID": "cluster-2", "name": objs.name}
	maps.Copy(vals, values)
	chartDep, chartSvc := renderChart(t, ns, vals)

	got, want := dep.Spec.Template.Spec.Containers[0], chartDep.Spec.Template.Spec.Containers[0]
	var extra []string
	for _, a := range got.Args {
		if !slices.Contains(want.Args, a) {
			extra = append(extra, a)
		}
	}
	require.ElementsMatch(t, []string{"--namespace=" + ns, "--xds-server-name=isthmusd." + ns + ".svc", "--ca-server-name=isthmusd." + ns + ".svc"}, extra)
	for _, a := range want.Args {
		require.Contains(t, got.Args, a, "the chart's argument %s", a)
	}
	require.Equal(t, want.Name, got.Name)
	require.Equal(t, want.Ports, got.Ports)
	require.Equal(t, want.Env, got.Env)
	require.Equal(t, want.VolumeMounts, got.VolumeMounts)
	require.Equal(t, want.SecurityContext, got.SecurityContext)
	require.True(t, apiequality.Semantic.DeepEqual(want.Resources, got.Resources), "resources %v, chart %v", got.Resources, want.Resources)
	require.Equal(t, want.ReadinessProbe, got.ReadinessProbe)
	require.Equal(t, chartDep.Spec.Template.Spec.Volumes, dep.Spec.Template.Spec.Volumes)
	require.Equal(t, chartDep.Spec.Template.Spec.ServiceAccountName, dep.Spec.Template.Spec.ServiceAccountName)
	require.Equal(t, chartDep.Spec.Template.Spec.TerminationGracePeriodSeconds, dep.Spec.Template.Spec.TerminationGracePeriodSeconds, "the drain's grace period")
	require.Equal(t, chartDep.Spec.Strategy, dep.Spec.Strategy, "a new gateway is Ready before an old one stops")
	require.Equal(t, chartDep.Spec.Template.Annotations, dep.Spec.Template.Annotations)
	require.Equal(t, chartSvc.Spec.Ports, svc.Spec.Ports)
	require.Equal(t, chartSvc.Spec.Type, svc.Spec.Type)
	require.Equal(t, "network-2", svc.Labels[NetworkLabel], "discovery finds the network's gateway by this label")
	require.Equal(t, objs.name, svc.Annotations[gatewayServiceAccountsAnnotation], "clients verify the gateway as its own ServiceAccount")
	for _, o := range []metav1.Object{dep, svc, typed[corev1.ServiceAccount](t, objs.serviceAccount)} {
		require.Len(t, o.GetOwnerReferences(), 1)
		require.Equal(t, gw.UID, o.GetOwnerReferences()[0].UID, "%s is owned by the Gateway", o.GetName())
	}
}

// TestObjectName keeps names DNS labels: the Gateway's name and the class,
// or a hashed prefix of them when longer than 63 characters.
func TestObjectName(t *testing.T) {
	require.Equal(t, "eastwest-isthmus-east-west", ObjectName("eastwest"))
	long := strings.Repeat("g", 60)
	n := ObjectName(long)
	require.Len(t, n, 63)
	require.NotEqual(t, n, ObjectName(long+"x"), "different Gateways, different names")
	require.Equal(t, n, ObjectName(long), "stable")
}

// TestValidate covers why a Gateway of the class is refused.
func TestValidate(t *testing.T) {
	hbone := []gwv1.Listener{{Name: "hbone", Port: HBONEPort, Protocol: HBONEProtocol}}
	gw := func(network string, ls []gwv1.Listener, addrs ...gwv1.GatewaySpecAddress) *gwv1.Gateway {
		g := &gwv1.Gateway{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "g"}, Spec: gwv1.GatewaySpec{Listeners: ls, Addresses: addrs}}
		if network != "" {
			g.Labels = map[string]string{NetworkLabel: network}
		}
		return g
	}
	for name, tc := range map[string]struct {
		gw      *gwv1.Gateway
		trusted bool
		reason  gwv1.GatewayConditionReason
	}{
		"served":              {gw("n", hbone), true, gwv1.GatewayReasonAccepted},
		"untrusted namespace": {gw("n", hbone), false, ReasonUntrustedNamespace},
		"no network":          {gw("", hbone), true, gwv1.GatewayReasonInvalid},
		"addresses":           {gw("n", hbone, gwv1.GatewaySpecAddress{Value: "10.0.0.1"}), true, gwv1.GatewayReasonUnsupportedAddress},
		"no HBONE listener":   {gw("n", []gwv1.Listener{{Name: "tls", Port: 443, Protocol: gwv1.TLSProtocolType}}), true, gwv1.GatewayReasonListenersNotValid},
		"HBONE on another port": {gw("n", []gwv1.Listener{{Name: "h", Port: 15009, Protocol: HBONEProtocol}}), true,
			gwv1.GatewayReasonListenersNotValid},
	} {
		t.Run(name, func(t *testing.T) {
			v := validate(tc.gw, tc.trusted)
			require.Equal(t, tc.reason, v.reason)
			require.Equal(t, tc.reason == gwv1.GatewayReasonAccepted, v.accepted)
		})
	}
}

// TestValidateTLSPassthroughListener: a TLS listener on 15443 in
// Passthrough mode is the gateway's SNI passthrough port, served beside the
// HBONE listener; another TLS listener (another port, or terminating) is
// not; without an HBONE listener the Gateway is still refused.
func TestValidateTLSPassthroughListener(t *testing.T) {
	passthrough, terminate := gwv1.TLSModePassthrough, gwv1.TLSModeTerminate
	hbone := gwv1.Listener{Name: "hbone", Port: HBONEPort, Protocol: HBONEProtocol}
	tlsL := func(port gwv1.PortNumber, mode *gwv1.TLSModeType) gwv1.Listener {
		return gwv1.Listener{Name: "tls", Port: port, Protocol: gwv1.TLSProtocolType, TLS: &gwv1.ListenerTLSConfig{Mode: mode}}
	}
	gw := func(ls ...gwv1.Listener) *gwv1.Gateway {
		return &gwv1.Gateway{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "g", Labels: map[string]string{NetworkLabel: "n"}},
			Spec: gwv1.GatewaySpec{Listeners: ls}}
	}
	v := validate(gw(hbone, tlsL(TLSPassthroughPort, &passthrough)), true)
	require.True(t, v.accepted)
	require.Equal(t, 0, v.hbone)
	require.Equal(t, 1, v.tls)
	for name, l := range map[string]gwv1.Listener{
		"other port":  tlsL(443, &passthrough),
		"terminating": tlsL(TLSPassthroughPort, &terminate),
		"no mode":     tlsL(TLSPassthroughPort, nil),
	} {
		v := validate(gw(hbone, l), true)
		require.True(t, v.accepted, name)
		require.Equal(t, -1, v.tls, name)
	}
	v = validate(gw(tlsL(TLSPassthroughPort, &passthrough)), true)
	require.False(t, v.accepted)
	require.Equal(t, gwv1.GatewayReasonListenersNotValid, v.reason)
}
