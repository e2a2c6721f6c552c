// Package metrics defines ztunnel's Prometheus metrics: TCP connections and
// bytes per source/destination identity, cluster and network, and refused
// HBONE requests and TLS handshake errors by reason. Collectors are
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

// Metrics holds ztunnel's collectors.
type Metrics struct {
	opened, closed   *prometheus.CounterVec
	sent, received   *prometheus.CounterVec
	refused, tlsErrs *prometheus.CounterVec
	captured         *prometheus.CounterVec
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
	}
	for _, c := range []prometheus.Collector{m.opened, m.closed, m.sent, m.received, m.refused, m.tlsErrs, m.captured} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// ConnLabels identifies a proxied connection in the metrics.
type ConnLabels struct {
	Reporter             string
	SourcePrincipal      string
	DestinationPrincipal string
	SourceCluster        string
	DestinationCluster   string
	SourceNetwork        string
	DestinationNetwork   string
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
}

// Open counts a new connection and returns its accounting handle.
func (m *Metrics) Open(l ConnLabels) *Conn {
	if m == nil {
		return nil
	}
	v := l.values()
	m.opened.WithLabelValues(v...).Inc()
	return &Conn{closed: m.closed.WithLabelValues(v...), sent: m.sent.WithLabelValues(v...), received: m.received.WithLabelValues(v...)}
}

// AddSent counts n bytes sent towards the source.
func (c *Conn) AddSent(n int) {
	if c != nil && n > 0 {
		c.sent.Add(float64(n))
	}
}

// AddReceived counts n bytes received from the source.
func (c *Conn) AddReceived(n int) {
	if c != nil && n > 0 {
		c.received.Add(float64(n))
	}
}

// Close counts the connection as closed. Call it exactly once.
func (c *Conn) Close() {
	if c != nil {
		c.closed.Inc()
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
