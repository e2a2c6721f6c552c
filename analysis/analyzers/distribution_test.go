package analyzers_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/analysis"
	"github.com/isthmus-mesh/isthmus/analysis/analyzers"
	"github.com/isthmus-mesh/isthmus/analysis/msg"
	"github.com/isthmus-mesh/isthmus/controller"
)

// TestTrafficDistribution: an annotation pilot ignores is reported where it
// is, with what applies instead; a federated service whose clusters set
// different preferences is reported on its oldest definition; the
// Namespace's annotation counts as pilot counts it; agreeing clusters are
// not reported.
func TestTrafficDistribution(t *testing.T) {
	annotated := func(s *corev1.Service, a map[string]string) *corev1.Service { s.Annotations = a; return s }
	zone := corev1.ServiceTrafficDistributionPreferSameZone
	withField := func(s *corev1.Service) *corev1.Service { s.Spec.TrafficDistribution = &zone; return s }
	nsZone := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "z", Annotations: map[string]string{controller.TrafficDistributionAnnotation: "PreferClose"}}}
	snap := &analysis.Snapshot{Mesh: mesh(), Clusters: []*analysis.Cluster{
		{ID: "a", Namespaces: []*corev1.Namespace{nsZone}, Services: []*corev1.Service{
			annotated(withField(service("x", "typo", t0)), map[string]string{controller.RoutingPreferenceAnnotation: "ZONE,NETWROK"}),
			withField(service("x", "split", t0)),
			withField(service("x", "same", t0)),
			service("z", "inherits", t0),
		}},
		{ID: "b", Services: []*corev1.Service{
			annotated(service("x", "split", t0.Add(1)), map[string]string{controller.RoutingPreferenceAnnotation: "NONE"}),
			withField(service("x", "same", t0)),
			withField(service("z", "inherits", t0)),
		}},
	}}
	msgs := analyzers.TrafficDistribution{}.Analyze(snap)
	require.Equal(t, []string{"ISM0020 Service/x/split a", "ISM0019 Service/x/typo a"}, codes(msgs))
	require.Equal(t, msg.Info, msgs[0].Type.Level)
	require.Equal(t, "clusters set different routing preferences (a: FAILOVER:NETWORK,CLUSTER,REGION,ZONE; b: no preference); "+
		"each cluster's clients follow their own cluster's, other clusters' follow cluster a's (the oldest definition)", msgs[0].Text())
	require.Equal(t, msg.Warning, msgs[1].Type.Level)
	require.Contains(t, msgs[1].Text(), `"NETWROK" is not a scope`)
	require.Contains(t, msgs[1].Text(), "routing preference in this cluster is FAILOVER:NETWORK,CLUSTER,REGION,ZONE")
	require.Contains(t, analyzers.All(), analysis.Analyzer(analyzers.TrafficDistribution{}))

	// A bad Namespace annotation is reported on each Service it would apply to.
	nsZone.Annotations[controller.TrafficDistributionAnnotation] = "Nearby"
	msgs = analyzers.TrafficDistribution{}.Analyze(snap)
	require.Equal(t, []string{"ISM0020 Service/x/split a", "ISM0019 Service/x/typo a", "ISM0019 Service/z/inherits a", "ISM0020 Service/z/inherits a"}, codes(msgs))
	require.Contains(t, msgs[2].Text(), `namespace annotation networking.istio.io/traffic-distribution: "Nearby"`)
	require.Contains(t, msgs[2].Text(), "is the default order")
}
