package xdsclient_test

import (
	"testing"
	"time"

	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/internal/promread"
	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
	"github.com/isthmus-mesh/isthmus/ztunnel/xdsclient"
)

// TestIstioXDSMetrics proves istio_xds_message_total counts the responses
// of a real stream by type URL (the same count as Stats), and that
// istio_xds_connection_terminations_total counts a stream lost with the
// server, the refused reconnects while it is down, and the client's stop.
func TestIstioXDSMetrics(t *testing.T) {
	c := newCache(map[string]types.Resource{"c1/default/a": wl("c1/default/a", "127.0.0.10", "node-a")})
	srv := startXDS(t, c, "127.0.0.1:0")
	reg := prometheus.NewRegistry()
	cl, store, stop := clientWith(t, srv.addr, nil, reg)
	t.Cleanup(stop)
	eventually(t, store, func(c *assert.CollectT, s *state.Snapshot) { require.Len(c, s.Workloads(), 1) })
	require.NoError(t, c.UpdateResources(map[string]types.Resource{"c1/default/b": wl("c1/default/b", "127.0.0.11", "node-b")}, nil))
	eventually(t, store, func(c *assert.CollectT, s *state.Snapshot) { require.Len(c, s.Workloads(), 2) })

	value := func(metric, name, v string) float64 {
		got, err := promread.Value(reg, metric, map[string]string{name: v})
		require.NoError(t, err)
		return got
	}
	messages := func() float64 { return value("istio_xds_message_total", "url", workloadv1.TypeURL) }
	require.Equal(t, 2.0, messages())
	require.Equal(t, float64(cl.Stats().Responses), messages())
	require.Equal(t, 1, testutil.CollectAndCount(reg, "istio_xds_message_total"), "one url label value")

	terminations := func(reason string) float64 {
		return value("istio_xds_connection_terminations_total", "reason", reason)
	}
	require.Equal(t, 4, testutil.CollectAndCount(reg, "istio_xds_connection_terminations_total"), "zeros of every reason")
	total, err := promread.Value(reg, "istio_xds_connection_terminations_total", nil)
	require.NoError(t, err)
	require.Zero(t, total)
	srv.stop()
	require.Eventually(t, func() bool {
		return terminations(xdsclient.TerminationError)+terminations(xdsclient.TerminationReconnect) == 1 &&
			terminations(xdsclient.TerminationConnectionError) >= 1
	}, 10*time.Second, 5*time.Millisecond, "the lost stream, then a refused reconnect")
	srv.restart()
	eventually(t, store, func(c *assert.CollectT, s *state.Snapshot) { require.True(c, cl.Connected()) })
	stop()
	require.Equal(t, 1.0, terminations(xdsclient.TerminationComplete))
}
