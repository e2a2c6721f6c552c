// Package metrics defines ztunnel's Prometheus metrics: TCP connections and
// bytes per source/destination identity, cluster and network, and refused
// HBONE requests and TLS handshake errors by reason, and the connections
// of a drain by outcome (isthmus_drain_connections_total{outcome="drained"
// or "forced"}: when a ztunnel hands its pods to a new one, or stops, the
// connections open then that end by themselves within the grace period,
// and those closed at its end). Collectors are
// registered on an injected registry; all methods are safe for concurrent use
// and a nil *Metrics is a valid no-op.
package metrics

import (
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
)

// Reporter values say which hop reports a connection.
const (
	ReporterSource      = "source"
	ReporterDestination = "destination"
	ReporterGateway     = "gateway"
)

// Directions of captured connections.
const (
	// DirectionOutbound: a pod's connection redirected to its 15001.
	DirectionOutbound = "outbound"
	// DirectionInboundPlaintext: a connection to a pod redirected to its
	// 15006 (not HBONE).
	DirectionInboundPlaintext = "inbound_plaintext"
	// DirectionInboundHBONE: an HBONE connection to a pod's 15008.
	DirectionInboundHBONE = "inbound_hbone"
)

// Metrics holds ztunnel's collectors: its own (isthmus_*) and Istio's
// standard TCP metrics (istio_tcp_*, with Istio's label names), so that
// Istio's dashboards and Kiali's graph work as they are.
type Metrics struct {
	opened, closed   *prometheus.CounterVec
	sent, received   *prometheus.CounterVec
	refused, tlsErrs *prometheus.CounterVec
	captured         *prometheus.CounterVec
	drain            *prometheus.CounterVec
	istio            istioTCP
}

// istioTCP are Istio's TCP metrics, reported by the source and destination
// ztunnels (not by gateways, which would count each connection twice).
type istioTCP struct {
	opened, closed, sent, received *prometheus.CounterVec
	// open is istio_tcp_sockets_open{reporter}: the proxied connections
	// open now (opened and not yet closed), by reporter.
	open *prometheus.GaugeVec
}

// istioLabelNames are the labels of Istio's TCP metrics, as Istio's ztunnel
// reports them.
var istioLabelNames = []string{
	"reporter",
	"source_workload", "source_canonical_service", "source_canonical_revision", "source_workload_namespace",
	"source_principal", "source_app", "source_version", "source_cluster",
	"destination_service", "destination_service_namespace", "destination_service_name",
	"destination_workload", "destination_canonical_service", "destination_canonical_revision", "destination_workload_namespace",
	"destination_principal", "destination_app", "destination_version", "destination_cluster",
	"request_protocol", "response_flags", "connection_security_policy",
}

var connLabelNames = []string{
	"reporter", "source_principal", "destination_principal",
	"source_cluster", "destination_cluster", "source_network", "destination_network",
}

// New creates the collectors and registers them on reg.
func New(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		opened: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_tcp_connections_opened_total", Help: "Proxied TCP connections opened.",
		}, connLabelNames),
		closed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_tcp_connections_closed_total", Help: "Proxied TCP connections closed.",
		}, connLabelNames),
		sent: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_tcp_sent_bytes_total", Help: "Bytes sent back to the source (response direction).",
		}, connLabelNames),
		received: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_tcp_received_bytes_total", Help: "Bytes received from the source (request direction).",
		}, connLabelNames),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_hbone_refused_total", Help: "Refused connections and HBONE requests by reason.",
		}, []string{"reporter", "reason"}),
		tlsErrs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_hbone_handshake_errors_total", Help: "Failed TLS handshakes by reason.",
		}, []string{"reporter", "reason"}),
		captured: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_captured_connections_total", Help: "Connections of enrolled pods accepted by their in-pod listeners, by direction.",
		}, []string{"direction"}),
		drain: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_drain_connections_total",
			Help: "Connections open when this ztunnel began to drain (a handoff to a new ztunnel, or shutdown), by outcome: drained (ended by themselves within the grace period) or forced (closed at its end).",
		}, []string{"outcome"}),
		istio: istioTCP{
			opened: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "istio_tcp_connections_opened_total", Help: "TCP connections opened (Istio's standard metric).",
			}, istioLabelNames),
			closed: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "istio_tcp_connections_closed_total", Help: "TCP connections closed (Istio's standard metric).",
			}, istioLabelNames),
			sent: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "istio_tcp_sent_bytes_total", Help: "Bytes sent to the source, in the response direction (Istio's standard metric).",
			}, istioLabelNames),
			received: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "istio_tcp_received_bytes_total", Help: "Bytes received from the source, in the request direction (Istio's standard metric).",
			}, istioLabelNames),
			open: prometheus.NewGaugeVec(prometheus.GaugeOpts{
				Name: "istio_tcp_sockets_open", Help: "Proxied TCP connections open now, by reporter (Istio's ztunnel metric).",
			}, []string{"reporter"}),
		},
	}
	for _, c := range []prometheus.Collector{m.opened, m.closed, m.sent, m.received, m.refused, m.tlsErrs, m.captured, m.drain,
		m.istio.opened, m.istio.closed, m.istio.sent, m.istio.received, m.istio.open} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// ConnLabels identifies a proxied connection in the metrics. Every value
// comes from the mesh's registry (the ztunnel's store) or a verified
// identity, never from request data; "" is reported as "unknown".
type ConnLabels struct {
	Reporter             string
	SourcePrincipal      string
	DestinationPrincipal string
	SourceCluster        string
	DestinationCluster   string
	SourceNetwork        string
	DestinationNetwork   string

	// Istio's telemetry (istio_tcp_*): the workloads, their canonical
	// service and revision, and the destination service.
	SourceWorkload, SourceNamespace, SourceCanonicalService, SourceCanonicalRevision                     string
	DestinationWorkload, DestinationNamespace, DestinationCanonicalService, DestinationCanonicalRevision string
	DestinationService, DestinationServiceName, DestinationServiceNamespace                              string
	// MutualTLS is set when the connection arrived or left over HBONE
	// (connection_security_policy mutual_tls, else none).
	MutualTLS bool
}

func (l ConnLabels) istioValues() []string {
	or := func(v string) string {
		if v == "" {
			return Unknown
		}
		return safe(v)
	}
	policy := "none"
	if l.MutualTLS {
		policy = "mutual_tls"
	}
	return []string{
		or(l.Reporter),
		or(l.SourceWorkload), or(l.SourceCanonicalService), or(l.SourceCanonicalRevision), or(l.SourceNamespace),
		or(l.SourcePrincipal), or(l.SourceCanonicalService), or(l.SourceCanonicalRevision), or(l.SourceCluster),
		or(l.DestinationService), or(l.DestinationServiceNamespace), or(l.DestinationServiceName),
		or(l.DestinationWorkload), or(l.DestinationCanonicalService), or(l.DestinationCanonicalRevision), or(l.DestinationNamespace),
		or(l.DestinationPrincipal), or(l.DestinationCanonicalService), or(l.DestinationCanonicalRevision), or(l.DestinationCluster),
		"tcp", "-", policy,
	}
}

// Unknown is the label value of anything the registry does not vouch for.
const Unknown = "unknown"

// maxLabelLen bounds a label value; identities and names are far shorter.
const maxLabelLen = 253

func (l ConnLabels) values() []string {
	v := []string{l.Reporter, l.SourcePrincipal, l.DestinationPrincipal, l.SourceCluster,
		l.DestinationCluster, l.SourceNetwork, l.DestinationNetwork}
	for i := range v {
		v[i] = safe(v[i])
	}
	return v
}

// safe returns v, or Unknown when v could not be a label value (invalid
// UTF-8 makes the client library panic) or is implausibly long. Callers
// pass values from the registry, never from requests; this is the last
// line of defence.
func safe(v string) string {
	if len(v) > maxLabelLen || !utf8.ValidString(v) {
		return Unknown
	}
	return v
}

// Conn accounts for one open connection. Its methods are safe for
// concurrent use; a nil *Conn is a no-op.
type Conn struct {
	closed         prometheus.Counter
	sent, received prometheus.Counter
	// Istio's, nil for a gateway hop.
	iclosed, isent, ireceived prometheus.Counter
	iopen                     prometheus.Gauge
}

// Open counts a new connection and returns its accounting handle.
func (m *Metrics) Open(l ConnLabels) *Conn {
	if m == nil {
		return nil
	}
	v := l.values()
	m.opened.WithLabelValues(v...).Inc()
	c := &Conn{closed: m.closed.WithLabelValues(v...), sent: m.sent.WithLabelValues(v...), received: m.received.WithLabelValues(v...)}
	if l.Reporter == ReporterSource || l.Reporter == ReporterDestination {
		iv := l.istioValues()
		m.istio.opened.WithLabelValues(iv...).Inc()
		c.iclosed, c.isent, c.ireceived = m.istio.closed.WithLabelValues(iv...), m.istio.sent.WithLabelValues(iv...), m.istio.received.WithLabelValues(iv...)
		c.iopen = m.istio.open.WithLabelValues(iv[0])
		c.iopen.Inc()
	}
	return c
}

// AddSent counts n bytes sent towards the source.
func (c *Conn) AddSent(n int) {
	if c != nil && n > 0 {
		c.sent.Add(float64(n))
		if c.isent != nil {
			c.isent.Add(float64(n))
		}
	}
}

// AddReceived counts n bytes received from the source.
func (c *Conn) AddReceived(n int) {
	if c != nil && n > 0 {
		c.received.Add(float64(n))
		if c.ireceived != nil {
			c.ireceived.Add(float64(n))
		}
	}
}

// Close counts the connection as closed. Call it exactly once.
func (c *Conn) Close() {
	if c != nil {
		c.closed.Inc()
		if c.iclosed != nil {
			c.iclosed.Inc()
			c.iopen.Dec()
		}
	}
}

// Refused counts a refused connection or request.
func (m *Metrics) Refused(reporter, reason string) {
	if m != nil {
		m.refused.WithLabelValues(safe(reporter), safe(reason)).Inc()
	}
}

// Captured counts a connection an enrolled pod's listener accepted.
func (m *Metrics) Captured(direction string) {
	if m != nil {
		m.captured.WithLabelValues(direction).Inc()
	}
}

// Outcomes of a drain (Drain).
const (
	// DrainDrained: a connection that ended by itself within the grace period.
	DrainDrained = "drained"
	// DrainForced: a connection still open at its end, closed by ztunnel.
	DrainForced = "forced"
)

// Drain counts n connections of a drain with outcome (DrainDrained or
// DrainForced).
func (m *Metrics) Drain(outcome string, n int) {
	if m != nil && n > 0 {
		m.drain.WithLabelValues(outcome).Add(float64(n))
	}
}

// DrainCount returns the drain count for outcome.
func (m *Metrics) DrainCount(outcome string) float64 {
	return counterValue(m, func(m *Metrics) prometheus.Counter { return m.drain.WithLabelValues(outcome) })
}

// CapturedCount returns the captured-connection count for direction.
func (m *Metrics) CapturedCount(direction string) float64 {
	return counterValue(m, func(m *Metrics) prometheus.Counter { return m.captured.WithLabelValues(direction) })
}

// HandshakeError counts a failed TLS handshake.
func (m *Metrics) HandshakeError(reporter, reason string) {
	if m != nil {
		m.tlsErrs.WithLabelValues(safe(reporter), safe(reason)).Inc()
	}
}

// RefusedCount returns the refusal count for reporter and reason (for tests
// and the admin view).
func (m *Metrics) RefusedCount(reporter, reason string) float64 {
	return counterValue(m, func(m *Metrics) prometheus.Counter { return m.refused.WithLabelValues(reporter, reason) })
}

// HandshakeErrorCount returns the handshake error count for reporter and reason.
func (m *Metrics) HandshakeErrorCount(reporter, reason string) float64 {
	return counterValue(m, func(m *Metrics) prometheus.Counter { return m.tlsErrs.WithLabelValues(reporter, reason) })
}

// OpenedCount returns the opened-connection count summed over every label
// set with the given reporter.
func (m *Metrics) OpenedCount(reporter string) float64 {
	if m == nil {
		return 0
	}
	return sumReporter(m, m.opened, reporter)
}

// ClosedCount returns the closed-connection count for reporter.
func (m *Metrics) ClosedCount(reporter string) float64 {
	if m == nil {
		return 0
	}
	return sumReporter(m, m.closed, reporter)
}
