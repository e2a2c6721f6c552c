package ca

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the CA's Prometheus instruments; they live in the injected registerer only.
type metrics struct {
	issued  prometheus.Counter
	refused *prometheus.CounterVec
	latency prometheus.Histogram
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	m := &metrics{
		issued: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "isthmus_ca_certificates_issued_total",
			Help: "Workload certificates issued through CreateCertificate.",
		}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_ca_certificate_refusals_total",
			Help: "CreateCertificate requests refused, by reason.",
		}, []string{"reason"}),
		latency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "isthmus_ca_signing_duration_seconds",
			Help: "Time from a CreateCertificate request to its issued certificate (authentication, authorization and signing).",
			// 0.5 ms .. ~4 s: signing alone is sub-millisecond, a TokenReview round trip tens of ms.
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14),
		}),
	}
	return m, errors.Join(reg.Register(m.issued), reg.Register(m.refused), reg.Register(m.latency))
}
