package install_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/isthmus-mesh/isthmus/test/framework/install"
	"github.com/isthmus-mesh/isthmus/test/framework/realnode"
)

// workload is a Deployment or DaemonSet the charts made.
type workload struct {
	kind, name string
	selector   labels.Selector
	images     []string
}

func (w workload) String() string { return w.kind + "/" + w.name }

// workloads lists the Deployments and DaemonSets in the system namespace.
func workloads(t *testing.T, env *realnode.Env) []workload {
	t.Helper()
	c := env.Cluster.Client
	var out []workload
	deps, err := c.AppsV1().Deployments(systemNS).List(t.Context(), metav1.ListOptions{})
	require.NoError(t, err)
	for _, d := range deps.Items {
		sel, err := metav1.LabelSelectorAsSelector(d.Spec.Selector)
		require.NoError(t, err)
		out = append(out, workload{"Deployment", d.Name, sel, containerImages(d.Spec.Template.Spec)})
	}
	dss, err := c.AppsV1().DaemonSets(systemNS).List(t.Context(), metav1.ListOptions{})
	require.NoError(t, err)
	for _, d := range dss.Items {
		sel, err := metav1.LabelSelectorAsSelector(d.Spec.Selector)
		require.NoError(t, err)
		out = append(out, workload{"DaemonSet", d.Name, sel, containerImages(d.Spec.Template.Spec)})
	}
	return out
}

func containerImages(spec corev1.PodSpec) []string {
	var out []string
	for _, c := range slices.Concat(spec.InitContainers, spec.Containers) {
		out = append(out, c.Image)
	}
	return out
}

// workloadImages maps each container of each workload to its image.
func workloadImages(t *testing.T, env *realnode.Env) map[string]string {
	out := map[string]string{}
	for _, w := range workloads(t, env) {
		for i, img := range w.images {
			out[fmt.Sprintf("%s[%d]", w, i)] = img
		}
	}
	return out
}

// imageOrConfigErrors are waiting reasons that mean the install itself is
// broken on a real node (image, volume or container config), not that a
// started container cannot reach something.
var imageOrConfigErrors = []string{
	"ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName",
	"CreateContainerConfigError", "CreateContainerError", "RunContainerError",
}

// started reports whether every container of p has run (running now, or
// exited at least once): the image was there, its volumes mounted, its
// security context accepted by runc.
func started(p *corev1.Pod) bool {
	if len(p.Status.ContainerStatuses) < len(p.Spec.Containers) {
		return false
	}
	for _, s := range p.Status.ContainerStatuses {
		if s.State.Running == nil && s.State.Terminated == nil && s.LastTerminationState.Terminated == nil {
			return false
		}
	}
	return true
}

func podsOf(t require.TestingT, env *realnode.Env, w workload) []corev1.Pod {
	pods, err := env.Cluster.Client.CoreV1().Pods(systemNS).List(contextOf(t), metav1.ListOptions{LabelSelector: w.selector.String()})
	require.NoError(t, err)
	return pods.Items
}

// checkPods waits for every workload's pods to be created, scheduled on the
// node and started (each container's image ran), failing on an image,
// volume or container-config error; then reports each pod's state, the
// tail of its containers' logs (read on the node) and its events.
func checkPods(t *testing.T, env *realnode.Env) {
	ws := workloads(t, env)
	names := make([]string, 0, len(ws))
	for _, w := range ws {
		names = append(names, w.String())
	}
	require.ElementsMatch(t, []string{"Deployment/isthmusd", "Deployment/isthmus-eastwestgateway", "DaemonSet/isthmus-cni", "DaemonSet/ztunnel"}, names)
	for _, w := range ws {
		t.Run(strings.ReplaceAll(w.String(), "/", "_"), func(t *testing.T) {
			t0 := time.Now()
			var broken string // an error no wait cures
			ok := assert.EventuallyWithT(t, func(c *assert.CollectT) {
				pods := podsOf(c, env, w)
				require.NotEmpty(c, pods, "no pod yet")
				for i := range pods {
					p := &pods[i]
					require.Equal(c, env.Node.Name, p.Spec.NodeName, "pod %s not scheduled", p.Name)
					for _, s := range p.Status.ContainerStatuses {
						if s.State.Waiting != nil && slices.Contains(imageOrConfigErrors, s.State.Waiting.Reason) {
							broken = fmt.Sprintf("pod %s container %s: %s: %s", p.Name, s.Name, s.State.Waiting.Reason, s.State.Waiting.Message)
							return
						}
					}
					require.True(c, started(p), "pod %s: not every container started: %s", p.Name, podState(p))
				}
			}, 3*time.Minute, 500*time.Millisecond)
			switch {
			case broken != "":
				t.Error(broken)
			case ok:
				t.Logf("%s: every container started %v after the install", w, time.Since(t0).Round(time.Millisecond))
				// Ready: pilot serves, the agent installed its plugin and
				// has a ztunnel, ztunnel and the gateways have their
				// certificates and pilot's state.
				if assert.EventuallyWithT(t, func(c *assert.CollectT) {
					for _, p := range podsOf(c, env, w) {
						require.True(c, podReady(&p), "pod %s not Ready: %s", p.Name, podState(&p))
					}
				}, 3*time.Minute, 500*time.Millisecond) {
					t.Logf("%s: Ready %v after the install", w, time.Since(t0).Round(time.Millisecond))
				}
			}
			for _, p := range podsOf(t, env, w) {
				report(t, env, &p)
			}
		})
	}
}

// report logs a pod's state, its containers' last log lines and its events.
func report(t *testing.T, env *realnode.Env, p *corev1.Pod) {
	t.Logf("pod %s: phase %s; %s", p.Name, p.Status.Phase, podState(p))
	for _, s := range p.Status.ContainerStatuses {
		if log, err := env.Node.ContainerLog(p.Namespace, p.Name, s.Name); err == nil {
			lines := strings.Split(strings.TrimSpace(log), "\n")
			t.Logf("pod %s container %s log (last lines):\n%s", p.Name, s.Name, strings.Join(lines[max(0, len(lines)-8):], "\n"))
		}
	}
	evs, err := env.Cluster.Client.CoreV1().Events(p.Namespace).List(t.Context(), metav1.ListOptions{
		FieldSelector: "involvedObject.name=" + p.Name,
	})
	require.NoError(t, err)
	for _, e := range evs.Items {
		t.Logf("pod %s event %s %s (x%d): %s", p.Name, e.Type, e.Reason, e.Count, e.Message)
	}
}

// podState summarizes a pod's conditions and containers.
func podState(p *corev1.Pod) string {
	var b strings.Builder
	for _, c := range p.Status.Conditions {
		fmt.Fprintf(&b, "%s=%s %s; ", c.Type, c.Status, c.Message)
	}
	for _, s := range p.Status.ContainerStatuses {
		fmt.Fprintf(&b, "%s ready=%v restarts=%d", s.Name, s.Ready, s.RestartCount)
		switch {
		case s.State.Waiting != nil:
			fmt.Fprintf(&b, " waiting %s %s", s.State.Waiting.Reason, s.State.Waiting.Message)
		case s.State.Terminated != nil:
			fmt.Fprintf(&b, " terminated exit %d %s %s", s.State.Terminated.ExitCode, s.State.Terminated.Reason, s.State.Terminated.Message)
		case s.State.Running != nil:
			b.WriteString(" running")
		}
		if lt := s.LastTerminationState.Terminated; lt != nil {
			fmt.Fprintf(&b, " (last exit %d %s)", lt.ExitCode, lt.Reason)
		}
		b.WriteString("; ")
	}
	return b.String()
}

// uninstallCNI follows the NOTES' uninstall path: helm upgrade --set
// uninstallOnExit=true (the agent rolls with the flag), then helm uninstall
// (release record and pods gone). The node keeps its own network: the
// conflist holds only the bridge and the bin folder only the reference
// plugins. Whether the agent had installed its plugin first is logged: it
// cannot while pods have no API access (then the removal of an installed
// plugin is not exercised).
func uninstallCNI(t *testing.T, env *realnode.Env) {
	rc := env.Cluster.Config
	plugins, bins := conflistPlugins(t, env), binFiles(t, env)
	had := slices.Contains(plugins, "isthmus-cni") && slices.Contains(bins, "isthmus-cni")
	t.Logf("before uninstall: conflist plugins %v, bin folder %v (agent's plugin installed: %v)", plugins, bins, had)
	if !had {
		t.Logf("NOT EXERCISED: the CNI agent never installed its plugin (it exits without API access), so the removal of an installed plugin is not checked here")
	}

	up, err := install.Upgrade(t.Context(), rc, systemNS, "isthmus-cni", moduleDir+"/manifests/cni",
		map[string]any{"uninstallOnExit": true}, true, nil)
	require.NoError(t, err)
	require.Equal(t, 2, up.Version)
	require.NotContains(t, up.Info.Notes, "Before uninstalling, set uninstallOnExit=true", "NOTES still ask for what was set")
	// The DaemonSet rolls (maxSurge 0): the new agent starts with the flag.
	cni := workload{selector: labels.SelectorFromSet(labels.Set{"app": "isthmus-cni"})}
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		pods := podsOf(c, env, cni)
		require.Len(c, pods, 1)
		require.Contains(c, pods[0].Spec.Containers[0].Args, "--uninstall-on-exit")
		require.Nil(c, pods[0].DeletionTimestamp)
		require.True(c, started(&pods[0]), "agent with --uninstall-on-exit not started: %s", podState(&pods[0]))
	}, 3*time.Minute, time.Second)

	_, err = install.Uninstall(rc, systemNS, "isthmus-cni", true, nil)
	require.NoError(t, err)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.Empty(c, podsOf(c, env, cni), "agent pods outlived helm uninstall")
		require.Equal(c, []string{"bridge"}, conflistPlugins(c, env))
		require.Equal(c, []string{"bridge", "host-local", "loopback"}, binFiles(c, env))
	}, 2*time.Minute, time.Second, "the plugin or the agent outlived helm uninstall")
	rels, err := install.List(rc, systemNS, nil)
	require.NoError(t, err)
	for _, r := range rels {
		require.NotEqual(t, "isthmus-cni", r.Name, "the release record outlived helm uninstall")
	}
}

// contextOf is the test's context for a TestingT that may be an
// assert.CollectT (which has none).
func contextOf(t require.TestingT) context.Context {
	if tt, ok := t.(interface{ Context() context.Context }); ok {
		return tt.Context()
	}
	return context.Background()
}

// podReady reports whether p's Ready condition is true.
func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}
