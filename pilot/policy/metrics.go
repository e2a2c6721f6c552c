package policy

import "github.com/prometheus/client_golang/prometheus"

// metrics are the Watcher's; every label has a fixed set of values.
type metrics struct {
	problems *prometheus.GaugeVec
	count    *prometheus.GaugeVec
	absent   *prometheus.GaugeVec
	// events is Istio's pilot_k8s_cfg_events{type,event}: informer events
	// by kind (AuthorizationPolicy, PeerAuthentication) and event (add,
	// update, delete).
	events *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		problems: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "isthmus_policy_problems",
			Help: "Policies that ztunnel does not enforce as written, by kind and reason (see /debug/authorizationz).",
		}, []string{"kind", "reason"}),
		count: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "isthmus_policies",
			Help: "Policies read from the config cluster, by kind.",
		}, []string{"kind"}),
		absent: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "isthmus_policy_crd_absent",
			Help: "1 when the config cluster does not serve the kind's CRD (no such policy can exist).",
		}, []string{"kind"}),
		events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pilot_k8s_cfg_events",
			Help: "Events from k8s config: informer events on policies, by kind (type) and event (Istio's metric).",
		}, []string{"type", "event"}),
	}
	for _, c := range []prometheus.Collector{m.problems, m.count, m.absent, m.events} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// set publishes the counts of s.
func (m *metrics) set(s *Snapshot, absent []string) {
	counts := s.ProblemCounts()
	for _, kind := range kindNames {
		for _, r := range Reasons {
			m.problems.WithLabelValues(kind, r).Set(float64(counts[[2]string{kind, r}]))
		}
		v := 0.0
		for _, a := range absent {
			if a == kind {
				v = 1
			}
		}
		m.absent.WithLabelValues(kind).Set(v)
	}
	m.count.WithLabelValues(KindAuthorizationPolicy).Set(float64(len(s.policies)))
	m.count.WithLabelValues(KindPeerAuthentication).Set(float64(len(s.peerAuths)))
}
