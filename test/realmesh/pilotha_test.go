package realmesh_test

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/test/framework/install"
	"github.com/isthmus-mesh/isthmus/test/framework/meshup"
)

// killStreamedPilot runs pilot with two replicas (helm upgrade --set
// replicaCount=2), finds with `isthmusctl proxy-status` the replica the
// client's node's ztunnel streams from, and kills it (deleted with no
// grace period, as a crashed node would lose it) while the client's
// traffic runs: every xDS client it served (both clusters' ztunnels and
// gateways) streams from the other replica again, synced, and no
// connection fails. Once the replacement runs, the replica of the other
// role (the leader of the Lease, or a follower) is killed the same way, so
// that both roles are. Then pilot goes back to one replica (helm upgrade),
// the proxies of the replica scaled away moving too, with no connection
// failed either.
func (s *scenario) killStreamedPilot(t *testing.T) {
	s.upgradePilotReplicas(t, 2)
	n := s.proxies(t)
	before := s.xdsStreams(t, "", n)
	ztunnel := ztunnelNodeID(s.nodeOf(t, s.c1))
	var from string
	for _, st := range before {
		if st.ztunnel() && st.NodeID == ztunnel {
			from = st.Pilot
		}
	}
	require.NotEmpty(t, from, "the pilot replica %s streams from, among %d streams", ztunnel, len(before))
	leader := s.pilotLeader(t)
	role, other := "leader", "follower"
	if from != leader {
		role, other = other, role
	}
	s.disrupt(t, "pilot with 2 replicas: the one the ztunnels stream from ("+role+") killed (no grace)", true, func() {
		s.killPilot(t, from, n)
	})
	s.waitRollout(t, s.c1, "Deployment", pilotDep)
	next := s.pilotLeader(t)
	if other == "follower" {
		next = s.pilotOther(t, next)
	}
	s.disrupt(t, "pilot with 2 replicas: the "+other+" killed (no grace)", true, func() { s.killPilot(t, next, n) })
	s.waitRollout(t, s.c1, "Deployment", pilotDep)
	s.disrupt(t, "pilot back to one replica (`helm upgrade --set replicaCount=1`), until every proxy is synced again", true, func() {
		s.upgradePilotReplicas(t, 1)
		s.xdsStreams(t, "", n)
	})
}

// killPilot deletes the pilot pod with no grace period and waits until
// the n proxies stream, synced, from the other replicas.
func (s *scenario) killPilot(t *testing.T, pod string, n int) {
	zero := int64(0)
	require.NoError(t, s.c1.Client.CoreV1().Pods(meshup.SystemNamespace).Delete(t.Context(), pod, metav1.DeleteOptions{GracePeriodSeconds: &zero}))
	t0 := time.Now()
	after := s.xdsStreams(t, pod, n)
	t.Logf("%d xDS streams synced again %v after %s was killed", len(after), time.Since(t0).Round(100*time.Millisecond), pod)
	for _, st := range after {
		t.Logf("  %s (%s) streams from %s", st.NodeID, st.Identity, st.Pilot)
	}
}

// runningPods returns the names of cluster c's running pods (not being
// deleted) of the mesh's namespace that selector finds.
func runningPods(ctx context.Context, col require.TestingT, c meshup.Cluster, selector string) []string {
	pods, err := c.Client.CoreV1().Pods(meshup.SystemNamespace).List(ctx, metav1.ListOptions{LabelSelector: selector})
	require.NoError(col, err)
	var names []string
	for _, p := range pods.Items {
		if p.DeletionTimestamp == nil && p.Status.Phase == corev1.PodRunning {
			names = append(names, p.Name)
		}
	}
	return names
}

// pilotLeader waits until a running pilot pod holds the leader Lease
// (its identity is <pod name>-<pid>) and returns its name.
func (s *scenario) pilotLeader(t *testing.T) string {
	var leader string
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		l, err := s.c1.Client.CoordinationV1().Leases(meshup.SystemNamespace).Get(t.Context(), server.LeaseName, metav1.GetOptions{})
		require.NoError(c, err)
		require.NotNil(c, l.Spec.HolderIdentity, "the Lease has a holder")
		leader = ""
		for _, p := range runningPods(t.Context(), c, s.c1, "app="+pilotDep) {
			if strings.HasPrefix(*l.Spec.HolderIdentity, p+"-") {
				leader = p
			}
		}
		require.NotEmpty(c, leader, "the Lease's holder %s is a running pilot pod", *l.Spec.HolderIdentity)
	}, operationsTO, time.Second, "pilot's leader")
	return leader
}

// pilotOther returns the running pilot pod that is not pod.
func (s *scenario) pilotOther(t *testing.T, pod string) string {
	pods := runningPods(t.Context(), t, s.c1, "app="+pilotDep)
	for _, p := range pods {
		if p != pod {
			return p
		}
	}
	require.FailNow(t, "no pilot pod besides "+pod, "running: %v", pods)
	return ""
}

// xdsStream is one xDS stream as `isthmusctl proxy-status -o json` shows it.
type xdsStream struct {
	NodeID   string `json:"nodeId"`
	Identity string `json:"identity"`
	Pilot    string `json:"pilot"`
	Types    map[string]struct {
		Sent  string `json:"sentVersion"`
		Acked string `json:"ackedVersion"`
	} `json:"types"`
}

// ztunnel reports whether the stream is a node ztunnel's (the gateways
// share its node id on their node, not its identity).
func (st xdsStream) ztunnel() bool { return strings.HasSuffix(st.Identity, "/sa/"+ztunnelDS) }

// proxies is the number of pilot's xDS clients: the running ztunnel and
// gateway pods of both clusters.
func (s *scenario) proxies(t *testing.T) int {
	var n int
	for _, c := range s.mesh.Clusters {
		n += len(runningPods(t.Context(), t, c, "app in ("+ztunnelDS+","+gatewayDep+")"))
	}
	return n
}

// xdsStreams waits until the pilot replicas hold want streams, none of
// them on not, each with its workload addresses synced (the last response
// acknowledged), and returns them.
func (s *scenario) xdsStreams(t *testing.T, not string, want int) []xdsStream {
	t.Helper()
	var streams []xdsStream
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		out, err := s.isthmusctl(t, s.c1, "proxy-status", "-o", "json")
		require.NoError(c, err)
		streams = nil
		require.NoError(c, json.Unmarshal(out, &streams))
		require.Len(c, streams, want, "xDS streams (one per ztunnel and gateway)")
		for _, st := range streams {
			require.NotEqual(c, not, st.Pilot, "%s still streams from %s", st.NodeID, not)
			ts := st.Types[workloadv1.TypeURL]
			require.NotEmpty(c, ts.Sent, "%s (%s): nothing sent by %s yet", st.NodeID, st.Identity, st.Pilot)
			require.Equal(c, ts.Sent, ts.Acked, "%s (%s): %s's last response not acknowledged", st.NodeID, st.Identity, st.Pilot)
		}
	}, operationsTO, time.Second, "the pilot replicas' xDS streams")
	return streams
}

// ztunnelNodeID is the xDS node id of the ztunnel of a node (the ztunnel
// chart's default).
func ztunnelNodeID(node string) string { return "ztunnel~" + node + "." + meshup.SystemNamespace }

// upgradePilotReplicas runs `helm upgrade --reuse-values --set
// replicaCount=n` on cluster-1's pilot release and waits for the rollout.
func (s *scenario) upgradePilotReplicas(t *testing.T, n int) {
	_, err := install.Upgrade(t.Context(), s.c1.Config, meshup.SystemNamespace, "isthmus-pilot",
		filepath.Join(moduleDir, "manifests/pilot"), map[string]any{"replicaCount": n}, true, nil)
	require.NoError(t, err)
	s.waitRollout(t, s.c1, "Deployment", pilotDep)
}

// streamedFrom waits until exactly one pilot pod other than not lists the
// xDS client id with its workload addresses synced (the last response
// acknowledged), and returns that pod's name.
func (s *scenario) streamedFrom(t *testing.T, id, not string) string {
	t.Helper()
	var pilot string
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		out, err := s.isthmusctl(t, s.c1, "proxy-status", "-o", "json")
		require.NoError(c, err)
		var clients []struct {
			NodeID string `json:"nodeId"`
			Pilot  string `json:"pilot"`
			Types  map[string]struct {
				Sent  string `json:"sentVersion"`
				Acked string `json:"ackedVersion"`
			} `json:"types"`
		}
		require.NoError(c, json.Unmarshal(out, &clients))
		var pilots []string
		for _, cl := range clients {
			if cl.NodeID == id {
				pilots = append(pilots, cl.Pilot)
				ts := cl.Types[workloadv1.TypeURL]
				require.NotEmpty(c, ts.Sent, "%s: nothing sent by %s yet", id, cl.Pilot)
				require.Equal(c, ts.Sent, ts.Acked, "%s: %s's last response not acknowledged", id, cl.Pilot)
			}
		}
		require.Len(c, pilots, 1, "%s streams from one pilot (proxy-status lists %v)", id, pilots)
		require.NotEqual(c, not, pilots[0], "%s still streams from %s", id, not)
		pilot = pilots[0]
	}, operationsTO, time.Second, "the ztunnel %s streams from a pilot replica", id)
	return pilot
}

// isthmusctl runs the isthmusctl of this tree (built once per scenario)
// with the kubeconfig of cluster c, and returns its standard output; the
// error carries its standard error.
func (s *scenario) isthmusctl(t *testing.T, c meshup.Cluster, args ...string) ([]byte, error) {
	s.ctlOnce.Do(func() {
		dir, err := os.MkdirTemp("", "realmesh-isthmusctl")
		if err != nil {
			s.ctlErr = err
			return
		}
		s.ctlDir = dir
		bin := filepath.Join(dir, "isthmusctl")
		build := exec.CommandContext(t.Context(), "go", "build", "-o", bin, "./cmd/isthmusctl")
		build.Dir = moduleDir
		if out, err := build.CombinedOutput(); err != nil {
			s.ctlErr = &cmdError{err: err, out: out}
		}
	})
	require.NoError(t, s.ctlErr, "go build isthmusctl")
	kcPath := filepath.Join(s.ctlDir, c.Name+".kubeconfig")
	if _, err := os.Stat(kcPath); err != nil {
		kc, err := meshup.Kubeconfig(c)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(kcPath, kc, 0o600))
	}
	cmd := exec.CommandContext(t.Context(), filepath.Join(s.ctlDir, "isthmusctl"), args...)
	cmd.Args = append(cmd.Args, "--kubeconfig", kcPath)
	out, err := cmd.Output()
	if ee, ok := err.(*exec.ExitError); ok {
		return out, &cmdError{err: err, out: ee.Stderr}
	}
	return out, err
}

// cmdError is a command's failure with what it printed.
type cmdError struct {
	err error
	out []byte
}

func (e *cmdError) Error() string { return e.err.Error() + ": " + string(e.out) }
