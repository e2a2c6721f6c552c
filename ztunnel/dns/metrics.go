package dns

import (
	mdns "github.com/miekg/dns"
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

// Metrics counts DNS queries by answer kind and times upstream exchanges,
// and counts the queries under Istio's ztunnel name too
// (istio_dns_requests_total). Methods are safe for concurrent use.
type Metrics struct {
	queries  *prometheus.CounterVec
	refused  *prometheus.CounterVec
	upstream prometheus.Histogram
	// istioRequests is istio_dns_requests_total{request_query_type,
	// request_protocol, source_canonical_service, source_canonical_revision}:
	// every query the handler answers (or drops as a response). The query
	// type is one of queryTypes or "other"; the source labels are
	// "unknown" (the DNS client carries no workload).
	istioRequests *prometheus.CounterVec
}

// queryTypes are the query types istio_dns_requests_total names; any other
// is "other", so that a client cannot mint label values.
var queryTypes = map[uint16]string{
	mdns.TypeA: "a", mdns.TypeAAAA: "aaaa", mdns.TypeSRV: "srv", mdns.TypeCNAME: "cname", mdns.TypePTR: "ptr",
	mdns.TypeTXT: "txt", mdns.TypeMX: "mx", mdns.TypeNS: "ns", mdns.TypeSOA: "soa", mdns.TypeHTTPS: "https",
	mdns.TypeSVCB: "svcb", mdns.TypeANY: "any",
}

// Unknown is the value of the source labels of istio_dns_requests_total.
const Unknown = "unknown"

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
		istioRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "istio_dns_requests_total",
			Help: "Total number of DNS requests (Istio's ztunnel metric).",
		}, []string{"request_query_type", "request_protocol", "source_canonical_service", "source_canonical_revision"}),
	}
	for _, k := range kinds {
		m.queries.WithLabelValues(string(k)) // export zeros
	}
	m.refused.WithLabelValues(RefusedUnknownClient)
	if reg != nil {
		for _, c := range []prometheus.Collector{m.queries, m.refused, m.upstream, m.istioRequests} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return m, nil
}

func (m *Metrics) count(k Kind) { m.queries.WithLabelValues(string(k)).Inc() }

// served counts a query the handler took, of kind k, over TCP or UDP.
func (m *Metrics) served(k Kind, req *mdns.Msg, tcp bool) {
	m.count(k)
	qtype := "other"
	if len(req.Question) == 1 {
		if name, ok := queryTypes[req.Question[0].Qtype]; ok {
			qtype = name
		}
	}
	proto := "udp"
	if tcp {
		proto = "tcp"
	}
	m.istioRequests.WithLabelValues(qtype, proto, Unknown, Unknown).Inc()
}

func (m *Metrics) refuse(reason string) { m.refused.WithLabelValues(reason).Inc() }
