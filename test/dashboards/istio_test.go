package dashboards_test

import (
	"bufio"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/prometheus/promql/parser"
	"github.com/stretchr/testify/require"
)

// IstioModule is the version of istio.io/istio whose published Grafana
// dashboards (manifests/addons/dashboards/) the test runs. istio.io/istio
// is not a dependency of Isthmus: the test fetches this version into the
// module cache with `go mod download` (GOPROXY, or a warm cache; `make
// istio-dashboards` does the same ahead of time).
const IstioModule = "istio.io/istio@v0.0.0-20260827124520-eed52ebb66ad"

// notFedDoc holds the table of panels Isthmus does not feed, the test's
// expectation list.
const notFedDoc = "../../docs/observability.md"

// notFedHeading starts that table's section.
const notFedHeading = "## Istio dashboard panels Isthmus does not feed"

// istioDashboardsDir returns the directory of Istio's dashboards in the
// module cache, downloading the module if needed.
func istioDashboardsDir(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("go", "mod", "download", "-json", IstioModule).Output()
	if ee, ok := err.(*exec.ExitError); ok {
		t.Fatalf("go mod download %s: %v: %s%s (needs GOPROXY or a module cache holding it)", IstioModule, err, ee.Stderr, out)
	}
	require.NoError(t, err, "go mod download %s", IstioModule)
	var mod struct{ Dir, Error string }
	require.NoError(t, json.Unmarshal(out, &mod))
	require.Empty(t, mod.Error)
	dir := filepath.Join(mod.Dir, "manifests", "addons", "dashboards")
	require.DirExists(t, dir)
	return dir
}

// panel is one Grafana panel with queries.
type panel struct {
	Title   string
	Targets []struct{ Expr string }
	Panels  []panel // a row's
}

// dashboard reads the panels with queries of one dashboard file,
// flattening rows.
func dashboard(t *testing.T, path string) []panel {
	t.Helper()
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	var d struct {
		Panels []panel
		Rows   []struct{ Panels []panel }
	}
	require.NoError(t, json.Unmarshal(raw, &d))
	var out []panel
	var walk func([]panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			if len(p.Targets) > 0 {
				out = append(out, p)
			}
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	for _, r := range d.Rows {
		walk(r.Panels)
	}
	require.NotEmpty(t, out, path)
	return out
}

// promqlParser is Prometheus's PromQL parser with default options.
var promqlParser = parser.NewParser(parser.Options{})

// notFedKey names queries of a dashboard panel: the dashboard, the
// panel's title and a selector, `metric` or `metric{matchers}`, that the
// first selector of the query must match: the same metric name, and each
// matcher among its matchers.
type notFedKey struct{ Dashboard, Panel, Selector string }

// matches reports whether k names the query of panel whose first
// selector is vs.
func (k notFedKey) matches(dashboard, panel string, vs *parser.VectorSelector) bool {
	if k.Dashboard != dashboard || k.Panel != panel {
		return false
	}
	want, err := promqlParser.ParseMetricSelector(k.Selector)
	if err != nil {
		return false
	}
	have := map[string]bool{}
	for _, m := range vs.LabelMatchers {
		have[m.String()] = true
	}
	for _, m := range want {
		if !have[m.String()] {
			return false
		}
	}
	return true
}

// notFed reads the table of docs/observability.md: | dashboard | panel |
// metric | reason |, every reason given.
func notFed(t *testing.T) map[notFedKey]string {
	t.Helper()
	out := map[notFedKey]string{}
	for _, cells := range docTable(t, notFedHeading, 4) {
		k := notFedKey{cells[0], cells[1], cells[2]}
		require.NotContains(t, out, k, "duplicate row %v", cells)
		_, err := promqlParser.ParseMetricSelector(k.Selector)
		require.NoError(t, err, "selector of row %v", cells)
		out[k] = cells[3]
	}
	return out
}

// docTable reads the table under heading in docs/observability.md: its
// rows but the header, each of n cells (backquotes trimmed), the last (the
// reason) never empty; at least one row.
func docTable(t *testing.T, heading string, n int) [][]string {
	t.Helper()
	f, err := os.Open(notFedDoc)
	require.NoError(t, err)
	defer f.Close()
	var out [][]string
	in, header := false, false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case strings.HasPrefix(line, "## "):
			in, header = line == heading, false
			continue
		case !in || !strings.HasPrefix(line, "|"):
			continue
		}
		cells := strings.Split(strings.Trim(line, "|"), "|")
		require.Len(t, cells, n, "row %q of %s", line, notFedDoc)
		for i := range cells {
			cells[i] = strings.Trim(strings.TrimSpace(cells[i]), "`")
		}
		if !header || strings.HasPrefix(cells[0], "---") {
			header = true
			continue
		}
		require.NotEmpty(t, cells[n-1], "row %q gives no reason", line)
		out = append(out, cells)
	}
	require.NoError(t, sc.Err())
	require.NotEmpty(t, out, "no table under %q in %s", heading, notFedDoc)
	return out
}
