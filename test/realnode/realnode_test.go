// Package realnode_test runs pods on a real node (kubelet, containerd, runc,
// the reference CNI plugins) from test/framework/realnode, and reaches them
// over the node's real network.
package realnode_test

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/isthmus-mesh/isthmus/internal/imagebuild"
	"github.com/isthmus-mesh/isthmus/test/framework/realnode"
)

func TestMain(m *testing.M) {
	code := m.Run()
	if code == 0 {
		if err := goleak.Find(goleak.IgnoreTopFunction("k8s.io/klog/v2.(*flushDaemon).run.func1")); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

const serverImage = "server"

// TestRealNode brings up one cluster with one real node, then runs the test
// server as a Deployment's pod on the CNI bridge and as a hostNetwork pod,
// and talks to each over the node's network; pods reach the server's
// Service by its cluster DNS name, the server reaches itself through it,
// a pod's service account authenticates to the API server, and the API
// server serves the pods' logs and exec. After the teardown, nothing of the
// node is left on the host, and the host's links, routes, nftables tables
// and conntrack sysctls are as before.
func TestRealNode(t *testing.T) {
	before := snapshotHost(t)
	var dir string
	t.Run("Cluster", func(t *testing.T) {
		dir = cluster(t)
	})
	requireHostClean(t, dir, before)
}

// hostState is what of the host a test's environment must leave as it
// found it.
type hostState struct {
	links, routes, tables []string
	paths                 map[string]bool
	sysctls               map[string]string
}

func snapshotHost(t *testing.T) hostState {
	links, routes := hostNetwork(t)
	return hostState{links: links, routes: routes, tables: hostNFTables(t), paths: hostPaths(), sysctls: hostSysctls()}
}

// requireHostClean checks that nothing of the environment whose folder was
// dir is left on the host after its teardown, and that the host's links,
// routes and runtime folders are as before.
func requireHostClean(t *testing.T, dir string, before hostState) {
	t.Helper()
	require.NotEmpty(t, dir)
	_, err := os.Stat(dir)
	require.ErrorIs(t, err, os.ErrNotExist, "the environment's folder outlived the teardown")
	cgroups, err := filepath.Glob("/sys/fs/cgroup/*/" + filepath.Base(dir))
	require.NoError(t, err)
	require.Empty(t, cgroups, "cgroups outlived the teardown")
	require.Empty(t, processesNaming(t, dir), "processes outlived the teardown")
	mounts, err := os.ReadFile("/proc/thread-self/mountinfo")
	require.NoError(t, err)
	require.NotContains(t, string(mounts), dir, "a node mount reached the host's mount namespace")
	after := snapshotHost(t)
	require.Equal(t, before.paths, after.paths, "the node wrote to the host's runtime folders")
	require.Equal(t, before.links, after.links, "the host's links changed")
	require.Equal(t, before.routes, after.routes, "the host's routes changed")
	require.Equal(t, before.tables, after.tables, "the host's nftables tables changed")
	require.Equal(t, before.sysctls, after.sysctls, "the host's conntrack sysctls changed")
}

// cluster runs the scenario on a fresh environment and returns its folder.
func cluster(t *testing.T) string {
	env := realnode.Start(t, realnode.Options{
		Images: []imagebuild.Image{{Name: serverImage, Package: "./test/realnode/server", Description: "real-node test server"}},
	})
	t.Logf("node %s Ready %v after its kubelet started, cluster DNS Ready %v after that", env.Node.Name,
		env.NodeReady.Round(time.Millisecond), env.DNSReady.Round(time.Millisecond))
	client := env.Cluster.Client
	ns := "realnode"
	ctx := t.Context()
	_, err := client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
	require.NoError(t, err)
	// Pods are admitted with their service account, which the controller
	// manager creates.
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		_, err := client.CoreV1().ServiceAccounts(ns).Get(ctx, "default", metav1.GetOptions{})
		require.NoError(c, err)
	}, time.Minute, 200*time.Millisecond)

	t.Run("DeploymentPodOnTheBridge", func(t *testing.T) {
		labels := map[string]string{"app": "server"}
		dep := &appsv1.Deployment{
			ObjectMeta: metav1.ObjectMeta{Name: "server", Namespace: ns},
			Spec: appsv1.DeploymentSpec{
				Replicas: ptr.To[int32](1),
				Selector: &metav1.LabelSelector{MatchLabels: labels},
				Template: corev1.PodTemplateSpec{
					ObjectMeta: metav1.ObjectMeta{Labels: labels},
					Spec: corev1.PodSpec{Containers: []corev1.Container{{
						Name: "server", Image: env.ImageRef(serverImage),
						Ports: []corev1.ContainerPort{{ContainerPort: 8080}},
						// The kubelet probes the pod over the bridge too.
						ReadinessProbe: &corev1.Probe{
							ProbeHandler:  corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/", Port: intstr.FromInt32(8080)}},
							PeriodSeconds: 1,
						},
					}}},
				},
			},
		}
		t0 := time.Now()
		_, err := client.AppsV1().Deployments(ns).Create(ctx, dep, metav1.CreateOptions{})
		require.NoError(t, err)
		pod := waitPodRunning(t, client, ns, "app=server")
		t.Logf("Deployment's pod %s Running with IP %s %v after the Deployment was created", pod.Name, pod.Status.PodIP, time.Since(t0).Round(time.Millisecond))
		ip, err := netip.ParseAddr(pod.Status.PodIP)
		require.NoError(t, err)
		require.True(t, env.Node.PodCIDR.Contains(ip), "pod IP %s outside the bridge's range %s", ip, env.Node.PodCIDR)
		// The pod's hostname is its name: the reply comes from this pod.
		require.Equal(t, "isthmus realnode server "+pod.Name+"\n", get(t, env.Node, net.JoinHostPort(ip.String(), "8080")))
		// Available means the kubelet's readiness probe reached it too.
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			d, err := client.AppsV1().Deployments(ns).Get(ctx, "server", metav1.GetOptions{})
			require.NoError(c, err)
			require.Equal(c, int32(1), d.Status.AvailableReplicas)
		}, 2*time.Minute, 200*time.Millisecond)
	})

	t.Run("HostNetworkPod", func(t *testing.T) {
		pod := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "hostnet", Namespace: ns, Labels: map[string]string{"app": "hostnet"}},
			Spec: corev1.PodSpec{
				HostNetwork: true,
				Containers: []corev1.Container{{
					Name: "server", Image: env.ImageRef(serverImage), Args: []string{"-listen", ":18080"},
				}},
			},
		}
		t0 := time.Now()
		_, err := client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{})
		require.NoError(t, err)
		got := waitPodRunning(t, client, ns, "app=hostnet")
		t.Logf("hostNetwork pod Running with IP %s %v after it was created", got.Status.PodIP, time.Since(t0).Round(time.Millisecond))
		// A hostNetwork pod has the node's network namespace (the node's
		// IP), not the host's: only a dial from inside the node reaches it.
		require.Equal(t, env.Node.IP.String(), got.Status.PodIP)
		host, err := os.Hostname()
		require.NoError(t, err)
		require.Equal(t, "isthmus realnode server "+host+"\n", get(t, env.Node, net.JoinHostPort(env.Node.IP.String(), "18080")))
	})

	t.Run("Services", func(t *testing.T) { services(t, env, ns) })

	t.Logf("cluster RSS (etcd, apiserver, controllers, containerd, kubelet, kube-proxy, shims, containers): %d MiB", env.RSSBytes()>>20)
	return env.Dir()
}

// hostPaths reports which of the host folders a kubelet, containerd or
// the CNI plugins write by default exist.
func hostPaths() map[string]bool {
	out := map[string]bool{}
	for _, p := range []string{
		"/run/containerd", "/var/run/nri", "/var/lib/containerd", "/opt/containerd", "/var/lib/kubelet",
		"/var/log/pods", "/var/log/containers", "/var/lib/cni", "/etc/cni", "/opt/cni", "/run/netns",
	} {
		_, err := os.Lstat(p)
		out[p] = err == nil
	}
	return out
}

// hostNetwork lists the host's links and routes (of every table), as text.
func hostNetwork(t *testing.T) (links, routes []string) {
	t.Helper()
	ls, err := netlink.LinkList()
	require.NoError(t, err)
	for _, l := range ls {
		links = append(links, fmt.Sprintf("%d %s %s", l.Attrs().Index, l.Attrs().Name, l.Type()))
	}
	rs, err := netlink.RouteListFiltered(netlink.FAMILY_ALL, &netlink.Route{Table: unix.RT_TABLE_UNSPEC}, netlink.RT_FILTER_TABLE)
	require.NoError(t, err)
	for _, r := range rs {
		routes = append(routes, r.String())
	}
	slices.Sort(routes)
	return links, routes
}

// processesNaming lists the processes whose command line contains s.
func processesNaming(t *testing.T, s string) []string {
	t.Helper()
	procs, err := os.ReadDir("/proc")
	require.NoError(t, err)
	var out []string
	for _, p := range procs {
		if cmd, err := os.ReadFile(filepath.Join("/proc", p.Name(), "cmdline")); err == nil && strings.Contains(string(cmd), s) {
			out = append(out, p.Name()+": "+strings.ReplaceAll(string(cmd), "\x00", " "))
		}
	}
	return out
}

// waitPodRunning waits for the one pod matching selector to be Running
// with an IP, and returns it.
func waitPodRunning(t *testing.T, client kubernetes.Interface, ns, selector string) *corev1.Pod {
	t.Helper()
	var pod *corev1.Pod
	ok := assert.EventuallyWithT(t, func(c *assert.CollectT) {
		pods, err := client.CoreV1().Pods(ns).List(t.Context(), metav1.ListOptions{LabelSelector: selector})
		require.NoError(c, err)
		require.Len(c, pods.Items, 1)
		p := &pods.Items[0]
		require.Equal(c, corev1.PodRunning, p.Status.Phase, "pod %s: %s", p.Name, podState(p))
		require.NotEmpty(c, p.Status.PodIP)
		pod = p
	}, 3*time.Minute, 200*time.Millisecond)
	if !ok {
		// The kubelet's events say why (a sandbox that runc could not
		// start, an image not found, ...).
		events, err := client.CoreV1().Events(ns).List(t.Context(), metav1.ListOptions{})
		require.NoError(t, err)
		for _, e := range events.Items {
			t.Logf("event %s %s: %s %s", e.InvolvedObject.Kind, e.InvolvedObject.Name, e.Reason, e.Message)
		}
		t.FailNow()
	}
	return pod
}

// podState summarizes why a pod is not running yet.
func podState(p *corev1.Pod) string {
	var b strings.Builder
	for _, c := range p.Status.Conditions {
		fmt.Fprintf(&b, "%s=%s %s; ", c.Type, c.Status, c.Message)
	}
	for _, s := range p.Status.ContainerStatuses {
		if s.State.Waiting != nil {
			fmt.Fprintf(&b, "%s waiting: %s %s; ", s.Name, s.State.Waiting.Reason, s.State.Waiting.Message)
		}
	}
	return b.String()
}

// get sends GET / to address from inside the node and returns the body
// (an answer other than 200 fails the test).
func get(t *testing.T, node *realnode.Node, address string) string {
	t.Helper()
	code, body := fetch(t, node, "http://"+address+"/")
	require.Equal(t, http.StatusOK, code, body)
	return body
}

// fetch sends GET url from inside the node and returns the status and
// body. A refused connection is retried for 30 s: a container is Running
// before its server listens.
func fetch(t *testing.T, node *realnode.Node, url string) (int, string) {
	t.Helper()
	tr := &http.Transport{DialContext: node.DialContext, DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	deadline := time.Now().Add(30 * time.Second)
	var resp *http.Response
	for {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, url, nil)
		require.NoError(t, err)
		resp, err = c.Do(req)
		if errors.Is(err, unix.ECONNREFUSED) && time.Now().Before(deadline) {
			time.Sleep(100 * time.Millisecond)
			continue
		}
		require.NoError(t, err)
		break
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(body)
}

// hostNFTables lists the host's nftables tables (family and name).
func hostNFTables(t *testing.T) []string {
	t.Helper()
	c, err := nftables.New()
	require.NoError(t, err)
	ts, err := c.ListTables()
	require.NoError(t, err)
	var out []string
	for _, tb := range ts {
		out = append(out, fmt.Sprintf("%d %s", tb.Family, tb.Name))
	}
	slices.Sort(out)
	return out
}

// hostSysctls reads the host's conntrack settings that kube-proxy would
// write unless told not to (global, not per network namespace).
func hostSysctls() map[string]string {
	out := map[string]string{}
	for _, p := range []string{
		"/proc/sys/net/netfilter/nf_conntrack_max", "/sys/module/nf_conntrack/parameters/hashsize",
		"/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_established", "/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_close_wait",
	} {
		b, err := os.ReadFile(p)
		if err != nil {
			out[p] = "unreadable: " + err.Error()
			continue
		}
		out[p] = strings.TrimSpace(string(b))
	}
	return out
}
