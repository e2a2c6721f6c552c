package metrics

import (
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

func counterValue(m *Metrics, get func(*Metrics) prometheus.Counter) float64 {
	if m == nil {
		return 0
	}
	var out dto.Metric
	if err := get(m).Write(&out); err != nil {
		return 0
	}
	return out.GetCounter().GetValue()
}

func sumReporter(m *Metrics, vec *prometheus.CounterVec, reporter string) float64 {
	if m == nil {
		return 0
	}
	ch := make(chan prometheus.Metric, 64)
	go func() {
		vec.Collect(ch)
		close(ch)
	}()
	var total float64
	for metric := range ch {
		var out dto.Metric
		if err := metric.Write(&out); err != nil {
			continue
		}
		for _, lp := range out.GetLabel() {
			if lp.GetName() == "reporter" && lp.GetValue() == reporter {
				total += out.GetCounter().GetValue()
			}
		}
	}
	return total
}

// ConnStats are the counters of one label set.
type ConnStats struct {
	Opened, Closed, Sent, Received float64
}

// ConnStats returns the counters for exactly the label set l.
func (m *Metrics) ConnStats(l ConnLabels) ConnStats {
	if m == nil {
		return ConnStats{}
	}
	v := l.values()
	get := func(vec *prometheus.CounterVec) float64 {
		return counterValue(m, func(*Metrics) prometheus.Counter { return vec.WithLabelValues(v...) })
	}
	return ConnStats{Opened: get(m.opened), Closed: get(m.closed), Sent: get(m.sent), Received: get(m.received)}
}
