package dashboards_test

import (
	"context"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"

	"github.com/isthmus-mesh/isthmus/internal/promread"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/test/meshtest"
)

// isthmusDashboard is Isthmus's own federation dashboard, which the pilot
// chart ships next to dashboards/pilot.json.
var isthmusDashboard = istioDashboard{Name: "isthmus-mesh", File: "../../manifests/pilot/dashboards/isthmus-mesh.json"}

// problemsNamespace holds the test's broken objects, in the config
// cluster: no traffic goes there (a deny-all policy holds it).
const problemsNamespace = "audit"

// federationProblems gives the Isthmus dashboard's problem panels
// something to show, as an operator would meet it: a remote cluster whose
// API server does not answer (cluster-3: its Secret names a closed
// loopback port), a gateway candidate outside the gateway namespaces, and
// two pods claiming one address. It waits until pilot's registry counts
// each.
func federationProblems(t *testing.T, metrics prometheus.Gatherer, c1, c2 *framework.Cluster, gatewayIP, podIP netip.Addr) {
	t.Helper()
	ctx := context.Background()
	kc, err := remotesecret.Kubeconfig("cluster-3", "https://127.0.0.1:1", c2.CAData(), "token-of-no-cluster")
	require.NoError(t, err)
	sec := remotesecret.Secret("cluster-3", meshtest.Namespace, kc)
	sec.Annotations[remotesecret.NetworkAnnotation] = "network-3"
	_, err = c1.Client.CoreV1().Secrets(meshtest.Namespace).Create(ctx, sec, metav1.CreateOptions{})
	require.NoError(t, err)

	require.NoError(t, c1.EnsureNamespace(ctx, problemsNamespace, nil))
	svc, err := c1.Client.CoreV1().Services(problemsNamespace).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "rogue-gateway", Labels: map[string]string{"topology.istio.io/network": "network-1"}},
		Spec: corev1.ServiceSpec{Type: corev1.ServiceTypeLoadBalancer, Selector: map[string]string{"app": "rogue-gateway"},
			Ports: []corev1.ServicePort{{Name: "tls-hbone", Port: 15008, TargetPort: intstr.FromInt32(15008)}}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	svc.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{{IP: gatewayIP.String()}}
	_, err = c1.Client.CoreV1().Services(problemsNamespace).UpdateStatus(ctx, svc, metav1.UpdateOptions{})
	require.NoError(t, err)

	for _, name := range []string{"twin-0", "twin-1"} {
		_, err = c1.CreatePod(ctx, framework.PodOptions{Namespace: problemsNamespace, Name: name, Labels: map[string]string{"app": "twin"},
			ServiceAccount: "twin", Node: "node-1a", IP: podIP, Ready: true})
		require.NoError(t, err)
	}

	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		for _, w := range []struct {
			metric string
			labels map[string]string
		}{
			{"isthmus_remote_cluster_state", map[string]string{"cluster_id": "cluster-3"}},
			{"isthmus_gateway_candidates", map[string]string{"cluster": "cluster-1", "status": "untrusted_namespace"}},
			{"isthmus_registry_address_conflicts", map[string]string{"reason": "duplicate-pod"}},
		} {
			v, err := promread.Value(metrics, w.metric, w.labels)
			require.NoError(ct, err)
			require.Positive(ct, v, "%s%v", w.metric, w.labels)
		}
	}, wait, 50*time.Millisecond)
}

// TestChartShipsIsthmusDashboard: with dashboards.enabled the pilot chart
// ships isthmus-mesh.json unchanged, next to pilot.json, in the ConfigMap
// Grafana's dashboard sidecar picks up.
func TestChartShipsIsthmusDashboard(t *testing.T) {
	ch, err := loader.Load("../../manifests/pilot")
	require.NoError(t, err)
	vals, err := chartutil.ToRenderValues(ch, map[string]any{"dashboards": map[string]any{"enabled": true}},
		chartutil.ReleaseOptions{Name: "isthmus", Namespace: meshtest.Namespace}, nil)
	require.NoError(t, err)
	out, err := engine.Render(ch, vals)
	require.NoError(t, err)
	var cm corev1.ConfigMap
	require.NoError(t, yaml.Unmarshal([]byte(out[ch.Name()+"/templates/dashboard.yaml"]), &cm))
	require.Equal(t, "1", cm.Labels["grafana_dashboard"])
	file, err := os.ReadFile(isthmusDashboard.File)
	require.NoError(t, err)
	require.Equal(t, strings.TrimRight(string(file), "\n"), cm.Data["isthmus-mesh.json"])
	require.Contains(t, cm.Data, "isthmus-pilot.json")
}
