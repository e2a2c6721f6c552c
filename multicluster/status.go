package multicluster

import (
	"encoding/json"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// State is where a cluster is in its life.
type State string

// States of a cluster.
const (
	StatePending     State = "pending"     // registered, client not built yet
	StateSyncing     State = "syncing"     // informers started, not all components synced
	StateSynced      State = "synced"      // every component has synced
	StateTimeout     State = "timeout"     // not synced within the sync timeout; still trying
	StateError       State = "error"       // refused (bad secret or kubeconfig) or failing
	StateUnreachable State = "unreachable" // the API server stopped answering; last state kept
	StateClosing     State = "closing"     // being stopped
)

// AllStates lists every state, for metrics.
var AllStates = []State{StatePending, StateSyncing, StateSynced, StateTimeout, StateError, StateUnreachable, StateClosing}

// Reasons a cluster is in its state (besides the KubeconfigError reasons).
const (
	ReasonSynced           = "Synced"
	ReasonSyncing          = "Syncing"
	ReasonSyncTimeout      = "SyncTimeout"
	ReasonInvalidClusterID = "InvalidClusterID"
	ReasonConfigClusterID  = "ConfigClusterID"
	ReasonDuplicateCluster = "DuplicateClusterID"
	ReasonClientError      = "ClientError"
	ReasonComponentError   = "ComponentError"
	ReasonUnreachable      = "Unreachable"
	ReasonTLSError         = "TLSError"
	ReasonUnauthorized     = "Unauthorized"
	ReasonForbidden        = "Forbidden"
	ReasonRemoved          = "Removed"
	// ReasonExecCredential: the cluster's exec credential plugin failed,
	// timed out or printed no valid ExecCredential (retried with backoff).
	ReasonExecCredential = "ExecCredentialError"
)

// Status is the observable state of one cluster.
type Status struct {
	ID model.ClusterID `json:"id"`
	// Secret is the namespace/name of the Secret that registers the cluster
	// ("" for the config cluster).
	Secret string `json:"secret,omitempty"`
	State  State  `json:"state"`
	Reason string `json:"reason"`
	// Message explains Reason (never holds credentials).
	Message            string    `json:"message,omitempty"`
	LastTransitionTime time.Time `json:"lastTransitionTime"`
	// Generation counts client rebuilds (kubeconfig changes) of the cluster.
	Generation uint64 `json:"generation"`
	// SecretResourceVersion is the resourceVersion of the remote Secret
	// whose kubeconfig this generation runs with: a writer of the Secret
	// (isthmusctl create-remote-secret --rotate) knows that its credential
	// serves once the serving status shows the version its write returned,
	// synced, with nothing pending. Empty for the config cluster.
	SecretResourceVersion string `json:"secretResourceVersion,omitempty"`
	// LastSynced is when the serving generation last reached synced.
	LastSynced time.Time `json:"lastSynced,omitzero"`
	// SyncDuration is how long the serving generation took to sync.
	SyncDuration time.Duration `json:"syncDuration,omitempty"`
	// Pending is the status of a replacement generation that is starting
	// while this one keeps serving (make-before-break), if any.
	Pending *Status `json:"pending,omitempty"`
	// Namespaces are the namespace selectors the serving generation
	// discovers ("all namespaces" without any).
	Namespaces string `json:"namespaces,omitempty"`
	// SelectorError says why the Secret's discovery-selectors annotation
	// was not taken (the cluster keeps Namespaces).
	SelectorError string `json:"selectorError,omitempty"`
}

// metrics are the controller's Prometheus metrics.
type metrics struct {
	clusters     *prometheus.GaugeVec
	syncDuration prometheus.Histogram
	secretEvents *prometheus.CounterVec
	execRuns     *prometheus.CounterVec
	execRejected prometheus.Counter
	kubeEvents   *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		clusters: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "isthmus_remote_clusters", Help: "Clusters known to the multicluster controller, by state.",
		}, []string{"state"}),
		syncDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "isthmus_remote_cluster_sync_duration_seconds", Help: "Time from a cluster's start to synced.",
			Buckets: prometheus.ExponentialBuckets(0.05, 2, 12),
		}),
		secretEvents: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_remote_secret_events_total", Help: "Remote secret events handled, by kind.",
		}, []string{"event"}),
		execRuns: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_remote_exec_credential_runs_total",
			Help: "Runs of remote kubeconfigs' exec credential plugins, by result (ok, failed, timeout, invalid).",
		}, []string{"result"}),
		execRejected: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "isthmus_remote_exec_credential_rejected_total",
			Help: "Exec credentials dropped because a remote API server answered 401 to them.",
		}),
		kubeEvents: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "isthmus_remote_secret_kube_events_total",
			Help: "Kubernetes Events about remote Secrets, by type (Normal, Warning): recorded by this replica, or left to the leader.",
		}, []string{"type", "outcome"}),
	}
	for _, r := range []string{"ok", "failed", "timeout", "invalid"} {
		m.execRuns.WithLabelValues(r)
	}
	for _, typ := range []string{corev1.EventTypeNormal, corev1.EventTypeWarning} {
		for _, o := range []string{eventRecorded, eventLeftToLeader} {
			m.kubeEvents.WithLabelValues(typ, o)
		}
	}
	if reg != nil {
		reg.MustRegister(m.clusters, m.syncDuration, m.secretEvents, m.execRuns, m.execRejected, m.kubeEvents)
	}
	return m
}

func (m *metrics) setStates(all []Status) {
	counts := map[State]int{}
	for _, s := range all {
		counts[s.State]++
	}
	for _, st := range AllStates {
		m.clusters.WithLabelValues(string(st)).Set(float64(counts[st]))
	}
}

// ClusterzHandler serves the clusters' statuses as JSON (pilot's
// /debug/clusterz).
func (c *Controller) ClusterzHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		_ = enc.Encode(c.Statuses())
	})
}

func sortStatuses(s []Status) {
	slices.SortFunc(s, func(a, b Status) int { return strings.Compare(string(a.ID), string(b.ID)) })
}
