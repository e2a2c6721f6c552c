package authz

import "github.com/prometheus/client_golang/prometheus"

// metrics are the Enforcer's. The policy labels (namespace, policy) come
// from the config cluster, which is trusted, and are bounded by the number
// of policies; reason is one of Reasons.
type metrics struct {
	denied, revoked *prometheus.CounterVec
	open            prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	labels := []string{"namespace", "policy", "reason"}
	m := &metrics{
		denied: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_authz_denied_total",
			Help: "Inbound connections refused by authorization, by deciding policy (empty when none decided) and reason.",
		}, labels),
		revoked: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_authz_revoked_total",
			Help: "Open inbound connections closed because a policy change refuses them, by deciding policy and reason.",
		}, labels),
		open: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "isthmus_authz_open_connections",
			Help: "Admitted inbound connections still open, re-checked on every policy change.",
		}),
	}
	for _, c := range []prometheus.Collector{m.denied, m.revoked, m.open} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}
