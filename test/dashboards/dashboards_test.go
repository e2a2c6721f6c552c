package dashboards_test

import (
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/prometheus/promql"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/prometheus/prometheus/util/teststorage"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// istioDashboard is one of Istio's dashboards as the test runs it.
type istioDashboard struct {
	// Name is the dashboard's name in the docs table; File its file.
	Name, File string
	// Vars fill the dashboard's template variables: the values an
	// operator would pick for the test's traffic.
	Vars map[string]string
	// Only, when set, keeps the queries containing it (the mesh, service
	// and workload dashboards: their istio_tcp_* queries; the request
	// panels need L7 telemetry, which needs a waypoint).
	Only string
}

var istioDashboards = []istioDashboard{
	{Name: "pilot", File: "pilot-dashboard.gen.json"},
	{Name: "ztunnel", File: "ztunnel-dashboard.gen.json"},
	{Name: "mesh", File: "istio-mesh-dashboard.gen.json", Only: "istio_tcp_"},
	{Name: "service", File: "istio-service-dashboard.json", Only: "istio_tcp_", Vars: map[string]string{
		"service": "web.front.svc.cluster.local", "qrep": "source|destination",
		"srcwl": ".*", "srcns": ".*", "dstwl": ".*", "dstns": ".*", "srccluster": ".*", "dstcluster": ".*",
	}},
	{Name: "workload", File: "istio-workload-dashboard.json", Only: "istio_tcp_", Vars: map[string]string{
		"namespace": "front", "workload": ".*", "qrep": "source|destination",
		"srcwl": ".*", "srcns": ".*", "dstsvc": ".*", "srccluster": ".*", "dstcluster": ".*",
	}},
}

// unfilled matches a Grafana variable ($name, ${name}); a "$" ending a
// regular expression is not one.
var unfilled = regexp.MustCompile(`\$\{?[A-Za-z_]`)

// scrapeInterval separates the two scrapes (sample timestamps, not a wait).
const scrapeInterval = 15 * time.Second

// TestDashboards runs, against two scrapes of a running federation, every
// query of Istio's pilot and ztunnel dashboards and the istio_tcp_*
// queries of its mesh, service and workload dashboards; the queries of
// Kiali's TCP traffic graph (whose series must also name both ends of each
// cross-network connection); and every query of Isthmus's own dashboard.
func TestDashboards(t *testing.T) {
	dir := istioDashboardsDir(t)
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
	r := &runner{engine: promql.NewEngine(promql.EngineOpts{MaxSamples: 1e7, Timeout: time.Minute, LookbackDelta: 5 * time.Minute}),
		db: db, at: t0.Add(scrapeInterval), expect: expect, used: map[notFedKey]bool{}}
	names := map[string]bool{}
	report := func(d istioDashboard, panels []panel) {
		names[d.Name] = true
		total, fed, na, queries := r.run(t, d, panels)
		t.Logf("%s: %d panels, %d fed, %d not applicable; %d queries", d.Name, total, fed, na, queries)
	}
	for _, d := range istioDashboards {
		report(d, dashboard(t, filepath.Join(dir, d.File)))
	}
	report(istioDashboard{Name: "kiali"}, kialiPanels())
	checkKialiEdges(t, r)
	report(isthmusDashboard, dashboard(t, isthmusDashboard.File))
	for k := range expect {
		assert.True(t, names[k.Dashboard], "docs list %v, of a dashboard the test does not run", k)
		assert.True(t, r.used[k], "docs list %v, which no query of the dashboards matches", k)
	}
}

// runner evaluates dashboard queries against the loaded scrapes.
type runner struct {
	engine *promql.Engine
	db     *teststorage.TestStorage
	at     time.Time
	expect map[notFedKey]string
	used   map[notFedKey]bool
}

// run checks every (kept) query of panels, logs each panel as fed (one
// query is) or not applicable (every query is listed in the docs), and
// counts them.
func (r *runner) run(t *testing.T, d istioDashboard, panels []panel) (total, fed, na, queries int) {
	for _, pn := range panels {
		kept, panelFed := 0, false
		for _, tg := range pn.Targets {
			if d.Only != "" && !strings.Contains(tg.Expr, d.Only) {
				continue
			}
			kept++
			expr := fill(tg.Expr, d.Vars)
			require.NotRegexp(t, unfilled, expr, "%s %q: a variable the test does not fill: %s", d.Name, pn.Title, expr)
			parsed, err := promqlParser.ParseExpr(expr)
			if !assert.NoError(t, err, "%s %q: %s", d.Name, pn.Title, expr) {
				continue
			}
			vs := firstSelector(parsed)
			require.NotNil(t, vs, expr)
			got, err := evaluate(t, r.engine, r.db, expr, r.at)
			if !assert.NoError(t, err, "%s %q: %s", d.Name, pn.Title, expr) {
				continue
			}
			if k, listed := r.listed(d.Name, pn.Title, vs); listed {
				r.used[k] = true
				assert.False(t, got, "%s panel %q query %s returns data, but docs list it as not fed (%s)", d.Name, pn.Title, expr, r.expect[k])
				continue
			}
			panelFed = true
			assert.True(t, got, "%s panel %q query %s returns nothing, and docs do not list it (dashboard | panel | metric: %s | %s | %s)",
				d.Name, pn.Title, expr, d.Name, pn.Title, vs.Name)
		}
		if kept == 0 {
			continue
		}
		total++
		queries += kept
		if panelFed {
			fed++
		} else {
			na++
		}
		t.Logf("%s | %s | %s", d.Name, pn.Title, map[bool]string{true: "fed", false: "not applicable (docs/observability.md)"}[panelFed])
	}
	return total, fed, na, queries
}

// listed returns the docs row naming the query whose first selector is vs.
func (r *runner) listed(dashboard, panel string, vs *parser.VectorSelector) (notFedKey, bool) {
	keys := make([]notFedKey, 0, 1)
	for k := range r.expect {
		if k.matches(dashboard, panel, vs) {
			keys = append(keys, k)
		}
	}
	slices.SortFunc(keys, func(a, b notFedKey) int { return strings.Compare(a.Selector, b.Selector) })
	if len(keys) == 0 {
		return notFedKey{}, false
	}
	return keys[0], true
}
