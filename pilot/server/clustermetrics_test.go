package server_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// TestPerClusterSeries runs a real pilot over the two real clusters: the
// per-cluster series name each registered cluster with its state, its
// generation, when it synced, and the objects its discovery holds (which
// follow the cluster: a new Service in the remote raises its count); when
// the remote's Secret goes, so do its series.
func TestPerClusterSeries(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const cpNS, appNS = "isthmus-percluster", "percluster"
	primary, remote := clusters.Cluster("primary"), clusters.Cluster("remote")
	require.NoError(t, primary.EnsureNamespace(ctx, cpNS, nil))
	require.NoError(t, remote.EnsureNamespace(ctx, appNS, nil))
	require.NoError(t, remote.EnsureNamespace(ctx, cpNS, nil)) // pilot publishes its CA root there
	p := runPilot(t, server.Config{
		Namespace: cpNS, ClusterID: "primary", Network: "net1", NoLeaderElection: true,
		DebugAddr: defaults.Disabled, MonitoringAddr: "127.0.0.1:0", GRPCAddr: "127.0.0.1:0",
	})
	require.Eventually(t, func() bool { return p.MonitoringAddr() != "" }, 20*time.Second, 10*time.Millisecond)
	url := "http://" + p.MonitoringAddr() + "/metrics"
	registerRemote(t, cpNS, "net2")

	var services float64
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		s := samples(c, url)
		for _, id := range []string{"primary", "remote"} {
			assert.Equal(c, 1.0, s[`isthmus_remote_cluster_state{cluster_id="`+id+`",state="synced"}`], id)
			assert.Equal(c, 0.0, s[`isthmus_remote_cluster_state{cluster_id="`+id+`",state="error"}`], id)
			assert.GreaterOrEqual(c, s[`isthmus_remote_cluster_generation{cluster_id="`+id+`"}`], 1.0, id)
			assert.InDelta(c, float64(time.Now().Unix()), s[`isthmus_remote_cluster_last_sync_timestamp_seconds{cluster_id="`+id+`"}`], 120, id)
			assert.Contains(c, s, `isthmus_remote_cluster_sync_seconds{cluster_id="`+id+`"}`)
		}
		services = s[`isthmus_remote_cluster_objects{cluster_id="remote",kind="services"}`]
		assert.GreaterOrEqual(c, services, 1.0, "the remote's kubernetes Service at least")
		assert.Contains(c, s, `isthmus_remote_cluster_objects{cluster_id="remote",kind="pods"}`)
		assert.Contains(c, s, `isthmus_remote_cluster_objects{cluster_id="remote",kind="endpointslices"}`)
	}, time.Minute, 50*time.Millisecond)

	_, err := remote.CreateService(ctx, appNS, "counted", map[string]string{"app": "counted"}, framework.ServicePort{Name: "http", Port: 80, TargetPort: 8080})
	require.NoError(t, err)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.Equal(c, services+1, samples(c, url)[`isthmus_remote_cluster_objects{cluster_id="remote",kind="services"}`])
	}, 30*time.Second, 50*time.Millisecond, "the count follows the cluster")

	require.NoError(t, primary.Client.CoreV1().Secrets(cpNS).Delete(ctx, "istio-remote-secret-remote", metav1.DeleteOptions{}))
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		s := samples(c, url)
		for k := range s {
			assert.NotContains(c, k, `cluster_id="remote"`, "a removed cluster's series go with it")
		}
		assert.Equal(c, 1.0, s[`isthmus_remote_cluster_state{cluster_id="primary",state="synced"}`])
	}, 30*time.Second, 50*time.Millisecond)
}

// samples scrapes url and returns every sample as name{labels} -> value
// (labels in the exposition's order, which is sorted by name).
func samples(t require.TestingT, url string) map[string]float64 {
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	require.NoError(t, err)
	out := map[string]float64{}
	for name, f := range fams {
		for _, m := range f.GetMetric() {
			key := name + "{"
			for i, l := range m.GetLabel() {
				if i > 0 {
					key += ","
				}
				key += l.GetName() + `="` + l.GetValue() + `"`
			}
			key += "}"
			switch {
			case m.GetGauge() != nil:
				out[key] = m.GetGauge().GetValue()
			case m.GetCounter() != nil:
				out[key] = m.GetCounter().GetValue()
			case m.GetUntyped() != nil:
				out[key] = m.GetUntyped().GetValue()
			}
		}
	}
	return out
}
