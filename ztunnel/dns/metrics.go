package dns

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Kind is how a query was answered, the label of the query counter.
type Kind string

// Answer kinds.
const (
	// KindMesh: answered from the catalog (addresses or NODATA).
	KindMesh Kind = "mesh"
	// KindForwarded: an upstream's answer, whatever its rcode.
	KindForwarded Kind = "forwarded"
	// KindNXDomain: a mesh-zone name the catalog does not know.
	KindNXDomain Kind = "nxdomain"
	// KindServFail: no upstream answered.
	KindServFail Kind = "servfail"
	// KindFormErr: a malformed or unsupported query (FORMERR, NOTIMP).
	KindFormErr Kind = "formerr"
)

var kinds = []Kind{KindMesh, KindForwarded, KindNXDomain, KindServFail, KindFormErr}

// RefusedUnknownClient is the one reason of isthmus_dns_refused_total: the
// source is not a client this server answers (Deps.Client said no).
const RefusedUnknownClient = "unknown_client"

// Metrics counts DNS queries by answer kind and times upstream exchanges.
// Methods are safe for concurrent use.
type Metrics struct {
	queries  *prometheus.CounterVec
	refused  *prometheus.CounterVec
	upstream prometheus.Histogram
}

// NewMetrics creates the collectors and registers them on reg (nil: not
// registered).
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		queries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_dns_queries_total",
			Help: "DNS queries answered by ztunnel's DNS proxy, by answer kind (mesh, forwarded, nxdomain, servfail, formerr).",
		}, []string{"kind"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_dns_refused_total",
			Help: "DNS queries dropped unanswered, by reason (unknown_client: not a client of this DNS proxy).",
		}, []string{"reason"}),
		upstream: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "isthmus_dns_upstream_duration_seconds",
			Help:    "Duration of forwarded DNS exchanges, TCP retries included.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14),
		}),
	}
	for _, k := range kinds {
		m.queries.WithLabelValues(string(k)) // export zeros
	}
	m.refused.WithLabelValues(RefusedUnknownClient)
	if reg != nil {
		for _, c := range []prometheus.Collector{m.queries, m.refused, m.upstream} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return m, nil
}

func (m *Metrics) count(k Kind) { m.queries.WithLabelValues(string(k)).Inc() }

func (m *Metrics) refuse(reason string) { m.refused.WithLabelValues(reason).Inc() }
