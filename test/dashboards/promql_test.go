package dashboards_test

import (
	"context"
	"fmt"
	"math"
	"net/http"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/prometheus/prometheus/util/teststorage"
	"github.com/stretchr/testify/require"
)

// target is one scraped endpoint and the labels Prometheus's Kubernetes
// pod discovery gives its samples (Istio's addon: the pod's labels, its
// namespace and name).
type target struct {
	URL    string
	Labels map[string]string
}

// scrape reads url's /metrics over HTTP in the text format.
func scrape(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, url)
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(resp.Body)
	require.NoError(t, err, url)
	return mfs
}

// appendScrape appends the samples of mfs, with the target's labels, at ts
// (as a Prometheus scrape would store them: histograms as _bucket, _sum
// and _count series).
func appendScrape(t *testing.T, db *teststorage.TestStorage, tg target, mfs map[string]*dto.MetricFamily, ts time.Time) {
	t.Helper()
	app := db.Appender(context.Background())
	at := ts.UnixMilli()
	add := func(name string, m *dto.Metric, v float64, extra ...string) {
		b := labels.NewBuilder(labels.EmptyLabels())
		for k, v := range tg.Labels {
			b.Set(k, v)
		}
		for _, lp := range m.GetLabel() {
			b.Set(lp.GetName(), lp.GetValue())
		}
		for i := 0; i+1 < len(extra); i += 2 {
			b.Set(extra[i], extra[i+1])
		}
		b.Set(labels.MetricName, name)
		_, err := app.Append(0, b.Labels(), at, v)
		require.NoError(t, err, name)
	}
	for name, mf := range mfs {
		for _, m := range mf.GetMetric() {
			switch mf.GetType() {
			case dto.MetricType_COUNTER:
				add(name, m, m.GetCounter().GetValue())
			case dto.MetricType_GAUGE:
				add(name, m, m.GetGauge().GetValue())
			case dto.MetricType_UNTYPED:
				add(name, m, m.GetUntyped().GetValue())
			case dto.MetricType_HISTOGRAM:
				h := m.GetHistogram()
				for _, b := range h.GetBucket() {
					add(name+"_bucket", m, float64(b.GetCumulativeCount()), "le", fmt.Sprint(b.GetUpperBound()))
				}
				add(name+"_bucket", m, float64(h.GetSampleCount()), "le", "+Inf")
				add(name+"_sum", m, h.GetSampleSum())
				add(name+"_count", m, float64(h.GetSampleCount()))
			case dto.MetricType_SUMMARY:
				s := m.GetSummary()
				for _, q := range s.GetQuantile() {
					add(name, m, q.GetValue(), "quantile", fmt.Sprint(q.GetQuantile()))
				}
				add(name+"_sum", m, s.GetSampleSum())
				add(name+"_count", m, float64(s.GetSampleCount()))
			}
		}
	}
	require.NoError(t, app.Commit())
}

// Grafana's built-in variables, with the values the test gives them.
var grafanaVars = strings.NewReplacer("$__rate_interval", "1m", "${__rate_interval}", "1m", "$__interval", "30s", "${__interval}", "30s")

// fill substitutes Grafana's variables and the dashboard's own (vars:
// name -> value) into expr.
func fill(expr string, vars map[string]string) string {
	expr = grafanaVars.Replace(expr)
	for k, v := range vars {
		expr = strings.NewReplacer("${"+k+"}", v, "$"+k, v).Replace(expr)
	}
	return expr
}

// firstSelector returns the first vector selector of expr (in PromQL's
// walk order), nil if there is none.
func firstSelector(expr parser.Expr) *parser.VectorSelector {
	var first *parser.VectorSelector
	parser.Inspect(expr, func(n parser.Node, _ []parser.Node) error {
		if vs, ok := n.(*parser.VectorSelector); ok && first == nil {
			first = vs
		}
		return nil
	})
	return first
}

// evaluate runs expr as an instant query at ts and reports whether it
// returned data (a non-empty vector or matrix, or a number).
func evaluate(t *testing.T, engine *promql.Engine, db *teststorage.TestStorage, expr string, ts time.Time) (bool, error) {
	t.Helper()
	q, err := engine.NewInstantQuery(context.Background(), db, nil, expr, ts)
	if err != nil {
		return false, err
	}
	defer q.Close()
	res := q.Exec(context.Background())
	if res.Err != nil {
		return false, res.Err
	}
	switch v := res.Value.(type) {
	case promql.Vector:
		for _, s := range v {
			if !math.IsNaN(s.F) || s.H != nil {
				return true, nil
			}
		}
		return false, nil
	case promql.Matrix:
		return len(v) > 0, nil
	case promql.Scalar:
		return !math.IsNaN(v.V), nil
	}
	return false, nil
}
