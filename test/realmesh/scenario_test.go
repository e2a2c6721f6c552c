package realmesh_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/isthmus-mesh/isthmus/test/framework/meshup"
)

// deploy creates the application: the enrolled namespace in both
// clusters, the server's Service and pod in cluster-2, the client and the
// intruder (each its own ServiceAccount) in cluster-1.
func (s *scenario) deploy() {
	t, ctx := s.t, s.t.Context()
	for _, c := range s.mesh.Clusters {
		_, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{
			Name: appNS, Labels: map[string]string{"istio.io/dataplane-mode": "ambient"},
		}}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	_, err := s.c2.Client.CoreV1().Services(appNS).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "server", Namespace: appNS},
		Spec: corev1.ServiceSpec{Selector: map[string]string{"app": "server"}, Ports: []corev1.ServicePort{{
			Name: "http", Port: 8080, TargetPort: intstr.FromInt32(8080),
		}}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	s.runServer()
	for _, sa := range []string{"client", "other"} {
		_, err := s.c1.Client.CoreV1().ServiceAccounts(appNS).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	s.runClients()
}

// runServer runs the next server pod, server-<n>.
func (s *scenario) runServer() {
	name := fmt.Sprintf("server-%d", s.servers)
	s.servers++
	require.NoError(s.t, s.mesh.RunPod(s.t.Context(), s.c2, meshup.Pod{
		Namespace: appNS, Name: name, Labels: map[string]string{"app": "server"}, Image: s.mesh.Env.ImageRef(serverImg),
	}))
	s.server = name
}

func (s *scenario) runClients() {
	for _, p := range []struct{ name, sa string }{{"client", "client"}, {"intruder", "other"}} {
		require.NoError(s.t, s.mesh.RunPod(s.t.Context(), s.c1, meshup.Pod{
			Namespace: appNS, Name: p.name, Labels: map[string]string{"app": p.name}, Image: s.mesh.Env.ImageRef(serverImg), ServiceAccount: p.sa,
		}))
	}
}

// get is one request of pod (in cluster-1) to the server's service name.
func (s *scenario) get(ctx context.Context, pod string) (string, error) {
	return s.mesh.Exec(ctx, s.c1, appNS, pod, serverBin, "-get", url)
}

// expectServed waits until pod's request is answered by the server pod
// that runs now.
func (s *scenario) expectServed(t *testing.T, pod string) {
	t.Helper()
	want := "isthmus realnode server " + s.server + "\n"
	if !assert.EventuallyWithT(t, func(c *assert.CollectT) {
		out, err := s.get(t.Context(), pod)
		require.NoError(c, err)
		require.Equal(c, want, out)
	}, 3*time.Minute, time.Second, "%s in cluster-1 reaches %s in cluster-2", pod, s.server) {
		s.report(t)
		t.FailNow()
	}
}

// expectRefused waits until pod's requests are refused.
func (s *scenario) expectRefused(t *testing.T, pod string) {
	t.Helper()
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		_, err := s.get(t.Context(), pod)
		require.Error(c, err, "%s is refused", pod)
	}, 2*time.Minute, time.Second, "the policy reaches cluster-2's ztunnel")
}

// check is the whole scenario after an operation: the client is served,
// the intruder refused.
func (s *scenario) check(t *testing.T) {
	t.Helper()
	s.expectServed(t, "client")
	s.expectRefused(t, "intruder")
}

// cleanup deletes the application's namespaces and uninstalls the mesh.
func (s *scenario) cleanup(t *testing.T) {
	ctx := context.Background()
	for _, c := range s.mesh.Clusters {
		for _, ns := range []string{appNS, plainNS} {
			if err := c.Client.CoreV1().Namespaces().Delete(ctx, ns, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
				t.Errorf("%s: delete namespace %s: %v", c.Name, ns, err)
			}
		}
	}
	assert.NoError(t, s.mesh.Uninstall(ctx))
}

// report logs what is not Ready in both clusters.
func (s *scenario) report(t *testing.T) {
	for _, c := range s.mesh.Clusters {
		for _, ns := range []string{meshup.SystemNamespace, appNS} {
			if r := s.mesh.PodReport(context.Background(), c, ns); r != "" {
				t.Log(r)
			}
		}
	}
}

// probe sends the client's request every half second until stopped, and
// counts the answers and the failures (with the first failure's error).
type probe struct {
	ok, failed atomic.Int64
	firstErr   atomic.Pointer[error]
	stop       context.CancelFunc
	wg         sync.WaitGroup
}

func (s *scenario) startProbe(t *testing.T) *probe {
	ctx, cancel := context.WithCancel(t.Context())
	p := &probe{stop: cancel}
	want := "isthmus realnode server " + s.server + "\n"
	p.wg.Go(func() {
		for ctx.Err() == nil {
			out, err := s.get(ctx, "client")
			switch {
			case ctx.Err() != nil:
				return
			case err == nil && out != want:
				err = fmt.Errorf("answered %q, want %q", out, want)
				fallthrough
			case err != nil:
				p.failed.Add(1)
				p.firstErr.CompareAndSwap(nil, &err)
			default:
				p.ok.Add(1)
			}
			select {
			case <-ctx.Done():
			case <-time.After(500 * time.Millisecond):
			}
		}
	})
	return p
}

// end stops the probe and logs its counts; it returns the failures.
func (p *probe) end(t *testing.T, what string) int64 {
	p.stop()
	p.wg.Wait()
	var first error
	if e := p.firstErr.Load(); e != nil {
		first = *e
	}
	t.Logf("requests during %s: %d answered, %d failed (first failure: %v)", what, p.ok.Load(), p.failed.Load(), first)
	return p.failed.Load()
}

// waitGone waits until the pod is deleted.
func waitGone(t *testing.T, c meshup.Cluster, ns, name string) {
	t.Helper()
	require.EventuallyWithT(t, func(col *assert.CollectT) {
		_, err := c.Client.CoreV1().Pods(ns).Get(t.Context(), name, metav1.GetOptions{})
		require.True(col, apierrors.IsNotFound(err), "pod %s/%s still there (%v)", ns, name, err)
	}, 3*time.Minute, 500*time.Millisecond)
}
