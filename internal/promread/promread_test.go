package promread_test

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/internal/promread"
)

func TestValue(t *testing.T) {
	reg := prometheus.NewRegistry()
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "c_total"}, []string{"a", "b"})
	h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: "h"})
	reg.MustRegister(c, h)
	c.WithLabelValues("x", "1").Add(2)
	c.WithLabelValues("x", "2").Add(3)
	c.WithLabelValues("y", "1").Add(5)
	h.Observe(1)
	h.Observe(2)
	for _, tc := range []struct {
		metric string
		labels map[string]string
		want   float64
	}{
		{"c_total", nil, 10},
		{"c_total", map[string]string{"a": "x"}, 5},
		{"c_total", map[string]string{"a": "x", "b": "2"}, 3},
		{"c_total", map[string]string{"a": "z"}, 0},
		{"h", nil, 2},
		{"absent", nil, 0},
	} {
		got, err := promread.Value(reg, tc.metric, tc.labels)
		require.NoError(t, err)
		require.Equal(t, tc.want, got, "%s %v", tc.metric, tc.labels)
	}
}
