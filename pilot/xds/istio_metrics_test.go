package xds_test

import (
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	resource "github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/stretchr/testify/require"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"

	"github.com/isthmus-mesh/isthmus/internal/promread"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/xds"
	"github.com/isthmus-mesh/isthmus/pilot/xds/xdstest"
)

// TestIstioMetrics proves the Istio-named twins follow real streams, with
// Istio's labels: pilot_xds counts connected clients (version unknown),
// pilot_xds_pushes, pilot_xds_push_time and pilot_xds_config_size_bytes
// count each response by short type, pilot_proxy_convergence_time only the
// pushes a change caused, and pilot_total_xds_rejects the NACKs, each
// moving with its isthmus_xds_* counterpart.
func TestIstioMetrics(t *testing.T) {
	reg := xdstest.New()
	svc, ws := xdstest.Backing("echo", ns, tcp80, nil, xdstest.Pod("c1", "net1", ns, "a", ip("10.0.0.1")))
	publish(reg, svc, ws)
	e := start(t, reg)
	value := func(metric string, labels map[string]string) float64 {
		v, err := promread.Value(e.metrics, metric, labels)
		require.NoError(t, err)
		return v
	}
	wds := map[string]string{"type": "wds"}
	c := openDelta(t, dial(t, e.addr), wildcard(node("zt-1", "net1", "c1")))
	c.apply(c.next())
	envoy := openSotw(t, dial(t, e.addr), node("envoy-1", "net1", "c1"))
	envoy.send(&discovery.DiscoveryRequest{TypeUrl: resource.ClusterType})
	nacked := envoy.next(resource.ClusterType)
	envoy.send(&discovery.DiscoveryRequest{TypeUrl: resource.ClusterType, ResponseNonce: nacked.GetNonce(),
		ErrorDetail: &rpcstatus.Status{Message: "bad cluster"}})

	require.EventuallyWithT(t, func(ct *assertT) {
		assertEqual(ct, 2.0, value("pilot_xds", map[string]string{"version": xds.UnknownVersion}))
		assertEqual(ct, 1.0, value("pilot_total_xds_rejects", map[string]string{"type": "cds"}))
		assertEqual(ct, 1.0, value("isthmus_xds_nacks_total", map[string]string{"type": resource.ClusterType}))
	}, waitFor, 10*time.Millisecond)
	require.Equal(t, 1.0, value("pilot_xds_pushes", wds))
	require.Equal(t, 1.0, value("pilot_xds_push_time", wds), "one observation")
	require.Equal(t, 1.0, value("pilot_xds_config_size_bytes", wds))
	cds := value("pilot_xds_pushes", map[string]string{"type": "cds"})
	require.GreaterOrEqual(t, cds, 1.0)
	require.Equal(t, cds, value("isthmus_xds_pushes_total", map[string]string{"type": resource.ClusterType}))
	require.Zero(t, value("pilot_proxy_convergence_time", nil), "answers to requests are not pushes")

	// A change pushes the workload type to the ztunnel.
	w := *reg.Workload(model.WorkloadUID("c1", ns, "a"))
	moved := *w.Placement
	moved.Node = "elsewhere"
	w.Placement = &moved
	reg.SetWorkload(&w)
	c.apply(c.next())
	require.EventuallyWithT(t, func(ct *assertT) {
		assertEqual(ct, 2.0, value("pilot_xds_pushes", wds))
		assertEqual(ct, 2.0, value("pilot_xds_push_time", wds))
		assertEqual(ct, 2.0, value("pilot_xds_config_size_bytes", wds))
		assertEqual(ct, value("isthmus_xds_pushes_total", nil), value("pilot_xds_pushes", nil))
		assertEqual(ct, true, value("pilot_proxy_convergence_time", nil) >= 1)
	}, waitFor, 10*time.Millisecond)
	sizes, err := promread.Value(e.metrics, "isthmus_xds_push_bytes_total", map[string]string{"type": xds.WorkloadType})
	require.NoError(t, err)
	require.Positive(t, sizes)

	c.close()
	envoy.cancel()
	<-envoy.done
	require.EventuallyWithT(t, func(ct *assertT) {
		assertEqual(ct, 0.0, value("pilot_xds", nil))
	}, waitFor, 10*time.Millisecond)
}
