package realmesh_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/isthmus-mesh/isthmus/test/framework/meshup"
	"github.com/isthmus-mesh/isthmus/test/realnode/traffic"
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
	if s.ctlDir != "" {
		assert.NoError(t, os.RemoveAll(s.ctlDir))
	}
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

// probe is the client's steady traffic to the server while an operation
// runs (test/realnode/traffic, run in the client pod by the server image's
// -traffic mode): long-lived connections, each sending a request every
// second, and a new connection every 100 ms, each a request through both
// ztunnels and cluster-2's gateway.
type probe struct {
	stdin  *io.PipeWriter
	stdout *bufio.Reader
	done   chan error
	t0     time.Time
}

// startProbe starts the traffic and returns once its long-lived
// connections are established.
func (s *scenario) startProbe(t *testing.T) *probe {
	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	p := &probe{stdin: inW, stdout: bufio.NewReader(outR), done: make(chan error, 1), t0: time.Now()}
	go func() {
		err := s.mesh.ExecStream(t.Context(), s.c1, appNS, "client", inR, outW, serverBin, "-traffic", url,
			"-long", strconv.Itoa(*longConns), "-new-every", newEvery.String())
		outW.CloseWithError(err)
		p.done <- err
	}()
	line, err := p.stdout.ReadString('\n')
	if err != nil {
		_ = inW.Close()
		require.NoError(t, <-p.done, "the client's traffic did not start")
		require.NoError(t, err, "the client's traffic did not start")
	}
	require.Equal(t, fmt.Sprintf("ready %d\n", *longConns), line)
	return p
}

// end stops the traffic, logs what it met and records it as the table row
// of step; it returns the result.
func (s *scenario) endProbe(t *testing.T, p *probe, step string) traffic.Result {
	took := time.Since(p.t0)
	require.NoError(t, p.stdin.Close())
	body, err := io.ReadAll(p.stdout)
	require.NoError(t, err, "the client's traffic")
	require.NoError(t, <-p.done)
	var r traffic.Result
	require.NoError(t, json.Unmarshal(body, &r), "the client's traffic printed %q", body)
	lost, failed := "none lost", "none failed"
	if r.Lost > 0 {
		lost = fmt.Sprintf("%d lost (the first after %v: %s)", r.Lost, r.FirstLost, r.LostError)
	}
	if r.NewFailed > 0 {
		failed = fmt.Sprintf("%d failed (the first: %s; longest outage %v, recovered %v)", r.NewFailed, r.NewError, r.Outage, r.Recovered)
	}
	t.Logf("traffic during %s (%v): %d long-lived connections, %s; %d new connections, %s",
		step, took.Round(100*time.Millisecond), r.Long, lost, r.New, failed)
	s.rows = append(s.rows, row{step: step, took: took, res: r})
	return r
}

// row is one operation's line of the disruption table.
type row struct {
	step string
	took time.Duration
	res  traffic.Result
}

// table renders the rows as BENCHMARKS.md's disruption table.
func (s *scenario) table() string {
	var b strings.Builder
	fmt.Fprintf(&b, "| operation | took | long-lived connections lost (first after) | new connections failed | longest outage |\n| --- | --- | --- | --- | --- |\n")
	for _, r := range s.rows {
		first := "-"
		if r.res.Lost > 0 {
			first = r.res.FirstLost.String()
		}
		fmt.Fprintf(&b, "| %s | %v | %d of %d (%s) | %d of %d | %v |\n", r.step, r.took.Round(100*time.Millisecond),
			r.res.Lost, r.res.Long, first, r.res.NewFailed, r.res.New, r.res.Outage)
	}
	return b.String()
}

// waitGone waits until the pod is deleted.
func waitGone(t *testing.T, c meshup.Cluster, ns, name string) {
	t.Helper()
	require.EventuallyWithT(t, func(col *assert.CollectT) {
		_, err := c.Client.CoreV1().Pods(ns).Get(t.Context(), name, metav1.GetOptions{})
		require.True(col, apierrors.IsNotFound(err), "pod %s/%s still there (%v)", ns, name, err)
	}, 3*time.Minute, 500*time.Millisecond)
}
