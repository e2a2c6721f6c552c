package agent

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Failure reasons counted by isthmus_cni_enrolment_failures_total (besides
// zds' ztunnel-refused, ztunnel-timeout and ztunnel-disconnected).
const (
	failPodLookup = "pod-lookup"
	failNetns     = "netns"
	failRecord    = "sandbox-record"
	failRules     = "pod-rules"
	failNodeRules = "node-rules"
	failRelease   = "release"
)

type metrics struct {
	enrolled      prometheus.Gauge
	failures      *prometheus.CounterVec
	pluginEvents  *prometheus.CounterVec
	ztunnels      prometheus.Gauge
	installations *prometheus.CounterVec
	sandbox       *prometheus.CounterVec
}

func newMetrics(reg *prometheus.Registry) (*metrics, error) {
	m := &metrics{
		enrolled: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "isthmus_cni_enrolled_pods",
			Help: "Pods of this node enrolled in the mesh (redirect rules installed).",
		}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_cni_enrolment_failures_total",
			Help: "Enrolments (or releases) that failed, by reason.",
		}, []string{"reason"}),
		pluginEvents: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_cni_plugin_events_total",
			Help: "Events reported by the CNI plugin, by command and result (ok, error).",
		}, []string{"command", "result"}),
		ztunnels: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "isthmus_cni_ztunnel_connections",
			Help: "ztunnels connected to this agent and in step with its pods.",
		}),
		installations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_cni_plugin_installs_total",
			Help: "Writes of the plugin binary or its conflist entry (first install or repair), by what was written.",
		}, []string{"what"}),
		sandbox: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_cni_sandbox_problems_total",
			Help: "Running pods whose sandbox was not found or not trusted (SandboxNotFound, SandboxAddressMismatch, SandboxRecordMismatch: not enrolled) or whose address another namespace carries (DuplicateAddress: enrolled through its own sandbox), by reason; once per pod and reason.",
		}, []string{"reason"}),
	}
	for _, r := range sandboxReasons {
		m.sandbox.WithLabelValues(r)
	}
	for _, c := range []prometheus.Collector{m.enrolled, m.failures, m.pluginEvents, m.ztunnels, m.installations, m.sandbox} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}
