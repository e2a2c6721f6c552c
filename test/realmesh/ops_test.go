package realmesh_test

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/test/framework/install"
	"github.com/isthmus-mesh/isthmus/test/framework/meshup"
	"github.com/isthmus-mesh/isthmus/test/realnode/traffic"
)

// The charts' workloads, as the README installs them.
const (
	ztunnelDS    = "ztunnel"
	cniDS        = "isthmus-cni"
	gatewayDep   = "isthmus-eastwestgateway"
	pilotDep     = "isthmusd"
	readerSA     = "isthmus-reader-service-account"
	restartedAt  = "kubectl.kubernetes.io/restartedAt"
	plainNS      = "plain"
	operationsTO = 5 * time.Minute
)

// operations runs, in order, what a user does to a running mesh, and the
// scenario after each (the client served, the intruder refused), with the
// client's steady traffic (long-lived and new connections) counted while
// each operation runs: no new connection may fail, and where the operation
// does not take a proxy away, no established one may be lost. The table of
// what each operation cost is logged at the end (and written to -report).
func (s *scenario) operations(t *testing.T) {
	both := s.mesh.Clusters
	t.Run("RolloutRestartZtunnel", func(t *testing.T) {
		s.disrupt(t, "`rollout restart` of the source node's ztunnel (cluster-1: surge, in-pod handoff, drain)", false, func() {
			s.rolloutRestart(t, both[:1], "DaemonSet", ztunnelDS)
		})
		s.disrupt(t, "`rollout restart` of the destination node's ztunnel (cluster-2)", false, func() {
			s.rolloutRestart(t, both[1:], "DaemonSet", ztunnelDS)
		})
		s.check(t)
	})
	t.Run("RolloutRestartGateway", func(t *testing.T) {
		s.disrupt(t, "`rollout restart` of both east-west gateways, 2 replicas each (surge, drain: not ready, GOAWAY, grace)", false, func() {
			s.rolloutRestart(t, both, "Deployment", gatewayDep)
		})
		s.check(t)
	})
	t.Run("RolloutRestartPilot", func(t *testing.T) {
		s.disrupt(t, "`rollout restart` of pilot", true, func() {
			s.rolloutRestart(t, both[:1], "Deployment", pilotDep)
		})
		s.check(t)
	})
	t.Run("PilotAway", func(t *testing.T) {
		s.disrupt(t, "pilot scaled to 0 for 15 s, then back until every proxy is synced again", true, func() {
			n := s.proxies(t)
			s.pilotAway(t)
			s.scalePilot(t, 1)
			t0 := time.Now()
			s.xdsStreams(t, "", n)
			t.Logf("the %d proxies synced again %v after pilot was back", n, time.Since(t0).Round(100*time.Millisecond))
		})
		s.check(t)
	})
	t.Run("KillStreamedPilot", func(t *testing.T) {
		s.killStreamedPilot(t)
		s.check(t)
	})
	t.Run("RolloutRestartCNIAgent", func(t *testing.T) {
		s.disrupt(t, "`rollout restart` of the CNI agent in both clusters", true, func() {
			s.rolloutRestart(t, both, "DaemonSet", cniDS)
		})
		s.check(t)
	})
	t.Run("PodCreatedWhileCNIAgentDown", func(t *testing.T) {
		s.disrupt(t, "cluster-1's CNI agent off its node, a pod created (refused until the agent is back)", true, func() { s.podsWhileCNIDown(t) })
		s.check(t)
	})
	t.Run("RemoteSecretRotated", func(t *testing.T) {
		s.disrupt(t, "cluster-2's reader token revoked, cluster-2 registered again", true, func() { s.rotateRemoteSecret(t) })
		s.moveServer(t)
		s.check(t)
	})
	// Only the local environment's API servers are the test's to kill.
	if local, ok := s.mesh.Env.(*meshup.Local); ok {
		t.Run("RemoteAPIServerRestarted", func(t *testing.T) {
			s.disrupt(t, "cluster-2's API server killed, down 20 s, started again", true, func() {
				s.restartAPIServer(t, local.Set.Clusters[1].Cluster)
			})
			s.moveServer(t)
			s.check(t)
		})
	}
	t.Run("NodePodsRecreated", func(t *testing.T) {
		s.recreateNodePods(t)
		s.check(t)
	})
	t.Run("HelmUpgrade", func(t *testing.T) {
		s.disrupt(t, "`helm upgrade --set replicaCount=1` of cluster-2's gateway (one replica drained away)", false, func() {
			s.upgradeGatewayReplicas(t, 1)
		})
		s.check(t)
	})
	t.Run("HelmUninstall", func(t *testing.T) {
		s.uninstallNodeMesh(t)
	})
	t.Logf("the client's traffic during the operations (%d long-lived connections, a new one every %v):\n%s", *longConns, *newEvery, s.table())
	if *reportPath != "" {
		require.NoError(t, os.WriteFile(*reportPath, []byte(s.table()), 0o644))
	}
}

// settle is how long the client's traffic runs on after an operation.
const settle = 5 * time.Second

// disrupt runs op while the client's traffic runs (and settle after it)
// and records it as the table's row step: no new connection may fail, and
// if keeps, no established connection may be lost.
func (s *scenario) disrupt(t *testing.T, step string, keeps bool, op func()) traffic.Result {
	t.Helper()
	p := s.startProbe(t)
	op()
	// The traffic runs on a while after the operation: what breaks as it
	// ends (a drain's last connections, a reconnect) counts too.
	time.Sleep(settle)
	r := s.endProbe(t, p, step)
	if r.NewFailed > 0 || (keeps && r.Lost > 0) {
		s.logsSince(t, p.t0)
	}
	require.Zero(t, r.NewFailed, "new connections failed during %s (first: %s)", step, r.NewError)
	if keeps {
		require.Zero(t, r.Lost, "established connections lost during %s (first: %s)", step, r.LostError)
	}
	return r
}

// logsSince logs what the mesh's pods (ztunnel, the CNI agent, the
// gateways) of both clusters wrote since t0, for a failed operation.
func (s *scenario) logsSince(t *testing.T, t0 time.Time) {
	since := metav1.NewTime(t0.Add(-time.Second))
	for _, c := range s.mesh.Clusters {
		pods, err := c.Client.CoreV1().Pods(meshup.SystemNamespace).List(context.Background(), metav1.ListOptions{})
		if err != nil {
			t.Logf("%s: list pods: %v", c.Name, err)
			continue
		}
		for _, p := range pods.Items {
			if strings.HasPrefix(p.Name, pilotDep) {
				continue
			}
			raw, err := c.Client.CoreV1().Pods(p.Namespace).GetLogs(p.Name, &corev1.PodLogOptions{SinceTime: &since}).DoRaw(context.Background())
			t.Logf("%s: log of %s since %s (%v):\n%s", c.Name, p.Name, since.Format(time.RFC3339), err, raw)
		}
	}
}

// rolloutRestart does what `kubectl rollout restart` does to kind/name in
// the system namespace of each cluster, at once, and waits for each
// rollout to be complete: every replica updated, Ready, no old one left.
func (s *scenario) rolloutRestart(t *testing.T, clusters []meshup.Cluster, kind, name string) {
	patch, err := json.Marshal(map[string]any{"spec": map[string]any{"template": map[string]any{"metadata": map[string]any{
		"annotations": map[string]string{restartedAt: time.Now().Format(time.RFC3339)},
	}}}})
	require.NoError(t, err)
	var wg sync.WaitGroup
	for _, c := range clusters {
		wg.Go(func() {
			var err error
			apps := c.Client.AppsV1()
			if kind == "DaemonSet" {
				_, err = apps.DaemonSets(meshup.SystemNamespace).Patch(t.Context(), name, types.StrategicMergePatchType, patch, metav1.PatchOptions{})
			} else {
				_, err = apps.Deployments(meshup.SystemNamespace).Patch(t.Context(), name, types.StrategicMergePatchType, patch, metav1.PatchOptions{})
			}
			if assert.NoError(t, err, "%s: restart %s/%s", c.Name, kind, name) {
				s.waitRollout(t, c, kind, name)
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
}

// waitRollout waits for kind/name to be rolled out as `kubectl rollout
// status` says, and for its pods to be exactly the updated, Ready ones.
func (s *scenario) waitRollout(t *testing.T, c meshup.Cluster, kind, name string) {
	t0 := time.Now()
	ok := assert.EventuallyWithT(t, func(col *assert.CollectT) {
		apps := c.Client.AppsV1()
		var want int32
		var selector *metav1.LabelSelector
		if kind == "DaemonSet" {
			ds, err := apps.DaemonSets(meshup.SystemNamespace).Get(t.Context(), name, metav1.GetOptions{})
			require.NoError(col, err)
			st := ds.Status
			require.GreaterOrEqual(col, st.ObservedGeneration, ds.Generation, "observed")
			want = st.DesiredNumberScheduled
			require.Equal(col, want, st.UpdatedNumberScheduled, "updated")
			require.Equal(col, want, st.NumberAvailable, "available")
			selector = ds.Spec.Selector
		} else {
			d, err := apps.Deployments(meshup.SystemNamespace).Get(t.Context(), name, metav1.GetOptions{})
			require.NoError(col, err)
			st := d.Status
			require.GreaterOrEqual(col, st.ObservedGeneration, d.Generation, "observed")
			want = *d.Spec.Replicas
			require.Equal(col, want, st.UpdatedReplicas, "updated")
			require.Equal(col, want, st.AvailableReplicas, "available")
			require.Equal(col, want, st.Replicas, "no old replica left")
			selector = d.Spec.Selector
		}
		sel, err := metav1.LabelSelectorAsSelector(selector)
		require.NoError(col, err)
		pods, err := c.Client.CoreV1().Pods(meshup.SystemNamespace).List(t.Context(), metav1.ListOptions{LabelSelector: sel.String()})
		require.NoError(col, err)
		require.Len(col, pods.Items, int(want), "pods of %s (old ones gone)", name)
		for i := range pods.Items {
			require.True(col, meshup.Ready(&pods.Items[i]), "pod %s Ready", pods.Items[i].Name)
		}
	}, operationsTO, time.Second, "%s: rollout of %s/%s", c.Name, kind, name)
	if !ok {
		s.report(t)
		return
	}
	t.Logf("%s: %s/%s rolled out in %v", c.Name, kind, name, time.Since(t0).Round(100*time.Millisecond))
}

// recreateNodePods deletes, at once, every pod of the mesh's and the
// application's namespaces on each cluster's node: the controllers
// re-create theirs (pilot, the gateways, ztunnel, the CNI agent); the test
// re-creates the application's bare pods, the server under a new name.
func (s *scenario) recreateNodePods(t *testing.T) {
	ctx := t.Context()
	var gone []func()
	for _, c := range s.mesh.Clusters {
		node := s.nodeOf(t, c)
		n := 0
		for _, ns := range []string{meshup.SystemNamespace, appNS} {
			pods, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + node})
			require.NoError(t, err)
			for _, p := range pods.Items {
				require.NoError(t, c.Client.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{}))
				gone = append(gone, func() { waitGone(t, c, p.Namespace, p.Name) })
				n++
			}
		}
		t.Logf("%s: deleted the %d pods of node %s", c.Name, n, node)
	}
	for _, wait := range gone {
		wait()
	}
	for _, c := range s.mesh.Clusters {
		require.NoError(t, s.mesh.WaitSystemReady(ctx, c))
	}
	s.runServer()
	s.runClients()
}

// nodeOf is the node the client (cluster-1) or the server (cluster-2)
// runs on.
func (s *scenario) nodeOf(t *testing.T, c meshup.Cluster) string {
	pod := "client"
	if c.Name == s.c2.Name {
		pod = s.server
	}
	p, err := c.Client.CoreV1().Pods(appNS).Get(t.Context(), pod, metav1.GetOptions{})
	require.NoError(t, err)
	return p.Spec.NodeName
}

// rotateRemoteSecret revokes the token pilot reads cluster-2 with (the
// reader's token Secret deleted) and registers cluster-2 again with a new
// one, as create-remote-secret does.
func (s *scenario) rotateRemoteSecret(t *testing.T) {
	ctx := t.Context()
	secrets := s.c2.Client.CoreV1().Secrets(meshup.SystemNamespace)
	list, err := secrets.List(ctx, metav1.ListOptions{FieldSelector: "type=" + string(corev1.SecretTypeServiceAccountToken)})
	require.NoError(t, err)
	var revoked int
	for _, sec := range list.Items {
		if sec.Annotations[corev1.ServiceAccountNameKey] == readerSA {
			require.NoError(t, secrets.Delete(ctx, sec.Name, metav1.DeleteOptions{}))
			revoked++
		}
	}
	require.NotZero(t, revoked, "the reader's token Secret in cluster-2")
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		list, err := secrets.List(ctx, metav1.ListOptions{FieldSelector: "type=" + string(corev1.SecretTypeServiceAccountToken)})
		require.NoError(c, err)
		for _, sec := range list.Items {
			require.NotEqual(c, readerSA, sec.Annotations[corev1.ServiceAccountNameKey], "old token Secret %s still there", sec.Name)
		}
	}, time.Minute, 200*time.Millisecond)
	require.NoError(t, s.mesh.Register(ctx, s.c2.Name))
}

// restartAPIServer kills cluster-2's API server (as a crash would: etcd
// keeps its data), leaves it down for 20 s, long enough for pilot's watches
// of cluster-2, its CNI agent and its kubelet to fail and retry, then starts
// it again and waits until it answers.
func (s *scenario) restartAPIServer(t *testing.T, c *framework.Cluster) {
	require.NoError(t, c.StopAPIServer())
	time.Sleep(20 * time.Second)
	require.NoError(t, c.RestartAPIServer())
	require.EventuallyWithT(t, func(col *assert.CollectT) {
		_, err := s.c2.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(t.Context())
		require.NoError(col, err)
	}, operationsTO, time.Second, "cluster-2's API server ready again")
}

// moveServer moves the server to a new pod: the client reaching it proves
// pilot follows cluster-2 (after a rotation, with the new credential).
func (s *scenario) moveServer(t *testing.T) {
	old := s.server
	s.runServer()
	require.NoError(t, s.c2.Client.CoreV1().Pods(appNS).Delete(t.Context(), old, metav1.DeleteOptions{}))
	waitGone(t, s.c2, appNS, old)
}

// upgradeGatewayReplicas runs `helm upgrade --reuse-values --set
// replicaCount=n` on cluster-2's gateway release, and waits for the
// Deployment to have n replicas, the others gone.
func (s *scenario) upgradeGatewayReplicas(t *testing.T, n int) {
	rel, err := install.Upgrade(t.Context(), s.c2.Config, meshup.SystemNamespace, "isthmus-eastwest",
		filepath.Join(moduleDir, "manifests/eastwest-gateway"), map[string]any{"replicaCount": n}, true, nil)
	require.NoError(t, err)
	require.Equal(t, 2, rel.Version, "the release's second revision")
	s.waitRollout(t, s.c2, "Deployment", gatewayDep)
	d, err := s.c2.Client.AppsV1().Deployments(meshup.SystemNamespace).Get(t.Context(), gatewayDep, metav1.GetOptions{})
	require.NoError(t, err)
	require.Equal(t, int32(n), *d.Spec.Replicas)
}

// uninstallNodeMesh takes cluster-1's nodes out of the mesh as the CNI
// chart's NOTES say (helm upgrade --set uninstallOnExit=true, then helm
// uninstall of the CNI chart, then of ztunnel's): the client, captured
// until then, keeps its plain networking: it reaches a plain Service of
// its own cluster by name, and a new pod starts on the node.
func (s *scenario) uninstallNodeMesh(t *testing.T) {
	ctx := t.Context()
	_, err := install.Upgrade(ctx, s.c1.Config, meshup.SystemNamespace, "isthmus-cni",
		filepath.Join(moduleDir, "manifests/cni"), map[string]any{"uninstallOnExit": true}, true, nil)
	require.NoError(t, err)
	s.waitRollout(t, s.c1, "DaemonSet", cniDS)
	for _, rel := range []string{"isthmus-cni", "isthmus-ztunnel"} {
		_, err := install.Uninstall(s.c1.Config, meshup.SystemNamespace, rel, true, nil)
		require.NoError(t, err, "helm uninstall %s", rel)
	}
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		pods, err := s.c1.Client.CoreV1().Pods(meshup.SystemNamespace).List(ctx, metav1.ListOptions{})
		require.NoError(c, err)
		for _, p := range pods.Items {
			for _, o := range p.OwnerReferences {
				require.False(c, o.Kind == "DaemonSet" && (o.Name == cniDS || o.Name == ztunnelDS), "pod %s of %s left", p.Name, o.Name)
			}
		}
	}, operationsTO, time.Second)

	_, err = s.c1.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: plainNS}}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = s.c1.Client.CoreV1().Services(plainNS).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "local", Namespace: plainNS},
		Spec: corev1.ServiceSpec{Selector: map[string]string{"app": "local"}, Ports: []corev1.ServicePort{{
			Name: "http", Port: 8080, TargetPort: intstr.FromInt32(8080),
		}}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	require.NoError(t, s.mesh.RunPod(ctx, s.c1, meshup.Pod{
		Namespace: plainNS, Name: "local-0", Labels: map[string]string{"app": "local"}, Image: s.mesh.Env.ImageRef(serverImg),
	}), "a pod starts on the node after the uninstall")
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		out, err := s.mesh.Exec(ctx, s.c1, appNS, "client", serverBin, "-get", "http://local."+plainNS+".svc.cluster.local:8080/")
		require.NoError(c, err)
		require.Equal(c, "isthmus realnode server local-0\n", out)
	}, time.Minute, time.Second, "the client, no longer captured, reaches a plain service by its name")
}

// podsWhileCNIDown takes cluster-1's CNI agent off its node (a nodeSelector
// no node has) and creates a client pod in the enrolled namespace: the
// chained plugin finds no agent and fails the pod's sandbox, so it never
// runs uncaptured; once the agent is back the kubelet's retry enrols it,
// and it reaches the server in cluster-2 (which only a captured pod can:
// cluster-1's DNS has no such name).
func (s *scenario) podsWhileCNIDown(t *testing.T) {
	ctx := t.Context()
	dss := s.c1.Client.AppsV1().DaemonSets(meshup.SystemNamespace)
	setSelector := func(sel map[string]any) {
		patch, err := json.Marshal(map[string]any{"spec": map[string]any{"template": map[string]any{"spec": map[string]any{"nodeSelector": sel}}}})
		require.NoError(t, err)
		_, err = dss.Patch(ctx, cniDS, types.StrategicMergePatchType, patch, metav1.PatchOptions{})
		require.NoError(t, err)
	}
	const away = "isthmus.test/no-such-node"
	setSelector(map[string]any{away: "true"})
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		pods, err := s.c1.Client.CoreV1().Pods(meshup.SystemNamespace).List(ctx, metav1.ListOptions{})
		require.NoError(c, err)
		for _, p := range pods.Items {
			for _, o := range p.OwnerReferences {
				require.False(c, o.Kind == "DaemonSet" && o.Name == cniDS, "agent pod %s still there", p.Name)
			}
		}
	}, operationsTO, time.Second, "the CNI agent leaves the node")

	const late = "client-late"
	_, err := s.c1.Client.CoreV1().Pods(appNS).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: late, Namespace: appNS, Labels: map[string]string{"app": late}},
		Spec:       corev1.PodSpec{ServiceAccountName: "client", Containers: []corev1.Container{{Name: "app", Image: s.mesh.Env.ImageRef(serverImg)}}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	// Long enough for the kubelet to try (and fail) the sandbox a few times.
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		p, err := s.c1.Client.CoreV1().Pods(appNS).Get(ctx, late, metav1.GetOptions{})
		require.NoError(t, err)
		for _, cs := range p.Status.ContainerStatuses {
			require.Nil(t, cs.State.Running, "%s runs while no agent can capture it", late)
			require.Nil(t, cs.State.Terminated, "%s ran while no agent could capture it", late)
		}
		time.Sleep(time.Second)
	}
	ev, err := s.c1.Client.CoreV1().Events(appNS).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + late})
	require.NoError(t, err)
	var sandboxFailed bool
	for _, e := range ev.Items {
		if e.Reason == "FailedCreatePodSandBox" {
			sandboxFailed = true
			t.Logf("%s while the agent was away: %s", late, e.Message)
			break
		}
	}
	require.True(t, sandboxFailed, "the kubelet's sandbox for %s failed (the plugin, finding no agent)", late)

	setSelector(map[string]any{away: nil}) // the chart's own selector stays
	s.waitRollout(t, s.c1, "DaemonSet", cniDS)
	require.NoError(t, s.mesh.WaitPod(ctx, s.c1, appNS, late))
	s.expectServed(t, late)
}

// pilotAway scales pilot to zero for a while: the ztunnels and gateways
// keep serving from their last state (their certificates are valid for
// hours).
func (s *scenario) pilotAway(t *testing.T) {
	ctx := t.Context()
	s.scalePilot(t, 0)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		pods, err := s.c1.Client.CoreV1().Pods(meshup.SystemNamespace).List(ctx, metav1.ListOptions{})
		require.NoError(c, err)
		for _, p := range pods.Items {
			require.NotContains(c, p.Name, pilotDep+"-", "pilot pod %s still there", p.Name)
		}
	}, operationsTO, time.Second, "pilot gone")
	// Long enough for every proxy to notice its xDS stream is gone and
	// fail to reconnect a few times.
	time.Sleep(15 * time.Second)
}

// scalePilot sets the replicas of cluster-1's pilot Deployment (its scale
// subresource, as `kubectl scale`) and, unless 0, waits for the rollout.
func (s *scenario) scalePilot(t *testing.T, n int32) {
	ctx := t.Context()
	deps := s.c1.Client.AppsV1().Deployments(meshup.SystemNamespace)
	sc, err := deps.GetScale(ctx, pilotDep, metav1.GetOptions{})
	require.NoError(t, err)
	sc.Spec.Replicas = n
	_, err = deps.UpdateScale(ctx, pilotDep, sc, metav1.UpdateOptions{})
	require.NoError(t, err)
	if n > 0 {
		s.waitRollout(t, s.c1, "Deployment", pilotDep)
	}
}
