package multicluster

import (
	"maps"
	"slices"

	"github.com/prometheus/client_golang/prometheus"
)

// ObjectCounter is implemented by components that can say how many objects
// of each kind they hold for their cluster (discovery: pods, services, ...).
// The kinds are the component's own fixed names, never object data.
type ObjectCounter interface {
	ObjectCounts() map[string]int
}

// clusterCollector exports one set of series per registered cluster, read
// from the controller's state at scrape time, so a removed cluster's series
// go with it and nothing is left stale. Only registered clusters appear
// (their IDs passed validation); refused registrations are counted by state
// in isthmus_remote_clusters only. The series are bounded by the number of
// registered clusters: states x clusters, kinds x clusters.
type clusterCollector struct {
	c                                         *Controller
	state, lastSync, generation, objects, syn *prometheus.Desc
}

func newClusterCollector(c *Controller) *clusterCollector {
	id := []string{"cluster_id"}
	return &clusterCollector{
		c: c,
		state: prometheus.NewDesc("isthmus_remote_cluster_state",
			"1 for the state the cluster's serving generation is in, 0 for the others.", append(id, "state"), nil),
		lastSync: prometheus.NewDesc("isthmus_remote_cluster_last_sync_timestamp_seconds",
			"When the cluster's serving generation last reached synced (absent: never).", id, nil),
		syn: prometheus.NewDesc("isthmus_remote_cluster_sync_seconds",
			"How long the cluster's serving generation took to sync (absent: not synced yet).", id, nil),
		generation: prometheus.NewDesc("isthmus_remote_cluster_generation",
			"Client generations of the cluster (a kubeconfig change starts a new one).", id, nil),
		objects: prometheus.NewDesc("isthmus_remote_cluster_objects",
			"Objects the cluster's serving generation holds, by kind.", append(id, "kind"), nil),
	}
}

// Describe implements prometheus.Collector.
func (cc *clusterCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{cc.state, cc.lastSync, cc.syn, cc.generation, cc.objects} {
		ch <- d
	}
}

// clusterSample is what one scrape reads of one cluster.
type clusterSample struct {
	status   Status
	counters []ObjectCounter
}

// Collect implements prometheus.Collector.
func (cc *clusterCollector) Collect(ch chan<- prometheus.Metric) {
	for _, s := range cc.c.clusterSamples() {
		id := string(s.status.ID)
		for _, st := range AllStates {
			v := 0.0
			if s.status.State == st {
				v = 1
			}
			ch <- prometheus.MustNewConstMetric(cc.state, prometheus.GaugeValue, v, id, string(st))
		}
		ch <- prometheus.MustNewConstMetric(cc.generation, prometheus.GaugeValue, float64(s.status.Generation), id)
		if !s.status.LastSynced.IsZero() {
			ch <- prometheus.MustNewConstMetric(cc.lastSync, prometheus.GaugeValue, float64(s.status.LastSynced.UnixNano())/1e9, id)
			ch <- prometheus.MustNewConstMetric(cc.syn, prometheus.GaugeValue, s.status.SyncDuration.Seconds(), id)
		}
		counts := map[string]int{}
		for _, oc := range s.counters {
			for k, n := range oc.ObjectCounts() {
				counts[k] += n
			}
		}
		for _, k := range slices.Sorted(maps.Keys(counts)) {
			ch <- prometheus.MustNewConstMetric(cc.objects, prometheus.GaugeValue, float64(counts[k]), id, k)
		}
	}
}

// clusterSamples reads every registered cluster's status and the object
// counters of its serving generation; the counts themselves are read
// after the controller's lock is released.
func (c *Controller) clusterSamples() []clusterSample {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]clusterSample, 0, len(c.clusters))
	for _, e := range c.clusters {
		s := clusterSample{status: e.status()}
		if e.active != nil {
			s.counters = e.active.objectCounters()
		}
		out = append(out, s)
	}
	return out
}

// objectCounters returns the generation's components that count objects.
func (i *instance) objectCounters() []ObjectCounter {
	i.mu.Lock()
	defer i.mu.Unlock()
	var out []ObjectCounter
	for _, comp := range i.components {
		if oc, ok := comp.(ObjectCounter); ok {
			out = append(out, oc)
		}
	}
	return out
}
