package dashboards_test

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/prometheus/promql"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/prometheus/prometheus/util/teststorage"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// istioDashboardFiles are the dashboards the test runs, by the name the
// docs table uses.
var istioDashboardFiles = map[string]string{
	"pilot":   "pilot-dashboard.gen.json",
	"ztunnel": "ztunnel-dashboard.gen.json",
}

// scrapeInterval separates the two scrapes (sample timestamps, not a wait).
const scrapeInterval = 15 * time.Second

// TestIstioDashboards runs every query of Istio's pilot and ztunnel
// dashboards against two scrapes of a running federation.
func TestIstioDashboards(t *testing.T) {
	dir := istioDashboards(t)
	expect := notFed(t)
	m := runMesh(t)
	db := teststorage.New(t)
	t0 := time.Now().Truncate(time.Second)
	for i := range 2 {
		m.traffic(t)
		for _, tg := range m.targets {
			appendScrape(t, db, tg, scrape(t, tg.URL), t0.Add(time.Duration(i)*scrapeInterval))
		}
	}
	engine := promql.NewEngine(promql.EngineOpts{MaxSamples: 1e7, Timeout: time.Minute, LookbackDelta: 5 * time.Minute})
	at := t0.Add(scrapeInterval)
	promqlParser := parser.NewParser(parser.Options{})
	used := map[notFedKey]bool{}
	for name, file := range istioDashboardFiles {
		var panels, fed, na, queries int
		for _, p := range dashboard(t, filepath.Join(dir, file)) {
			panels++
			panelFed := false
			for _, tg := range p.Targets {
				queries++
				expr := fill(tg.Expr, nil)
				parsed, err := promqlParser.ParseExpr(expr)
				if !assert.NoError(t, err, "%s %q: %s", name, p.Title, expr) {
					continue
				}
				metrics := selected(parsed)
				require.NotEmpty(t, metrics, expr)
				key := notFedKey{name, p.Title, metrics[0]}
				got, err := evaluate(t, engine, db, expr, at)
				if !assert.NoError(t, err, "%s %q: %s", name, p.Title, expr) {
					continue
				}
				if reason, listed := expect[key]; listed {
					used[key] = true
					assert.False(t, got, "%s panel %q query %s returns data, but docs list it as not fed (%s)", name, p.Title, expr, reason)
					continue
				}
				panelFed = true
				assert.True(t, got, "%s panel %q query %s returns nothing, and docs do not list it (dashboard | panel | metric: %s | %s | %s)",
					name, p.Title, expr, key.Dashboard, key.Panel, key.Metric)
			}
			if panelFed {
				fed++
			} else {
				na++
			}
		}
		t.Logf("%s dashboard: %d panels, %d fed, %d not applicable; %d queries", name, panels, fed, na, queries)
	}
	for k := range expect {
		if _, ok := istioDashboardFiles[k.Dashboard]; ok {
			assert.True(t, used[k], "docs list %v, which no query of the dashboards selects", k)
		}
	}
}
