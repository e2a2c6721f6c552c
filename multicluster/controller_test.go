package multicluster_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

var clusters *framework.ClusterSet

func TestMain(m *testing.M) {
	code := framework.Main(m, framework.Options{Names: []string{"config", "remote-1", "remote-2"}}, &clusters)
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// sink stands in for the federated registry: per cluster it serves the
// latest generation that has synced, and a generation's Close removes the
// cluster only if that generation is still the one served (the contract
// discovery components follow, which makes a swap gapless).
type sink struct {
	mu      sync.Mutex
	serving map[model.ClusterID]*podCounter
	built   map[model.ClusterID]int
}

func newSink() *sink {
	return &sink{serving: map[model.ClusterID]*podCounter{}, built: map[model.ClusterID]int{}}
}

func (s *sink) count(id model.ClusterID) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p := s.serving[id]; p != nil {
		return len(p.inf.GetStore().ListKeys())
	}
	return 0
}

func (s *sink) generation(id model.ClusterID) uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p := s.serving[id]; p != nil {
		return p.gen
	}
	return 0
}

func (s *sink) builds(id model.ClusterID) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.built[id]
}

// podCounter is a component that watches pods.
type podCounter struct {
	s         *sink
	id        model.ClusterID
	gen       uint64
	inf       cache.SharedIndexInformer
	activated bool
}

func (s *sink) builder(ctx context.Context, c *multicluster.Cluster) (multicluster.Component, error) {
	p := &podCounter{s: s, id: c.ID, gen: c.Generation, inf: c.Client.Informers.Core().V1().Pods().Informer()}
	s.mu.Lock()
	s.built[c.ID]++
	s.mu.Unlock()
	return p, nil
}

func (p *podCounter) HasSynced() bool {
	if !p.inf.HasSynced() {
		return false
	}
	p.s.mu.Lock()
	defer p.s.mu.Unlock()
	if !p.activated {
		p.activated = true
		if cur := p.s.serving[p.id]; cur == nil || cur.gen < p.gen {
			p.s.serving[p.id] = p
		}
	}
	return true
}

func (p *podCounter) Close() {
	p.s.mu.Lock()
	defer p.s.mu.Unlock()
	if p.s.serving[p.id] == p {
		delete(p.s.serving, p.id)
	}
}

// env runs a controller against the config cluster.
type env struct {
	t    testing.TB
	ctl  *multicluster.Controller
	sink *sink
	logs *syncBuffer
	ns   string
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

func startController(t testing.TB, ns string, tweak func(*multicluster.Config)) *env {
	t.Helper()
	return startControllerWith(t, ns, tweak, nil)
}

// startControllerWith is startController with the controller's ClientBuilder
// (nil: DefaultClientBuilder).
func startControllerWith(t testing.TB, ns string, tweak func(*multicluster.Config), build multicluster.ClientBuilder) *env {
	t.Helper()
	cfgCluster := clusters.Cluster("config")
	require.NoError(t, cfgCluster.EnsureNamespace(context.Background(), ns, nil))
	// Start from no remote secrets, so a test can run again in the same process.
	require.NoError(t, cfgCluster.Client.CoreV1().Secrets(ns).DeleteCollection(context.Background(), metav1.DeleteOptions{}, metav1.ListOptions{}))
	logs := &syncBuffer{}
	cfg := multicluster.Config{
		Namespace:        ns,
		ConfigClusterID:  "config",
		SyncTimeout:      3 * time.Second,
		LivenessInterval: 200 * time.Millisecond,
		LivenessTimeout:  time.Second,
		UnreachableAfter: 2,
		Logger:           slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
	}
	if tweak != nil {
		tweak(&cfg)
	}
	local, err := multicluster.NewClient(cfgCluster.Config)
	require.NoError(t, err)
	ctl, err := multicluster.New(cfg, local, build)
	require.NoError(t, err)
	s := newSink()
	ctl.AddComponent("pods", s.builder)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ctl.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Error("controller did not stop within 30s")
		}
	})
	require.Eventually(t, ctl.Ready, 20*time.Second, 20*time.Millisecond, "config cluster never synced")
	return &env{t: t, ctl: ctl, sink: s, logs: logs, ns: ns}
}

// with returns a copy of e that reports to t (for subtests).
func (e *env) with(t testing.TB) *env {
	c := *e
	c.t = t
	return &c
}

func (e *env) applySecret(name string, data map[string][]byte) {
	e.t.Helper()
	ctx := context.Background()
	c := clusters.Cluster("config").Client.CoreV1().Secrets(e.ns)
	sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns, Labels: map[string]string{remotesecret.IstioLabel: "true"}}, Data: data}
	cur, err := c.Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		_, err = c.Create(ctx, sec, metav1.CreateOptions{})
		require.NoError(e.t, err)
		return
	}
	require.NoError(e.t, err)
	cur.Data = data
	_, err = c.Update(ctx, cur, metav1.UpdateOptions{})
	require.NoError(e.t, err)
}

func (e *env) deleteSecret(name string) {
	e.t.Helper()
	err := clusters.Cluster("config").Client.CoreV1().Secrets(e.ns).Delete(context.Background(), name, metav1.DeleteOptions{})
	require.NoError(e.t, err)
}

func (e *env) waitState(id model.ClusterID, state multicluster.State, reason string) multicluster.Status {
	e.t.Helper()
	var last multicluster.Status
	require.EventuallyWithT(e.t, func(c *assert.CollectT) {
		s, ok := e.ctl.Status(id)
		last = s
		require.True(c, ok, "no status for %s", id)
		require.Equal(c, state, s.State, "state of %s (reason %s: %s)", id, s.Reason, s.Message)
		if reason != "" {
			require.Equal(c, reason, s.Reason)
		}
	}, 30*time.Second, 20*time.Millisecond)
	return last
}

func (e *env) waitGone(id model.ClusterID) {
	e.t.Helper()
	require.Eventually(e.t, func() bool { _, ok := e.ctl.Status(id); return !ok }, 20*time.Second, 20*time.Millisecond)
}

// kubeconfig returns a fresh reader kubeconfig (a new token each call).
func kubeconfig(t testing.TB, cluster string, id model.ClusterID) []byte {
	t.Helper()
	kc, err := clusters.Cluster(cluster).ReaderKubeconfig(context.Background(), string(id), remotesecret.ReaderOptions{})
	require.NoError(t, err)
	return kc
}

func ensurePods(t testing.TB, cluster, ns string, n int) {
	t.Helper()
	c := clusters.Cluster(cluster)
	ctx := context.Background()
	require.NoError(t, c.EnsureNamespace(ctx, ns, nil))
	for i := range n {
		_, err := c.CreatePod(ctx, framework.PodOptions{Namespace: ns, Name: fmt.Sprintf("p-%d", i), Ready: true})
		if err != nil && !strings.Contains(err.Error(), "already exists") {
			require.NoError(t, err)
		}
	}
}

func eventReasons(t testing.TB, ns, secret string) []string {
	t.Helper()
	evs, err := clusters.Cluster("config").Client.CoreV1().Events(ns).List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	var out []string
	for _, ev := range evs.Items {
		if ev.InvolvedObject.Name == secret {
			out = append(out, ev.Reason)
		}
	}
	return out
}
