package controller_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"

	"github.com/isthmus-mesh/isthmus/controller"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/registry"
)

// TestLoadBalancingOfPrecedence: Isthmus's routing-preference annotation
// wins, then spec.trafficDistribution, then Istio's annotation (Istio's
// order); unknown values are ignored with an error naming the annotation,
// and what the rest of the order says still applies.
func TestLoadBalancingOfPrecedence(t *testing.T) {
	zone, node := *model.PreferSameZone(), *model.PreferSameNode()
	td := func(v string) *string { return &v }
	for _, tc := range []struct {
		name    string
		field   *string
		ann     map[string]string
		want    *model.LoadBalancing
		wantErr string
	}{
		{name: "nothing set: default order"},
		{name: "field PreferSameZone", field: td("PreferSameZone"), want: &zone},
		{name: "field PreferClose is PreferSameZone", field: td("PreferClose"), want: &zone},
		{name: "field PreferSameNode", field: td("PreferSameNode"), want: &node},
		{name: "Istio annotation, any case", ann: map[string]string{controller.TrafficDistributionAnnotation: "prefersamenode"}, want: &node},
		{name: "Istio annotation PreferClose", ann: map[string]string{controller.TrafficDistributionAnnotation: "PreferClose"}, want: &zone},
		{name: "the field wins over Istio's annotation", field: td("PreferSameZone"),
			ann: map[string]string{controller.TrafficDistributionAnnotation: "PreferSameNode"}, want: &zone},
		{name: "an unknown field value leaves the annotation", field: td("PreferSomewhere"),
			ann: map[string]string{controller.TrafficDistributionAnnotation: "PreferSameNode"}, want: &node},
		{name: "unknown Istio annotation value", ann: map[string]string{controller.TrafficDistributionAnnotation: "Any"},
			wantErr: `networking.istio.io/traffic-distribution: "Any" is none of`},
		{name: "Isthmus's annotation wins over the field", field: td("PreferSameNode"),
			ann:  map[string]string{controller.RoutingPreferenceAnnotation: "network, Cluster"},
			want: &model.LoadBalancing{Preference: []model.RoutingScope{model.RouteNetwork, model.RouteCluster}}},
		{name: "strict cluster", ann: map[string]string{controller.RoutingPreferenceAnnotation: "CLUSTER", controller.RoutingModeAnnotation: "strict"},
			want: &model.LoadBalancing{Preference: []model.RoutingScope{model.RouteCluster}, Strict: true}},
		{name: "NONE spreads evenly", field: td("PreferSameZone"), ann: map[string]string{controller.RoutingPreferenceAnnotation: "none"},
			want: &model.LoadBalancing{Preference: []model.RoutingScope{}}},
		{name: "unknown scope falls back to the field", field: td("PreferSameZone"),
			ann:  map[string]string{controller.RoutingPreferenceAnnotation: "ZONE,GALAXY"},
			want: &zone, wantErr: `networking.isthmus.io/routing-preference: "GALAXY" is not a scope`},
		{name: "repeated scope", ann: map[string]string{controller.RoutingPreferenceAnnotation: "ZONE,zone"}, wantErr: "scope ZONE listed twice"},
		{name: "empty preference", ann: map[string]string{controller.RoutingPreferenceAnnotation: ""}, wantErr: `"" is not a scope`},
		{name: "unknown mode", ann: map[string]string{controller.RoutingPreferenceAnnotation: "ZONE", controller.RoutingModeAnnotation: "sometimes"},
			wantErr: `routing-mode: "sometimes" is neither FAILOVER nor STRICT`},
		{name: "mode alone", field: td("PreferSameNode"), ann: map[string]string{controller.RoutingModeAnnotation: "STRICT"},
			want: &node, wantErr: "without networking.isthmus.io/routing-preference"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Annotations: tc.ann}, Spec: corev1.ServiceSpec{TrafficDistribution: tc.field}}
			got, err := controller.LoadBalancingOf(svc)
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
			} else {
				require.NoError(t, err)
			}
			require.Equal(t, tc.want, got)
		})
	}
}

// TestTrafficDistributionFollowsChanges: against real API servers, the
// field and both annotations reach the registry and follow changes, and a
// service defined differently in two clusters is served to each client
// cluster with its own cluster's preference (the oldest definition's for a
// cluster that has none).
func TestTrafficDistributionFollowsChanges(t *testing.T) {
	ctx := context.Background()
	f := startFederation(t, "fed-td", registry.Config{QuietPeriod: 10 * time.Millisecond}, controller.Config{})
	f.register(t, "cluster-2", "network-2")
	// The clusters are shared by the package's tests, which count what
	// they hold: leave nothing behind.
	t.Cleanup(func() {
		for _, cl := range []string{"cluster-1", "cluster-2"} {
			c := clusters.Cluster(cl).Client.CoreV1()
			_ = c.Pods("td").Delete(context.Background(), "echo-0", metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
			_ = c.Services("td").Delete(context.Background(), "echo", metav1.DeleteOptions{})
		}
	})
	deploy(t, "cluster-1", "td", "echo", "node-a", 41, 1, 1)
	const host = "echo.td.svc.cluster.local"
	c1 := clusters.Cluster("cluster-1").Client.CoreV1().Services("td")
	update := func(t *testing.T, mut func(*corev1.Service)) {
		t.Helper()
		require.NoError(t, retry.RetryOnConflict(retry.DefaultRetry, func() error {
			svc, err := c1.Get(ctx, "echo", metav1.GetOptions{})
			if err != nil {
				return err
			}
			mut(svc)
			_, err = c1.Update(ctx, svc, metav1.UpdateOptions{})
			return err
		}))
	}
	expect := func(t *testing.T, client model.ClusterID, want *model.LoadBalancing, wantErr string) {
		t.Helper()
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			s := f.reg.Service(host)
			require.NotNil(c, s)
			require.Equal(c, want.String(), s.LoadBalancingFor(client).String())
			for _, d := range s.Definitions {
				if d.Cluster == "cluster-1" {
					require.Contains(c, d.LoadBalancingError, wantErr)
					if wantErr == "" {
						require.Empty(c, d.LoadBalancingError)
					}
				}
			}
		}, 20*time.Second, 10*time.Millisecond)
	}
	zone, node := *model.PreferSameZone(), *model.PreferSameNode()
	expect(t, "cluster-1", nil, "")

	td := corev1.ServiceTrafficDistributionPreferSameZone
	update(t, func(s *corev1.Service) { s.Spec.TrafficDistribution = &td })
	expect(t, "cluster-1", &zone, "")

	update(t, func(s *corev1.Service) {
		s.Annotations = map[string]string{controller.RoutingPreferenceAnnotation: "Network,Cluster", controller.RoutingModeAnnotation: "Strict"}
	})
	expect(t, "cluster-1", &model.LoadBalancing{Preference: []model.RoutingScope{model.RouteNetwork, model.RouteCluster}, Strict: true}, "")

	update(t, func(s *corev1.Service) { s.Annotations[controller.RoutingPreferenceAnnotation] = "Network,Planet" })
	expect(t, "cluster-1", &zone, `"Planet" is not a scope`)

	update(t, func(s *corev1.Service) {
		s.Spec.TrafficDistribution = nil
		s.Annotations = map[string]string{controller.TrafficDistributionAnnotation: "PreferSameNode"}
	})
	expect(t, "cluster-1", &node, "")

	// cluster-2 defines the service too, later, with PreferSameZone: each
	// client cluster gets its own cluster's; cluster-3 (no definition) the
	// oldest's, cluster-1's.
	time.Sleep(1100 * time.Millisecond) // creation timestamps have a one-second resolution
	deploy(t, "cluster-2", "td", "echo", "node-b", 41, 2, 1)
	c2 := clusters.Cluster("cluster-2").Client.CoreV1().Services("td")
	require.NoError(t, retry.RetryOnConflict(retry.DefaultRetry, func() error {
		svc, err := c2.Get(ctx, "echo", metav1.GetOptions{})
		if err != nil {
			return err
		}
		svc.Spec.TrafficDistribution = &td
		_, err = c2.Update(ctx, svc, metav1.UpdateOptions{})
		return err
	}))
	expect(t, "cluster-2", &zone, "")
	expect(t, "cluster-1", &node, "")
	expect(t, "cluster-3", &node, "")

	update(t, func(s *corev1.Service) { delete(s.Annotations, controller.TrafficDistributionAnnotation) })
	expect(t, "cluster-1", nil, "")
	expect(t, "cluster-2", &zone, "")

	// The Namespace's Istio annotation applies to its Services that set
	// none, and follows changes; a Service's own setting wins over it.
	annotateNS := func(t *testing.T, value string) {
		t.Helper()
		nss := clusters.Cluster("cluster-1").Client.CoreV1().Namespaces()
		require.NoError(t, retry.RetryOnConflict(retry.DefaultRetry, func() error {
			n, err := nss.Get(ctx, "td", metav1.GetOptions{})
			if err != nil {
				return err
			}
			if value == "" {
				delete(n.Annotations, controller.TrafficDistributionAnnotation)
			} else {
				if n.Annotations == nil {
					n.Annotations = map[string]string{}
				}
				n.Annotations[controller.TrafficDistributionAnnotation] = value
			}
			_, err = nss.Update(ctx, n, metav1.UpdateOptions{})
			return err
		}))
	}
	annotateNS(t, "PreferSameNode")
	expect(t, "cluster-1", &node, "")
	expect(t, "cluster-2", &zone, "")
	update(t, func(s *corev1.Service) { s.Spec.TrafficDistribution = &td })
	expect(t, "cluster-1", &zone, "")
	update(t, func(s *corev1.Service) { s.Spec.TrafficDistribution = nil })
	expect(t, "cluster-1", &node, "")
	annotateNS(t, "Everywhere")
	expect(t, "cluster-1", nil, `namespace annotation networking.istio.io/traffic-distribution: "Everywhere"`)
	annotateNS(t, "")
	expect(t, "cluster-1", nil, "")
}
