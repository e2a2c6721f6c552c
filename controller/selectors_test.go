package controller_test

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/controller"
	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/registry"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// TestDiscoverySelectors, on three real clusters: the mesh-wide selector
// (mesh=on) leaves out an unlabelled namespace everywhere; cluster-2's
// Secret annotation (team=a) excludes namespace ds-b in cluster-2 only,
// while cluster-3 (no annotation) keeps it; relabeling a namespace removes
// and adds its endpoints live; a new annotation applies live, an invalid
// one is reported and changes nothing.
func TestDiscoverySelectors(t *testing.T) {
	ctx := context.Background()
	const team = "isthmus.test/team"
	nsLabels := map[string]map[string]string{
		"ds-a":   {"mesh": "on", team: "a"},
		"ds-b":   {"mesh": "on", team: "b"},
		"ds-off": nil,
	}
	addr := map[string]byte{"cluster-1": 1, "cluster-2": 2, "cluster-3": 3}
	nsIndex := map[string]byte{"ds-a": 1, "ds-b": 2, "ds-off": 3}
	for _, cl := range []string{"cluster-1", "cluster-2", "cluster-3"} {
		c := clusters.Cluster(cl)
		for ns, l := range nsLabels {
			require.NoError(t, c.EnsureNamespace(ctx, ns, l))
			_, err := c.CreateService(ctx, ns, "web", map[string]string{"app": "web"}, framework.ServicePort{Name: "http", Port: 80, TargetPort: 8080})
			require.NoError(t, err)
			_, err = c.CreatePod(ctx, framework.PodOptions{Namespace: ns, Name: "web-0", Labels: map[string]string{"app": "web"},
				IP: netip.AddrFrom4([4]byte{127, 30 + addr[cl], nsIndex[ns], 1}), Ready: true})
			require.NoError(t, err)
		}
	}
	t.Cleanup(func() {
		// envtest has no namespace controller: delete what the namespaces hold.
		for _, cl := range []string{"cluster-1", "cluster-2", "cluster-3"} {
			c := clusters.Cluster(cl)
			for ns := range nsLabels {
				_ = c.Client.CoreV1().Pods(ns).Delete(ctx, "web-0", metav1.DeleteOptions{})
				_ = c.Client.CoreV1().Services(ns).Delete(ctx, "web", metav1.DeleteOptions{})
			}
		}
	})

	f := startFederation(t, "fed-ds", registry.Config{QuietPeriod: 20 * time.Millisecond}, controller.Config{},
		func(c *multicluster.Config) {
			c.DiscoverySelectors = []metav1.LabelSelector{{MatchLabels: map[string]string{"mesh": "on"}}}
		})
	registerAnnotated(t, f, "cluster-2", "- matchLabels: {"+team+": a}\n")
	registerAnnotated(t, f, "cluster-3", "")

	host := func(ns string) string { return "web." + ns + ".svc.cluster.local" }
	// clustersOf returns the clusters with endpoints of ns's web service.
	clustersOf := func(ns string) []model.ClusterID {
		s := f.reg.Service(host(ns))
		if s == nil {
			return nil
		}
		var out []model.ClusterID
		for cl, eps := range s.Shards {
			if len(eps) > 0 {
				out = append(out, cl)
			}
		}
		slices.Sort(out)
		return out
	}
	expect := func(msg string, want map[string][]model.ClusterID) {
		t.Helper()
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			for ns, cls := range want {
				assert.Equal(c, cls, clustersOf(ns), "%s: web.%s", msg, ns)
			}
		}, 30*time.Second, 10*time.Millisecond)
	}
	expect("start", map[string][]model.ClusterID{
		"ds-a":   {"cluster-1", "cluster-2", "cluster-3"},
		"ds-b":   {"cluster-1", "cluster-3"}, // excluded by cluster-2's annotation only
		"ds-off": nil,                        // no mesh=on anywhere
	})
	require.Nil(t, f.reg.Workload("cluster-2/ds-b/web-0"), "no workload of an excluded namespace")
	require.NotNil(t, f.reg.Workload("cluster-3/ds-b/web-0"))
	s2, _ := f.ctl.Status("cluster-2")
	assert.Equal(t, "{isthmus.test/team=a}", s2.Namespaces)
	gen2 := s2.Generation

	// Relabeling: ds-a leaves cluster-2's selection, ds-b cluster-3's
	// (mesh-wide); then both come back.
	require.NoError(t, clusters.Cluster("cluster-2").EnsureNamespace(ctx, "ds-a", map[string]string{"mesh": "on"}))
	require.NoError(t, clusters.Cluster("cluster-3").EnsureNamespace(ctx, "ds-b", map[string]string{team: "b"}))
	expect("relabeled out", map[string][]model.ClusterID{
		"ds-a": {"cluster-1", "cluster-3"},
		"ds-b": {"cluster-1"},
	})
	require.Nil(t, f.reg.Workload("cluster-2/ds-a/web-0"))
	require.NoError(t, clusters.Cluster("cluster-2").EnsureNamespace(ctx, "ds-a", nsLabels["ds-a"]))
	require.NoError(t, clusters.Cluster("cluster-3").EnsureNamespace(ctx, "ds-b", nsLabels["ds-b"]))
	expect("relabeled in", map[string][]model.ClusterID{
		"ds-a": {"cluster-1", "cluster-2", "cluster-3"},
		"ds-b": {"cluster-1", "cluster-3"},
	})
	w := f.reg.Workload("cluster-2/ds-a/web-0")
	require.NotNil(t, w)
	assert.Equal(t, netip.MustParseAddr("127.32.1.1"), w.Addresses[0])

	// A changed annotation applies live: an empty list selects everything.
	annotate(t, f, "cluster-2", "[]")
	expect("annotation: all namespaces", map[string][]model.ClusterID{
		"ds-b":   {"cluster-1", "cluster-2", "cluster-3"},
		"ds-off": {"cluster-2"},
	})
	// The new generation feeds the registry before it replaces the old one
	// in the cluster's status: wait for the status too.
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		s2, _ = f.ctl.Status("cluster-2")
		assert.Equal(c, "all namespaces", s2.Namespaces)
		assert.Greater(c, s2.Generation, gen2, "a new generation")
	}, 30*time.Second, 10*time.Millisecond)
	gen2 = s2.Generation

	// An invalid annotation is reported and keeps the selection.
	for _, bad := range []string{"- matchLabels: {a: [x]}", "- matchExpressions: [{key: k, operator: Near}]", "- matchLabel: {a: b}"} {
		annotate(t, f, "cluster-2", bad)
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			s, ok := f.ctl.Status("cluster-2")
			require.True(c, ok)
			assert.Contains(c, s.SelectorError, remotesecret.DiscoverySelectorsAnnotation)
			assert.Contains(c, s.SelectorError, "keeps its previous selection")
		}, 30*time.Second, 10*time.Millisecond, bad)
		s2, _ = f.ctl.Status("cluster-2")
		assert.Equal(t, gen2, s2.Generation, "%q: no new generation", bad)
		assert.Equal(t, "all namespaces", s2.Namespaces)
		assert.Equal(t, multicluster.StateSynced, s2.State)
		assert.Equal(t, []model.ClusterID{"cluster-2"}, clustersOf("ds-off"), "%q: state kept", bad)
	}
	events, err := clusters.Cluster("cluster-1").Client.CoreV1().Events(f.ns).List(ctx, metav1.ListOptions{
		FieldSelector: "reason=" + multicluster.ReasonInvalidDiscoverySelectors})
	require.NoError(t, err)
	assert.NotEmpty(t, events.Items, "an Event on the Secret")

	// Fixed again: the error clears and the selection applies. Two
	// selectors (OR-ed, so matched by pilot, not the API server): team=b,
	// or no mesh label.
	annotate(t, f, "cluster-2", `[{"matchLabels": {"`+team+`": "b"}}, {"matchExpressions": [{"key": "mesh", "operator": "DoesNotExist"}]}]`)
	expect("annotation: team=b or no mesh label", map[string][]model.ClusterID{
		"ds-a":   {"cluster-1", "cluster-3"},
		"ds-b":   {"cluster-1", "cluster-2", "cluster-3"},
		"ds-off": {"cluster-2"},
	})
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		s2, _ = f.ctl.Status("cluster-2")
		assert.Empty(c, s2.SelectorError)
	}, 30*time.Second, 10*time.Millisecond)
	// Relabeling under client-side matching: ds-off gains the mesh label
	// and leaves cluster-2's selection; ds-a loses it and enters.
	require.NoError(t, clusters.Cluster("cluster-2").EnsureNamespace(ctx, "ds-off", map[string]string{"mesh": "on"}))
	require.NoError(t, clusters.Cluster("cluster-2").EnsureNamespace(ctx, "ds-a", map[string]string{team: "a"}))
	expect("relabeled under two selectors", map[string][]model.ClusterID{
		"ds-a":   {"cluster-1", "cluster-2", "cluster-3"},
		"ds-off": nil,
	})

	// A new Secret whose annotation does not parse is refused, with the reason.
	f.unregister(t, "cluster-3")
	require.Eventually(t, func() bool { return len(clustersOf("ds-b")) == 2 }, 30*time.Second, 10*time.Millisecond)
	sec := remoteSecret(t, f, "cluster-3", "- {")
	_, err = clusters.Cluster("cluster-1").Client.CoreV1().Secrets(f.ns).Create(ctx, sec, metav1.CreateOptions{})
	require.NoError(t, err)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		s, ok := f.ctl.Status("cluster-3")
		require.True(c, ok)
		assert.Equal(c, multicluster.StateError, s.State)
		assert.Equal(c, multicluster.ReasonInvalidDiscoverySelectors, s.Reason)
	}, 30*time.Second, 10*time.Millisecond)
	assert.Nil(t, f.reg.Workload("cluster-3/ds-a/web-0"))
}

// remoteSecret returns cluster's remote Secret for f, annotated with the
// discovery selectors text (none when empty).
func remoteSecret(t *testing.T, f *federation, cluster, selectors string) *corev1.Secret {
	t.Helper()
	kc, err := clusters.Cluster(cluster).ReaderKubeconfig(context.Background(), cluster, remotesecret.ReaderOptions{})
	require.NoError(t, err)
	sec := remotesecret.Secret(cluster, f.ns, kc)
	sec.Annotations[remotesecret.NetworkAnnotation] = "network-" + cluster[len("cluster-"):]
	if selectors != "" {
		sec.Annotations[remotesecret.DiscoverySelectorsAnnotation] = selectors
	}
	return sec
}

// registerAnnotated registers cluster with the discovery selectors text
// (none when empty) and waits for it to sync.
func registerAnnotated(t *testing.T, f *federation, cluster, selectors string) {
	t.Helper()
	_, err := clusters.Cluster("cluster-1").Client.CoreV1().Secrets(f.ns).Create(context.Background(), remoteSecret(t, f, cluster, selectors), metav1.CreateOptions{})
	require.NoError(t, err)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		s, ok := f.ctl.Status(model.ClusterID(cluster))
		require.True(c, ok)
		require.Equal(c, multicluster.StateSynced, s.State, s.Message)
	}, 30*time.Second, 10*time.Millisecond)
}

// annotate sets the discovery selectors annotation of cluster's Secret.
func annotate(t *testing.T, f *federation, cluster, selectors string) {
	t.Helper()
	secrets := clusters.Cluster("cluster-1").Client.CoreV1().Secrets(f.ns)
	sec, err := secrets.Get(context.Background(), "istio-remote-secret-"+cluster, metav1.GetOptions{})
	require.NoError(t, err)
	sec.Annotations[remotesecret.DiscoverySelectorsAnnotation] = selectors
	_, err = secrets.Update(context.Background(), sec, metav1.UpdateOptions{})
	require.NoError(t, err, fmt.Sprintf("annotate %s", cluster))
}
