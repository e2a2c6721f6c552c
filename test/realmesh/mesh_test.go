// Package realmesh_test runs the mesh on real nodes: two clusters on two
// networks (test/framework/realnode), Isthmus installed in both with the
// README's helm lines through the Helm SDK (test/framework/install), from
// the images `make images` builds; then a client pod in cluster-1 reaches a
// service that runs only in cluster-2, through its pod's DNS, ztunnel and
// the east-west gateway, as AuthorizationPolicy allows and denies.
package realmesh_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	securityv1 "istio.io/client-go/pkg/apis/security/v1"
	"istio.io/client-go/pkg/clientset/versioned"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/remotecommand"
	"sigs.k8s.io/yaml"

	"github.com/isthmus-mesh/isthmus/internal/imagebuild"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/test/framework/install"
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

const (
	readmePath = "../../README.md"
	moduleDir  = "../.."
	systemNS   = "isthmus-system"
	appNS      = "mesh-demo"
	serverImg  = "server"
	serverBin  = "/usr/local/bin/server"
	hbonePort  = 15008
)

// TestCrossNetworkOnRealNodes: cluster-1 (network1, pilot) and cluster-2
// (network2), each one real node; the README's install in both; cluster-2
// registered with pilot by a remote Secret whose server is cluster-2's API
// server as network1 reaches it. A client in cluster-1 resolves
// server.mesh-demo.svc.cluster.local (a Service only cluster-2 has) through
// its pod's DNS and gets the server's reply over a plain socket: captured
// by the CNI agent's rules, carried by ztunnel over HBONE to cluster-2's
// east-west gateway, the only thing of network2 the wan lets through. Then
// an AuthorizationPolicy allows only the client's identity: another pod of
// cluster-1 is refused by cluster-2's ztunnel, the client is not.
func TestCrossNetworkOnRealNodes(t *testing.T) {
	ctx := t.Context()
	log := slog.New(slog.NewTextHandler(tWriter{t}, nil))
	version, err := os.ReadFile(filepath.Join(moduleDir, "VERSION"))
	require.NoError(t, err)
	platform := "linux/" + runtime.GOARCH
	registry := "registry.example.com:5000" // the README's image.registry

	var built *imagebuild.Result
	var buildErr error
	done := make(chan struct{})
	go func() {
		defer close(done)
		built, buildErr = imagebuild.Build(context.Background(), imagebuild.Config{
			ModuleDir: moduleDir, Platforms: []string{platform}, Version: strings.TrimSpace(string(version)),
			Commit: "test", Registry: registry, OutDir: t.TempDir(),
		}, imagebuild.Deps{Log: log})
	}()
	t.Cleanup(func() { <-done })
	set := realnode.StartSet(t, realnode.SetOptions{
		Clusters: []realnode.ClusterSpec{{Name: "cluster-1", Network: "network1"}, {Name: "cluster-2", Network: "network2"}},
		Images:   []imagebuild.Image{{Name: serverImg, Package: "./test/realnode/server", Description: "mesh test server"}},
		Log:      log,
	})
	<-done
	require.NoError(t, buildErr)
	c1, c2 := set.Cluster("cluster-1"), set.Cluster("cluster-2")
	for _, e := range set.Clusters {
		require.NoError(t, e.Node.ImportImages(built.Tarballs[platform]))
	}

	// cluster-1: pilot's Service is a NodePort that network2 reaches
	// through the wan, named in its certificate.
	cniExtra := func(e *realnode.Env) []string {
		return []string{"netnsDir=" + e.Node.NetnsDir(), "podCgroupRoots={" + e.Node.PodCgroupRoot() + "}"}
	}
	_, err = install.Run(ctx, install.Config{
		README: readmePath, ChartRoot: moduleDir, Log: log,
		Clusters: map[string]*rest.Config{"c1": c1.Cluster.Config},
		Extra: map[string][]string{
			"c1/isthmus-cni":   cniExtra(c1),
			"c1/isthmus-pilot": {"service.type=NodePort", "servingSANs={" + c1.Node.IP.String() + "}"},
		},
	})
	require.NoError(t, err)
	svc, err := c1.Cluster.Client.CoreV1().Services(systemNS).Get(ctx, "isthmusd", metav1.GetOptions{})
	require.NoError(t, err)
	var xdsNodePort int32
	for _, p := range svc.Spec.Ports {
		if p.Name == "tls-xds" {
			xdsNodePort = p.NodePort
		}
	}
	require.NotZero(t, xdsNodePort, "pilot's xDS NodePort")
	xds := netip.AddrPortFrom(c1.Node.IP, uint16(xdsNodePort))
	require.NoError(t, set.ExposeGateway(xds))

	// cluster-2: its ztunnel and gateway dial pilot there; the gateway's
	// Service takes the node's IP (no load balancer here), which the wan
	// lets through on the HBONE port.
	_, err = install.Run(ctx, install.Config{
		README: readmePath, ChartRoot: moduleDir, Log: log,
		Clusters: map[string]*rest.Config{"c2": c2.Cluster.Config},
		Rewrite:  map[string]string{"xdsAddress": xds.String()},
		Extra: map[string][]string{
			"c2/isthmus-cni":      cniExtra(c2),
			"c2/isthmus-eastwest": {"service.externalIPs={" + c2.Node.IP.String() + "}"},
		},
	})
	require.NoError(t, err)
	require.NoError(t, set.ExposeGateway(netip.AddrPortFrom(c2.Node.IP, hbonePort)))

	// Register cluster-2 with pilot, as create-remote-secret does (with
	// the reader identity the remote chart made), and wait for pilot to
	// publish its CA root there: until then cluster-2's ztunnel and
	// gateways exit at start and the kubelet restarts them, as their NOTES
	// say.
	kc, err := c2.RemoteKubeconfig(ctx, "cluster-2", remotesecret.ReaderOptions{})
	require.NoError(t, err)
	sec := remotesecret.Secret("cluster-2", systemNS, kc)
	sec.Annotations[remotesecret.NetworkAnnotation] = "network2"
	_, err = c1.Cluster.Client.CoreV1().Secrets(systemNS).Create(ctx, sec, metav1.CreateOptions{})
	require.NoError(t, err)
	if !assert.EventuallyWithT(t, func(c *assert.CollectT) {
		_, err := c2.Cluster.Client.CoreV1().ConfigMaps(systemNS).Get(ctx, "isthmus-ca-root-cert", metav1.GetOptions{})
		require.NoError(c, err)
	}, 2*time.Minute, 500*time.Millisecond, "pilot publishes its root into cluster-2") {
		logPods(t, c1, systemNS)
		t.FailNow()
	}

	for _, e := range set.Clusters {
		waitSystemReady(t, e)
	}

	// The application: the server only in cluster-2, the client in
	// cluster-1, both namespaces enrolled.
	for _, e := range set.Clusters {
		require.NoError(t, e.Cluster.EnsureNamespace(ctx, appNS, map[string]string{"istio.io/dataplane-mode": "ambient"}))
	}
	_, err = c2.Cluster.CreateService(ctx, appNS, "server", map[string]string{"app": "server"}, framework.ServicePort{Name: "http", Port: 8080, TargetPort: 8080})
	require.NoError(t, err)
	runPod(t, c2, "server-0", map[string]string{"app": "server"}, c2.ImageRef(serverImg), "")
	for _, sa := range []string{"client", "other"} {
		_, err := c1.Cluster.Client.CoreV1().ServiceAccounts(appNS).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	runPod(t, c1, "client", map[string]string{"app": "client"}, c1.ImageRef(serverImg), "client")
	runPod(t, c1, "intruder", map[string]string{"app": "intruder"}, c1.ImageRef(serverImg), "other")

	url := "http://server." + appNS + ".svc.cluster.local:8080/"
	var out string
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		var err error
		out, err = execIn(ctx, c1, "client", serverBin, "-get", url)
		require.NoError(c, err)
	}, 3*time.Minute, time.Second, "the client in cluster-1 reaches the server in cluster-2")
	require.Equal(t, "isthmus realnode server server-0\n", out)

	// An AuthorizationPolicy of the config cluster lets only the client's
	// identity in: the destination's ztunnel, in cluster-2, refuses the
	// other pod of cluster-1 and still serves the client.
	sc, err := versioned.NewForConfig(c1.Cluster.Config)
	require.NoError(t, err)
	ap := &securityv1.AuthorizationPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: appNS, Name: "only-client"}}
	require.NoError(t, yaml.Unmarshal([]byte(`
selector: {matchLabels: {app: server}}
action: ALLOW
rules:
- from:
  - source: {principals: ["cluster.local/ns/`+appNS+`/sa/client"]}
`), &ap.Spec))
	_, err = sc.SecurityV1().AuthorizationPolicies(appNS).Create(ctx, ap, metav1.CreateOptions{})
	require.NoError(t, err)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		_, err := execIn(ctx, c1, "intruder", serverBin, "-get", url)
		require.Error(c, err, "the other identity is refused")
	}, 2*time.Minute, time.Second, "the policy reaches cluster-2's ztunnel")
	out, err = execIn(ctx, c1, "client", serverBin, "-get", url)
	require.NoError(t, err, "the allowed identity still gets through")
	require.Equal(t, "isthmus realnode server server-0\n", out)
}

// waitSystemReady waits for every pod of the system namespace to be Ready,
// logging the state of those that are not.
func waitSystemReady(t *testing.T, e *realnode.Env) {
	t.Helper()
	ok := assert.EventuallyWithT(t, func(c *assert.CollectT) {
		pods, err := e.Cluster.Client.CoreV1().Pods(systemNS).List(t.Context(), metav1.ListOptions{})
		require.NoError(c, err)
		require.NotEmpty(c, pods.Items)
		for _, p := range pods.Items {
			require.True(c, ready(&p), "%s: pod %s not Ready", e.Cluster.Name, p.Name)
		}
	}, 4*time.Minute, time.Second)
	if !ok {
		logPods(t, e, systemNS)
		t.FailNow()
	}
}

func ready(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// logPods logs each pod of ns that is not Ready with the tail of its
// containers' logs, read on its node.
func logPods(t *testing.T, e *realnode.Env, ns string) {
	pods, err := e.Cluster.Client.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Logf("%s: list pods: %v", e.Cluster.Name, err)
		return
	}
	for _, p := range pods.Items {
		t.Logf("%s: pod %s ready=%v phase=%s", e.Cluster.Name, p.Name, ready(&p), p.Status.Phase)
		for _, c := range p.Spec.Containers {
			l, err := e.Node.ContainerLog(ns, p.Name, c.Name)
			if err != nil {
				continue
			}
			lines := strings.Split(strings.TrimSpace(l), "\n")
			t.Logf("  %s: %s", c.Name, strings.Join(lines[max(0, len(lines)-8):], "\n  "))
		}
	}
}

// runPod runs the test server image as pod name of appNS (as
// serviceAccount; "" is the namespace's default) and waits for it to be
// Ready.
func runPod(t *testing.T, e *realnode.Env, name string, labels map[string]string, image, serviceAccount string) {
	t.Helper()
	_, err := e.Cluster.Client.CoreV1().Pods(appNS).Create(t.Context(), &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: appNS, Labels: labels},
		Spec:       corev1.PodSpec{ServiceAccountName: serviceAccount, Containers: []corev1.Container{{Name: "app", Image: image}}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	ok := assert.EventuallyWithT(t, func(c *assert.CollectT) {
		p, err := e.Cluster.Client.CoreV1().Pods(appNS).Get(t.Context(), name, metav1.GetOptions{})
		require.NoError(c, err)
		require.True(c, ready(p), "pod %s not Ready", name)
	}, 2*time.Minute, 200*time.Millisecond)
	if !ok {
		logPods(t, e, appNS)
		t.FailNow()
	}
}

// execIn runs cmd in the pod's only container through the API server.
func execIn(ctx context.Context, e *realnode.Env, pod string, cmd ...string) (string, error) {
	req := e.Cluster.Client.CoreV1().RESTClient().Post().Resource("pods").Namespace(appNS).Name(pod).SubResource("exec").
		VersionedParams(&corev1.PodExecOptions{Command: cmd, Stdout: true, Stderr: true}, scheme.ParameterCodec)
	ex, err := remotecommand.NewSPDYExecutor(e.Cluster.Config, "POST", req.URL())
	if err != nil {
		return "", err
	}
	var stdout, stderr bytes.Buffer
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := ex.StreamWithContext(ctx, remotecommand.StreamOptions{Stdout: &stdout, Stderr: &stderr}); err != nil {
		return stdout.String(), fmt.Errorf("%w: %s", err, strings.TrimSpace(stderr.String()))
	}
	return stdout.String(), nil
}

// tWriter writes log lines to a test's log.
type tWriter struct{ t testing.TB }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}
