package xdsclient

import (
	"errors"
	"io"

	"github.com/prometheus/client_golang/prometheus"

	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
)

// Reasons of istio_xds_connection_terminations_total, as Istio's ztunnel
// names them.
const (
	// TerminationConnectionError: the stream could not be opened or its
	// first request not sent.
	TerminationConnectionError = "ConnectionError"
	// TerminationError: an open stream failed.
	TerminationError = "Error"
	// TerminationReconnect: pilot ended the stream cleanly (io.EOF), which
	// asks the client to reconnect.
	TerminationReconnect = "Reconnect"
	// TerminationComplete: the client stopped (its context ended).
	TerminationComplete = "Complete"
)

// OtherType is the url label of a response of a type the client does not
// take.
const OtherType = "other"

// Stats counts the client's protocol events.
type Stats struct {
	// Streams is the number of streams opened.
	Streams int64
	// Responses, ACKs and NACKs count responses received and answered.
	Responses, ACKs, NACKs int64
	// Resources and Removals count the resources and removals received
	// (a resume after a reconnect that re-sends nothing adds none).
	Resources, Removals int64
}

// Stats returns the protocol counters.
func (c *Client) Stats() Stats {
	return Stats{Streams: c.streams.Load(), Responses: c.responses.Load(), ACKs: c.acks.Load(), NACKs: c.nacks.Load(),
		Resources: c.resources.Load(), Removals: c.removals.Load()}
}

// metrics are the client's Prometheus series under Istio's ztunnel names:
// istio_xds_connection_terminations_total{reason} and
// istio_xds_message_total{url}. Safe for concurrent use.
type metrics struct {
	terminations *prometheus.CounterVec
	messages     *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		terminations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "istio_xds_connection_terminations_total",
			Help: "The total number of completed connections to xds server, by reason (Istio's ztunnel metric).",
		}, []string{"reason"}),
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "istio_xds_message_total",
			Help: "Total number of xDS responses received, by type URL (Istio's ztunnel metric).",
		}, []string{"url"}),
	}
	for _, r := range []string{TerminationConnectionError, TerminationError, TerminationReconnect, TerminationComplete} {
		m.terminations.WithLabelValues(r) // export zeros
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.terminations, m.messages} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// connectError marks a failure to open a stream or send its first request.
type connectError struct{ err error }

func (e connectError) Error() string { return e.err.Error() }
func (e connectError) Unwrap() error { return e.err }

// terminationReason classifies the error a stream ended with.
func terminationReason(err error) string {
	var ce connectError
	switch {
	case errors.As(err, &ce):
		return TerminationConnectionError
	case errors.Is(err, io.EOF):
		return TerminationReconnect
	}
	return TerminationError
}

// received counts a response of typeURL in Stats and in
// istio_xds_message_total; the label is the type URL if the client takes
// it, else OtherType (a server cannot mint label values).
func (c *Client) received(typeURL string, resources, removals int) {
	c.responses.Add(1)
	c.resources.Add(int64(resources))
	c.removals.Add(int64(removals))
	url := OtherType
	if typeURL == workloadv1.TypeURL || c.handler(typeURL) != nil {
		url = typeURL
	}
	c.metrics.messages.WithLabelValues(url).Inc()
}
