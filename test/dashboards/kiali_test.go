package dashboards_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Kiali (github.com/kiali/kiali) is not a Go module the test can read from
// the module cache, so the queries its traffic graph sends for TCP traffic
// are written out here as templates, from these functions of Kiali's
// source (facts about the queries, not Kiali's code; files as of commits
// 754587789a8b, c6344d0f7c94 and 76fb7e1e07b7 of kiali/kiali):
//
//   - graph/telemetry/istio/istio.go, buildNamespaceTrafficMap, its "TCP
//     Byte traffic" section: for each of istio_tcp_received_bytes_total and
//     istio_tcp_sent_bytes_total (the graph's "total" TCP rate), three
//     queries per namespace of the graph: (0) source telemetry of traffic
//     into the namespace's services that reached no workload, (1)
//     destination telemetry of traffic into the namespace, (2) source
//     telemetry of traffic out of it; each `sum(rate(...[<duration>s]))
//     by (<tcp group>) > 0` (the "> 0" drops idle edges).
//   - graph/telemetry/istio/appender/security_policy.go, appendGraph: the
//     securityPolicy appender (the graph's mTLS badges and principals):
//     destination telemetry of traffic from other namespaces, and of
//     traffic from the namespace OR'd with ztunnel source telemetry (its
//     ambient handling), grouped by both ends, their principals and
//     connection_security_policy.
//   - graph/telemetry/istio/util/util.go: GetReporter
//     (`reporter=~"waypoint|source"` or `..|destination"` for the graph's
//     default ambient traffic "total", and for "waypoint"; a plain
//     reporter="source" for "ztunnel" and "none"), GetApp (no app matcher
//     for "total" and "ztunnel"; `app!="ztunnel"` for "waypoint" and
//     "none", which leaves an Isthmus mesh's graph empty), and
//     PromQueryAppender, which wraps every query in round(..., 0.001).
//   - graph/options.go: the defaults, ambient traffic "total", duration
//     10m, TCP rate "sent" (istio_tcp_received_bytes_total: Kiali reads
//     L4 telemetry flipped); the test runs the "total" TCP rate, both
//     byte counters.
//
// Kiali's graph reads no istio_tcp_connections_opened_total (its metrics
// pages read the byte counters too): Istio's mesh, service and workload
// dashboards, which TestDashboards also runs, cover the connection
// counters.

// kialiDuration is the graph's duration (its [<n>s] range): Kiali's
// default, 10m.
const kialiDuration = "600s"

// kialiSource and kialiDestination are GetReporter's matchers for the
// default ambient traffic, "total".
const (
	kialiSource      = `reporter=~"waypoint|source"`
	kialiDestination = `reporter=~"waypoint|destination"`
)

// kialiTCPGroup and kialiSecurityGroup are the by() lists of the graph's
// TCP queries and of the securityPolicy appender.
const (
	kialiTCPGroup = "app,source_cluster,source_workload_namespace,source_workload,source_canonical_service,source_canonical_revision," +
		"destination_cluster,destination_service_namespace,destination_service,destination_service_name,destination_workload_namespace," +
		"destination_workload,destination_canonical_service,destination_canonical_revision,response_flags"
	kialiSecurityGroup = "source_cluster,source_workload_namespace,source_workload,source_canonical_service,source_canonical_revision,source_principal," +
		"destination_cluster,destination_service_namespace,destination_service_name,destination_workload_namespace,destination_workload," +
		"destination_canonical_service,destination_canonical_revision,destination_principal,connection_security_policy"
)

// kialiTCPMetrics are the metrics of the graph's "total" TCP rate.
var kialiTCPMetrics = []string{"istio_tcp_received_bytes_total", "istio_tcp_sent_bytes_total"}

// kialiNamespaces are the namespaces the test's graph shows: the client
// buyer and the server cart in shop (cluster-1), the server web in front
// (cluster-2).
var kialiNamespaces = []string{"shop", "front"}

// kialiQuery is one query Kiali sends for the graph of a namespace.
type kialiQuery struct {
	// Panel names the query in the docs table (dashboard "kiali").
	Panel string
	// Namespace is the graph's namespace; Expr the query.
	Namespace, Expr string
}

// kialiQueries returns the graph's TCP queries and the securityPolicy
// appender's, for each namespace of kialiNamespaces.
func kialiQueries() []kialiQuery {
	var out []kialiQuery
	round := func(q string) string { return "round(" + q + ",0.001)" }
	for _, ns := range kialiNamespaces {
		var spOut, spIn []string
		for _, m := range kialiTCPMetrics {
			graph := []struct{ panel, sel string }{
				{"graph: unserviced incoming (source)", fmt.Sprintf(`%s,source_workload_namespace!=%q,destination_workload_namespace="unknown",destination_workload="unknown",destination_service=~"^.+\\.%s\\..+$"`, kialiSource, ns, ns)},
				{"graph: incoming (destination)", fmt.Sprintf(`%s,destination_workload_namespace=%q`, kialiDestination, ns)},
				{"graph: outgoing (source)", fmt.Sprintf(`%s,source_workload_namespace=%q`, kialiSource, ns)},
			}
			for _, g := range graph {
				out = append(out, kialiQuery{g.panel, ns, round(fmt.Sprintf(`sum(rate(%s{%s} [%s])) by (%s) > 0`, m, g.sel, kialiDuration, kialiTCPGroup))})
			}
			sp := func(sel string) string {
				return fmt.Sprintf(`(sum(rate(%s{%s}[%s])) by (%s) > 0)`, m, sel, kialiDuration, kialiSecurityGroup)
			}
			spOut = append(spOut, sp(fmt.Sprintf(`%s,source_workload_namespace!=%q,destination_service_namespace=%q`, kialiDestination, ns, ns)))
			spIn = append(spIn, sp(fmt.Sprintf(`%s,source_workload_namespace=%q`, kialiDestination, ns)))
		}
		for _, m := range kialiTCPMetrics {
			spIn = append(spIn, fmt.Sprintf(`(sum(rate(%s{app="ztunnel",reporter="source",source_workload_namespace=%q}[%s])) by (%s) > 0)`, m, ns, kialiDuration, kialiSecurityGroup))
		}
		out = append(out,
			kialiQuery{"securityPolicy: from other namespaces", ns, round(strings.Join(spOut, " OR "))},
			kialiQuery{"securityPolicy: from the namespace", ns, round(strings.Join(spIn, " OR "))})
	}
	return out
}

// kialiPanels groups the queries as panels (one per kind of query, every
// namespace and metric a target), for the runner.
func kialiPanels() []panel {
	var out []panel
	for _, q := range kialiQueries() {
		i := slices.IndexFunc(out, func(p panel) bool { return p.Title == q.Panel })
		if i < 0 {
			out = append(out, panel{Title: q.Panel})
			i = len(out) - 1
		}
		out[i].Targets = append(out[i].Targets, struct{ Expr string }{q.Expr})
	}
	return out
}

// edge is one connection of the test's traffic, as Kiali should draw it.
type edge struct {
	srcNS, srcWorkload, srcCluster string
	dstNS, dstWorkload, dstCluster string
}

// String is the edge as the docs table names it.
func (e edge) String() string {
	return fmt.Sprintf("%s/%s (%s) -> %s/%s (%s)", e.srcNS, e.srcWorkload, e.srcCluster, e.dstNS, e.dstWorkload, e.dstCluster)
}

// kialiEdges are the test's connections (traffic() in setup_test.go; bare
// pods are their own workloads): buyer in shop (cluster-1, network-1) to
// web in front (cluster-2, network-2) and to cart in shop, and web to cart.
var kialiEdges = []edge{
	{"shop", "buyer-0", "cluster-1", "front", "web-0", "cluster-2"},
	{"front", "web-0", "cluster-2", "shop", "cart-0", "cluster-1"},
	{"shop", "buyer-0", "cluster-1", "shop", "cart-0", "cluster-1"},
}

// kialiEdgeQueries says which of the graph's queries, run for namespace ns,
// carry e: the destination telemetry of its destination's namespace, the
// source telemetry of its source's, and the securityPolicy query matching
// where its source is.
func (e edge) kialiEdgeQueries(panel, ns string) bool {
	switch panel {
	case "graph: incoming (destination)":
		return ns == e.dstNS
	case "graph: outgoing (source)":
		return ns == e.srcNS
	case "securityPolicy: from other namespaces":
		return ns == e.dstNS && e.srcNS != e.dstNS
	case "securityPolicy: from the namespace":
		return ns == e.srcNS
	}
	return false
}

// drawn reports whether Kiali draws e from the series m (of a graph query;
// of a securityPolicy query when mtls): both ends named as Kiali reads
// them (populateTrafficMap skips a series whose source namespace is known
// but whose workload and canonical service are not, or whose source or
// destination cluster is "unknown"), and for the mTLS badge
// connection_security_policy="mutual_tls".
func (e edge) drawn(m model.LabelSet, mtls bool) bool {
	for k, v := range map[string]string{
		"source_workload_namespace": e.srcNS, "source_workload": e.srcWorkload, "source_cluster": e.srcCluster,
		"destination_workload_namespace": e.dstNS, "destination_workload": e.dstWorkload, "destination_cluster": e.dstCluster,
	} {
		if m[model.LabelName(k)] != model.LabelValue(v) {
			return false
		}
	}
	if mtls {
		return m["connection_security_policy"] == "mutual_tls" && m["source_principal"] != "unknown" && m["destination_principal"] != "unknown"
	}
	for _, l := range []string{"source_canonical_service", "source_canonical_revision", "destination_service_namespace",
		"destination_service", "destination_service_name", "destination_canonical_service", "destination_canonical_revision"} {
		if m[model.LabelName(l)] == "" {
			return false
		}
	}
	return true
}

// kialiEdgesDoc heads the docs table of the edges and queries for which
// Isthmus's telemetry does not let Kiali draw an edge.
const kialiEdgesDoc = "## Kiali graph edges Isthmus does not feed"

// checkKialiEdges runs the graph's incoming and outgoing queries and the
// securityPolicy queries and, for each edge of the test's traffic and each
// query family that carries it, requires a series from which Kiali draws
// the edge (see drawn), unless docs/observability.md lists the pair as
// not fed, and then requires none (the test fails when Isthmus starts to
// feed it: remove the row).
func checkKialiEdges(t *testing.T, r *runner) {
	type key struct{ Edge, Panel string }
	listed := map[key]bool{}
	for _, row := range docTable(t, kialiEdgesDoc, 3) {
		listed[key{row[0], row[1]}] = true
	}
	used := map[key]bool{}
	drawn := map[key]bool{}
	for _, q := range kialiQueries() {
		vec := r.vector(t, q.Expr)
		for _, e := range kialiEdges {
			if !e.kialiEdgeQueries(q.Panel, q.Namespace) {
				continue
			}
			k := key{e.String(), q.Panel}
			used[k] = true
			drawn[k] = drawn[k] || slices.ContainsFunc(vec, func(s promql.Sample) bool {
				return e.drawn(labelSet(s), strings.HasPrefix(q.Panel, "securityPolicy"))
			})
		}
	}
	for k := range used {
		if listed[k] {
			assert.False(t, drawn[k], "kiali: %s is drawn from %q, but docs list it as not fed: remove the row", k.Edge, k.Panel)
		} else {
			assert.True(t, drawn[k], "kiali: no series of %q draws %s, and docs do not list it (| %s | %s | reason |)", k.Panel, k.Edge, k.Edge, k.Panel)
		}
		t.Logf("kiali edge %s, %s: drawn %v", k.Edge, k.Panel, drawn[k])
	}
	for k := range listed {
		assert.True(t, used[k], "docs list %v, which is no edge and query of the test", k)
	}
}

// labelSet returns the sample's labels as a model.LabelSet.
func labelSet(s promql.Sample) model.LabelSet {
	out := model.LabelSet{}
	s.Metric.Range(func(l labels.Label) { out[model.LabelName(l.Name)] = model.LabelValue(l.Value) })
	return out
}

// vector runs expr as an instant query at the runner's time and returns its
// vector.
func (r *runner) vector(t *testing.T, expr string) promql.Vector {
	t.Helper()
	q, err := r.engine.NewInstantQuery(t.Context(), r.db, nil, expr, r.at)
	require.NoError(t, err, expr)
	defer q.Close()
	res := q.Exec(t.Context())
	require.NoError(t, res.Err, expr)
	vec, err := res.Vector()
	require.NoError(t, err, expr)
	return vec
}
