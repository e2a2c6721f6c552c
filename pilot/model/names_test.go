package model

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestWorkloadNames(t *testing.T) {
	for _, tc := range []struct {
		name         string
		labels       map[string]string
		fromSlice    bool
		workload     string
		canon, revsn string
	}{
		{"reviews-v1-7d8f9c6b5-x2k9q", map[string]string{"pod-template-hash": "7d8f9c6b5", "app": "reviews", "version": "v1"}, false, "reviews-v1", "reviews", "v1"},
		{"db-2", map[string]string{"statefulset.kubernetes.io/pod-name": "db-2", "controller-revision-hash": "db-6f5"}, false, "db", "db", "latest"},
		{"migrate-abcde", map[string]string{"job-name": "migrate"}, false, "migrate", "migrate", "latest"},
		{"node-agent-8xk2p", map[string]string{"controller-revision-hash": "5c9", "pod-template-generation": "3",
			"app.kubernetes.io/name": "agent", "app.kubernetes.io/version": "1.2"}, false, "node-agent", "agent", "1.2"},
		{"solo", nil, false, "solo", "solo", "latest"},
		{"x", map[string]string{"service.istio.io/canonical-name": "c", "service.istio.io/canonical-revision": "r", "app": "a"}, false, "x", "c", "r"},
		{"10.0.0.1", nil, true, "", "", "latest"},
	} {
		w := &Workload{Name: tc.name, Labels: tc.labels, FromSlice: tc.fromSlice}
		require.Equal(t, tc.workload, w.WorkloadName(), tc.name)
		require.Equal(t, tc.canon, w.CanonicalName(), tc.name)
		require.Equal(t, tc.revsn, w.CanonicalRevision(), tc.name)
	}
}
