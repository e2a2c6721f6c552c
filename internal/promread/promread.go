// Package promread reads one value out of a Prometheus gatherer: the sum of
// the counter, gauge or untyped samples of a metric whose labels include a
// given set (a histogram's sample count). It is for tests and debug views;
// it is safe for concurrent use as far as the gatherer is.
package promread

import "github.com/prometheus/client_golang/prometheus"

// Value gathers g and returns the sum over the samples of metric whose
// labels include labels (nil: every sample); 0 when there is none.
func Value(g prometheus.Gatherer, metric string, labels map[string]string) (float64, error) {
	mfs, err := g.Gather()
	if err != nil {
		return 0, err
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != metric {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			got := make(map[string]string, len(m.GetLabel()))
			for _, lp := range m.GetLabel() {
				got[lp.GetName()] = lp.GetValue()
			}
			for k, v := range labels {
				if got[k] != v {
					continue next
				}
			}
			switch {
			case m.GetCounter() != nil:
				sum += m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				sum += m.GetGauge().GetValue()
			case m.GetHistogram() != nil:
				sum += float64(m.GetHistogram().GetSampleCount())
			case m.GetUntyped() != nil:
				sum += m.GetUntyped().GetValue()
			}
		}
	}
	return sum, nil
}
