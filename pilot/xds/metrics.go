package xds

import (
	"time"

	resource "github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the server's Prometheus metrics: Isthmus's own (isthmus_xds_*)
// and their Istio-compatible twins (pilot_xds*, pilot_total_xds_rejects,
// pilot_proxy_convergence_time), under Istio's names, types, buckets and
// labels, so that Istio's control-plane dashboard reads them. Each event
// updates both through one method here; no label value comes from a
// request.
type metrics struct {
	pushes           *prometheus.CounterVec
	pushBytes        *prometheus.CounterVec
	nacks            *prometheus.CounterVec
	refused          *prometheus.CounterVec
	clients          *prometheus.GaugeVec
	buildSeconds     prometheus.Histogram
	resourcesChanged prometheus.Counter
	// withheld counts, by reason, the endpoints behind gateways left out
	// of the load assignments built for clients that cannot reach them.
	withheld *prometheus.CounterVec
	istio    istioXDS
	// sent are the push counters of each served type URL, looked up once:
	// every response counts in them.
	sent map[string]sentCounters
}

// istioXDS are Istio's pilot metrics, as pilot/pkg/xds/monitoring.go and
// pkg/xds/monitoring.go of Istio define them.
type istioXDS struct {
	// clients is pilot_xds{version}: connected xDS clients. Istio's version
	// is the client's ISTIO_VERSION metadata; Isthmus turns no request data
	// into a label, so it is always "unknown".
	clients prometheus.Gauge
	// pushes is pilot_xds_pushes{type}, type the short name (metricType).
	pushes *prometheus.CounterVec
	// pushTime is pilot_xds_push_time{type}: from the start of the work a
	// response answers (its request, or the build of the version it carries,
	// whichever is later) until it is handed to the stream.
	pushTime *prometheus.HistogramVec
	// configSize is pilot_xds_config_size_bytes{type}: each response's size.
	configSize *prometheus.HistogramVec
	// convergence is pilot_proxy_convergence_time: from the first change of
	// a build batch until a client is pushed the version it produced.
	convergence prometheus.Histogram
	// rejects is pilot_total_xds_rejects{type}: NACKs.
	rejects *prometheus.CounterVec
}

// UnknownVersion is the version label of pilot_xds.
const UnknownVersion = "unknown"

// Istio's buckets (pilot/pkg/xds/monitoring.go).
var (
	istioPushTimeBuckets    = []float64{.01, .1, 1, 3, 5, 10, 20, 30}
	istioConvergenceBuckets = []float64{.1, .5, 1, 3, 5, 10, 20, 30}
	istioConfigSizeBuckets  = []float64{1, 10000, 1000000, 4000000, 10000000, 40000000}
)

// sentCounters are the collectors a response of one type URL updates.
type sentCounters struct {
	pushes, bytes, istioPushes prometheus.Counter
	pushTime, size             prometheus.Observer
}

// count records one response of size bytes that took took to produce.
func (c sentCounters) count(size int, took time.Duration) {
	c.pushes.Inc()
	c.bytes.Add(float64(size))
	c.istioPushes.Inc()
	c.pushTime.Observe(took.Seconds())
	c.size.Observe(float64(size))
}

// sentOf returns the push counters of typeURL.
func (m *metrics) sentOf(typeURL string) sentCounters {
	if c, ok := m.sent[typeURL]; ok {
		return c
	}
	return m.newSent(typeURL)
}

func (m *metrics) newSent(typeURL string) sentCounters {
	short := metricType(typeURL)
	return sentCounters{
		pushes: m.pushes.WithLabelValues(typeURL), bytes: m.pushBytes.WithLabelValues(typeURL),
		istioPushes: m.istio.pushes.WithLabelValues(short),
		pushTime:    m.istio.pushTime.WithLabelValues(short), size: m.istio.configSize.WithLabelValues(short),
	}
}

// connected counts a stream of protocol opening (delta 1) or closing (-1).
func (m *metrics) connected(protocol string, delta float64) {
	m.clients.WithLabelValues(protocol).Add(delta)
	m.istio.clients.Add(delta)
}

// rejected counts a NACK of a response of typeURL (a type the stream was
// sent: the nonce matched).
func (m *metrics) rejected(typeURL string) {
	m.nacks.WithLabelValues(typeURL).Inc()
	m.istio.rejects.WithLabelValues(metricType(typeURL)).Inc()
}

// metricType is Istio's short name of a type URL (cds, eds, lds, rds, wds,
// wads); Isthmus's own workload and authorization types take the names of
// Istio's equivalents. Anything else is "other".
func metricType(typeURL string) string {
	switch typeURL {
	case resource.ClusterType:
		return "cds"
	case resource.EndpointType:
		return "eds"
	case resource.ListenerType:
		return "lds"
	case resource.RouteType:
		return "rds"
	case WorkloadType, IstioAddressType:
		return "wds"
	case AuthorizationType, IstioAuthorizationType:
		return "wads"
	}
	return "other"
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		pushes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_xds_pushes_total", Help: "xDS responses sent, by type URL.",
		}, []string{"type"}),
		pushBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_xds_push_bytes_total", Help: "Bytes of xDS responses sent, by type URL.",
		}, []string{"type"}),
		nacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_xds_nacks_total", Help: "xDS responses rejected by clients, by type URL.",
		}, []string{"type"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_xds_refused_total", Help: "xDS streams refused by authorization, by reason.",
		}, []string{"reason"}),
		clients: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "isthmus_xds_connected_clients", Help: "Open xDS streams, by protocol (sotw, delta).",
		}, []string{"protocol"}),
		buildSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "isthmus_xds_build_seconds", Help: "Time to rebuild and hand one change batch to the caches.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 4, 10),
		}),
		resourcesChanged: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "isthmus_xds_resources_changed_total", Help: "Resources updated or deleted in the caches.",
		}),
		withheld: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_xds_endpoints_withheld_total",
			Help: "Endpoints behind east-west gateways left out of the load assignments built for clients that cannot reach them, by reason (client_without_tls, no_gateway_tls_port); counted at each build.",
		}, []string{"reason"}),
		istio: istioXDS{
			clients: prometheus.NewGauge(prometheus.GaugeOpts{
				Name: "pilot_xds", Help: "Number of endpoints connected to this pilot using XDS (Istio's metric; version is always unknown).",
				ConstLabels: prometheus.Labels{"version": UnknownVersion},
			}),
			pushes: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "pilot_xds_pushes", Help: "xDS responses sent, by Istio's short type name (Istio's metric).",
			}, []string{"type"}),
			pushTime: prometheus.NewHistogramVec(prometheus.HistogramOpts{
				Name: "pilot_xds_push_time", Help: "Seconds from the request or build a response answers until it is sent, by type (Istio's metric).",
				Buckets: istioPushTimeBuckets,
			}, []string{"type"}),
			configSize: prometheus.NewHistogramVec(prometheus.HistogramOpts{
				Name: "pilot_xds_config_size_bytes", Help: "Distribution of configuration sizes pushed to clients, by type (Istio's metric).",
				Buckets: istioConfigSizeBuckets,
			}, []string{"type"}),
			convergence: prometheus.NewHistogram(prometheus.HistogramOpts{
				Name: "pilot_proxy_convergence_time", Help: "Delay in seconds between a config change and a client being pushed it (Istio's metric).",
				Buckets: istioConvergenceBuckets,
			}),
			rejects: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "pilot_total_xds_rejects", Help: "Total number of xDS responses rejected by clients, by type (Istio's metric).",
			}, []string{"type"}),
		},
	}
	for _, c := range []prometheus.Collector{m.pushes, m.pushBytes, m.nacks, m.refused, m.clients, m.buildSeconds, m.resourcesChanged, m.withheld,
		m.istio.clients, m.istio.pushes, m.istio.pushTime, m.istio.configSize, m.istio.convergence, m.istio.rejects} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	m.sent = make(map[string]sentCounters, len(allTypes)+2)
	for _, t := range append([]string{AuthorizationType, IstioAuthorizationType}, allTypes...) {
		m.sent[t] = m.newSent(t)
		m.istio.rejects.WithLabelValues(metricType(t)) // export zeros, as for pushes
	}
	return m, nil
}
