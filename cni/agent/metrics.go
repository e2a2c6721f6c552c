package agent

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/isthmus-mesh/isthmus/cni/zds"
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
	// How ztunnel's own sockets are told apart, and who was refused the
	// ztunnel socket.
	markOnly       prometheus.Gauge
	cgroups        prometheus.Gauge
	ztunnelRefused *prometheus.CounterVec
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
		markOnly: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "isthmus_cni_capture_mark_only",
			Help: "1 while the pods' rules exempt every socket carrying ztunnel's mark (a connected ztunnel reported no cgroup id): any pod process with CAP_NET_RAW can then leave capture.",
		}),
		cgroups: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "isthmus_cni_capture_ztunnel_cgroups",
			Help: "ztunnel cgroups whose marked sockets the pods' rules exempt from capture.",
		}),
		ztunnelRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_cni_ztunnel_refused_total",
			Help: "Connections to the ztunnel socket refused before their snapshot, by reason (peer-not-allowed, bad-hello, peer-cgroup-unknown).",
		}, []string{"reason"}),
	}
	for _, r := range sandboxReasons {
		m.sandbox.WithLabelValues(r)
	}
	for _, r := range []zds.RefusalReason{zds.RefusedPeer, zds.RefusedHello, zds.RefusedCgroup} {
		m.ztunnelRefused.WithLabelValues(string(r))
	}
	for _, c := range []prometheus.Collector{m.enrolled, m.failures, m.pluginEvents, m.ztunnels, m.installations, m.sandbox,
		m.markOnly, m.cgroups, m.ztunnelRefused} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}
