package realnode_test

import (
	"bytes"
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/remotecommand"

	"github.com/isthmus-mesh/isthmus/test/framework/realnode"
)

// serverBin is the test server's binary in its image.
const serverBin = "/usr/local/bin/server"

// services puts the Deployment's server pod behind a Service and checks,
// with a second pod and exec: the Service's ClusterIP (kube-proxy) from
// the node, the Service's cluster DNS name (CoreDNS) from a pod, the
// server reaching itself through its Service (hairpin), a pod's service
// account authenticating to the API server through the kubernetes
// Service, the API server's proxy to the Service, and the server's logs.
func services(t *testing.T, env *realnode.Env, ns string) {
	client := env.Cluster.Client
	ctx := t.Context()
	svc, err := client.CoreV1().Services(ns).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "server", Namespace: ns},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": "server"},
			Ports:    []corev1.ServicePort{{Name: "http", Port: 8080, TargetPort: intstr.FromInt32(8080)}},
		},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = client.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "client", Namespace: ns, Labels: map[string]string{"app": "client"}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{
			Name: "client", Image: env.ImageRef(serverImage), Args: []string{"-listen", ":8081"},
		}}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	server := waitPodRunning(t, client, ns, "app=server")
	waitPodRunning(t, client, ns, "app=client")
	want := "isthmus realnode server " + server.Name + "\n"

	t.Run("ClusterIPFromTheNode", func(t *testing.T) {
		// Until kube-proxy has synced the Service, the dial times out.
		require.Equal(t, want, get(t, env.Node, net.JoinHostPort(svc.Spec.ClusterIP, "8080")))
	})
	t.Run("ClusterDNSNameFromAPod", func(t *testing.T) {
		url := "http://server." + ns + ".svc." + realnode.ClusterDomain + ":8080/"
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			out, err := execIn(ctx, env, ns, "client", serverBin, "-get", url)
			require.NoError(c, err)
			require.Equal(c, want, out)
		}, time.Minute, 500*time.Millisecond)
	})
	t.Run("HairpinThroughItsOwnService", func(t *testing.T) {
		// The short name resolves through the pod's search path.
		out, err := execIn(ctx, env, ns, server.Name, serverBin, "-get", "http://server:8080/")
		require.NoError(t, err)
		require.Equal(t, want, out)
	})
	t.Run("ServiceAccountReadsTheAPI", func(t *testing.T) {
		out, err := execIn(ctx, env, ns, "client", serverBin, "-whoami")
		require.NoError(t, err)
		require.Equal(t, "system:serviceaccount:"+ns+":default\n", out)
	})
	t.Run("APIServerProxiesToTheService", func(t *testing.T) {
		// The API server reaches pods as it would a webhook: through its
		// cluster egress, from inside the node.
		body, err := client.CoreV1().Services(ns).ProxyGet("http", "server", "8080", "/", nil).DoRaw(ctx)
		require.NoError(t, err)
		require.Equal(t, want, string(body))
	})
	t.Run("Logs", func(t *testing.T) {
		logs, err := client.CoreV1().Pods(ns).GetLogs(server.Name, &corev1.PodLogOptions{}).DoRaw(ctx)
		require.NoError(t, err)
		require.Contains(t, string(logs), "serving on :8080")
	})
}

// execIn runs cmd in the pod's only container through the API server
// (which reaches the kubelet through the node's egress) and returns its
// stdout; a failure includes its stderr.
func execIn(ctx context.Context, env *realnode.Env, ns, pod string, cmd ...string) (string, error) {
	req := env.Cluster.Client.CoreV1().RESTClient().Post().Resource("pods").Namespace(ns).Name(pod).SubResource("exec").
		VersionedParams(&corev1.PodExecOptions{Command: cmd, Stdout: true, Stderr: true}, scheme.ParameterCodec)
	ex, err := remotecommand.NewSPDYExecutor(env.Cluster.Config, "POST", req.URL())
	if err != nil {
		return "", err
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var stdout, stderr bytes.Buffer
	if err := ex.StreamWithContext(ctx, remotecommand.StreamOptions{Stdout: &stdout, Stderr: &stderr}); err != nil {
		return stdout.String(), &execError{err: err, stderr: strings.TrimSpace(stderr.String())}
	}
	return stdout.String(), nil
}

type execError struct {
	err    error
	stderr string
}

func (e *execError) Error() string { return e.err.Error() + ": " + e.stderr }
func (e *execError) Unwrap() error { return e.err }
