package registry

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/internal/promread"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// TestPilotServices proves pilot_services counts federated services by
// hostname: a service in two clusters is one, and a cluster's removal
// takes its own services away.
func TestPilotServices(t *testing.T) {
	metrics := prometheus.NewRegistry()
	reg, _ := run(t, Config{QuietPeriod: 5 * time.Millisecond, Registerer: metrics})
	services := func() float64 {
		v, err := promread.Value(metrics, "pilot_services", nil)
		require.NoError(t, err)
		return v
	}
	require.Zero(t, services())
	reg.Activate("c1", 1, state([]*model.ClusterService{svc("c1", "demo", "echo", t0, httpPort)}, nil))
	reg.Activate("c2", 1, state([]*model.ClusterService{svc("c2", "demo", "echo", t0, httpPort), svc("c2", "demo", "other", t0, httpPort)}, nil))
	require.Eventually(t, func() bool { return services() == 2 }, time.Second, time.Millisecond)
	require.Equal(t, float64(len(reg.Services())), services())
	reg.Deactivate("c2", 1)
	require.Eventually(t, func() bool { return services() == 1 }, time.Second, time.Millisecond)
}
