package controller_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/isthmus-mesh/isthmus/controller"
	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/registry"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

var clusters *framework.ClusterSet

func TestMain(m *testing.M) {
	code := framework.Main(m, framework.Options{Names: []string{"cluster-1", "cluster-2", "cluster-3"}}, &clusters)
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// events counts the registry's change sets and the changes in them.
type events struct {
	mu   sync.Mutex
	sets []model.ChangeSet
}

func (e *events) add(cs model.ChangeSet) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.sets = append(e.sets, cs)
}

func (e *events) snapshot() []model.ChangeSet {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]model.ChangeSet(nil), e.sets...)
}

// federation runs multicluster + discovery + registry for cluster-1 (config,
// network-1) and whatever remotes the test registers.
type federation struct {
	ns     string
	ctl    *multicluster.Controller
	reg    *registry.Registry
	events *events
}

func startFederation(t testing.TB, ns string, regCfg registry.Config, discCfg controller.Config, mc ...func(*multicluster.Config)) *federation {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	c1 := clusters.Cluster("cluster-1")
	require.NoError(t, c1.EnsureNamespace(ctx, ns, nil))
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	regCfg.Logger = log
	reg := registry.New(regCfg)
	ev := &events{}
	reg.Subscribe(ev.add)
	local, err := multicluster.NewClient(c1.Config)
	require.NoError(t, err)
	mcCfg := multicluster.Config{
		Namespace: ns, ConfigClusterID: "cluster-1", ConfigClusterNetwork: "network-1",
		LivenessInterval: 200 * time.Millisecond, UnreachableAfter: 2, Logger: log,
	}
	for _, f := range mc {
		f(&mcCfg)
	}
	ctl, err := multicluster.New(mcCfg, local, nil)
	require.NoError(t, err)
	discCfg.ControlPlaneNamespace = ns
	discCfg.Logger = log
	ctl.AddComponent("discovery", controller.NewBuilder(discCfg, reg))
	ctl.Subscribe(func(s multicluster.Status) {
		switch s.State {
		case multicluster.StateUnreachable:
			reg.SetReachable(s.ID, false)
		case multicluster.StateSynced:
			reg.SetReachable(s.ID, true)
		}
	})
	var wg sync.WaitGroup
	wg.Go(func() { _ = reg.Run(ctx) })
	wg.Go(func() { _ = ctl.Run(ctx) })
	t.Cleanup(func() { cancel(); wg.Wait() })
	require.Eventually(t, ctl.Ready, 30*time.Second, 10*time.Millisecond)
	return &federation{ns: ns, ctl: ctl, reg: reg, events: ev}
}

func (f *federation) register(t *testing.T, cluster string, network model.Network) {
	t.Helper()
	kc, err := clusters.Cluster(cluster).ReaderKubeconfig(context.Background(), cluster, remotesecret.ReaderOptions{})
	require.NoError(t, err)
	sec := remotesecret.Secret(cluster, f.ns, kc)
	sec.Annotations[remotesecret.NetworkAnnotation] = string(network)
	_, err = clusters.Cluster("cluster-1").Client.CoreV1().Secrets(f.ns).Create(context.Background(), sec, metav1.CreateOptions{})
	require.NoError(t, err)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		s, ok := f.ctl.Status(model.ClusterID(cluster))
		require.True(c, ok)
		require.Equal(c, multicluster.StateSynced, s.State, s.Message)
	}, 30*time.Second, 10*time.Millisecond)
}

func (f *federation) unregister(t *testing.T, cluster string) {
	t.Helper()
	require.NoError(t, clusters.Cluster("cluster-1").Client.CoreV1().Secrets(f.ns).Delete(context.Background(), "istio-remote-secret-"+cluster, metav1.DeleteOptions{}))
}

// deploy creates namespace ns, a service with a selector and n ready pods
// on node, with loopback addresses 127.<a>.<b>.<i+1>.
func deploy(t *testing.T, cluster, ns, name, node string, a, b byte, n int) {
	t.Helper()
	ctx := context.Background()
	c := clusters.Cluster(cluster)
	require.NoError(t, c.EnsureNamespace(ctx, ns, nil))
	_, err := c.CreateService(ctx, ns, name, map[string]string{"app": name}, framework.ServicePort{Name: "http", Port: 80, TargetPort: 8080})
	require.NoError(t, err)
	for i := range n {
		_, err := c.CreatePod(ctx, framework.PodOptions{Namespace: ns, Name: fmt.Sprintf("%s-%d", name, i), Labels: map[string]string{"app": name},
			ServiceAccount: name, Node: node, IP: netip.AddrFrom4([4]byte{127, a, b, byte(i + 1)}), Ready: true})
		require.NoError(t, err)
	}
}

func TestFederatedService(t *testing.T) {
	ctx := context.Background()
	c1, c2 := clusters.Cluster("cluster-1"), clusters.Cluster("cluster-2")
	_, err := c1.CreateNode(ctx, "node-a", map[string]string{corev1.LabelTopologyRegion: "eu", corev1.LabelTopologyZone: "eu-1", controller.SubzoneLabel: "rack1"})
	require.NoError(t, err)
	_, err = c2.CreateNode(ctx, "node-b", map[string]string{corev1.LabelTopologyRegion: "us", corev1.LabelTopologyZone: "us-2"})
	require.NoError(t, err)
	deploy(t, "cluster-1", "demo", "echo", "node-a", 10, 1, 2)
	deploy(t, "cluster-2", "demo", "echo", "node-b", 10, 2, 3)
	deploy(t, "cluster-2", "kube-system", "kube-dns", "node-b", 10, 3, 1)

	f := startFederation(t, "fed-1", registry.Config{QuietPeriod: 20 * time.Millisecond}, controller.Config{})
	f.register(t, "cluster-2", "network-2")
	const host = "echo.demo.svc.cluster.local"

	// One federated service with the endpoints of both clusters.
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		s := f.reg.Service(host)
		require.NotNil(c, s)
		require.Equal(c, []model.ClusterID{"cluster-1", "cluster-2"}, s.Clusters)
		require.Len(c, s.Shards["cluster-1"], 2)
		require.Len(c, s.Shards["cluster-2"], 3)
	}, 30*time.Second, 10*time.Millisecond)
	s := f.reg.Service(host)
	e1, e2 := s.Shards["cluster-1"][0], s.Shards["cluster-2"][0]
	require.Equal(t, model.Network("network-1"), e1.Network())
	require.Equal(t, model.Network("network-2"), e2.Network())
	// Each cluster's VIPs are on that cluster's network.
	require.Equal(t, map[model.ClusterID]model.Network{"cluster-1": "network-1", "cluster-2": "network-2"}, s.VIPNetworks)
	require.Equal(t, model.Locality{Region: "eu", Zone: "eu-1", Subzone: "rack1"}, e1.Locality())
	require.Equal(t, model.Locality{Region: "us", Zone: "us-2"}, e2.Locality())
	require.Equal(t, netip.MustParseAddr("127.10.1.1"), e1.Address())
	require.Equal(t, []model.PortMapping{{ServicePort: 80, TargetPort: 8080}}, e1.Ports)
	require.Equal(t, "echo", e1.ServiceAccount())
	w := f.reg.Workload("cluster-2/demo/echo-0")
	require.NotNil(t, w)
	require.Equal(t, model.Network("network-2"), w.Network)
	require.Contains(t, w.Services, host)
	require.True(t, f.reg.ServiceAccountOnNode("cluster-2", "node-b", "demo", "echo"))

	// kube-system never crosses clusters.
	dns := f.reg.Service("kube-dns.kube-system.svc.cluster.local")
	require.NotNil(t, dns)
	require.Equal(t, model.ScopeClusterLocal, dns.Scope)
	require.False(t, dns.ShardVisible("cluster-2", "cluster-1"))

	// Equal updates produce no event: an annotation (resourceVersion bump) on every pod.
	time.Sleep(100 * time.Millisecond)
	before := len(f.events.snapshot())
	for i := range 3 {
		_, err := c2.Client.CoreV1().Pods("demo").Patch(ctx, fmt.Sprintf("echo-%d", i), types.MergePatchType,
			[]byte(`{"metadata":{"annotations":{"touched":"yes"}}}`), metav1.PatchOptions{})
		require.NoError(t, err)
	}
	// A marker change after them proves the pod updates were processed.
	_, err = c2.CreatePod(ctx, framework.PodOptions{Namespace: "demo", Name: "marker", IP: netip.MustParseAddr("127.10.2.200"), Ready: true})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return f.reg.Workload("cluster-2/demo/marker") != nil }, 10*time.Second, 5*time.Millisecond)
	time.Sleep(100 * time.Millisecond)
	after := f.events.snapshot()[before:]
	for _, cs := range after {
		for _, ch := range cs.Changes {
			require.Equal(t, "cluster-2/demo/marker", ch.Key, "only the marker changed: %+v", ch)
		}
	}

	// A hostNetwork pod (a ztunnel) is a workload marked HostNetwork, and
	// the registry places its identity on its node and network.
	_, err = c2.CreatePod(ctx, framework.PodOptions{Namespace: "demo", Name: "node-agent", ServiceAccount: "agent", Node: "node-x",
		IP: netip.MustParseAddr("127.10.2.201"), HostNetwork: true, Ready: true})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return f.reg.Workload("cluster-2/demo/node-agent") != nil }, 10*time.Second, 5*time.Millisecond)
	require.True(t, f.reg.Workload("cluster-2/demo/node-agent").HostNetwork)
	require.False(t, f.reg.Workload("cluster-2/demo/marker").HostNetwork)
	require.Equal(t, []model.Network{f.reg.Workload("cluster-2/demo/marker").Network}, f.reg.IdentityNetworks("cluster-2", "node-x", "demo", "agent"))

	// A pod going unready updates its endpoint.
	pod, err := c2.Client.CoreV1().Pods("demo").Get(ctx, "echo-2", metav1.GetOptions{})
	require.NoError(t, err)
	_, err = c2.SetPodStatus(ctx, pod, netip.MustParseAddr("127.10.2.3"), false)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		for _, e := range f.reg.Service(host).Shards["cluster-2"] {
			if e.Address() == netip.MustParseAddr("127.10.2.3") {
				return !e.Ready()
			}
		}
		return false
	}, 10*time.Second, 5*time.Millisecond)

	// Deleting the service in cluster-2 removes only that shard.
	require.NoError(t, c2.Client.CoreV1().Services("demo").Delete(ctx, "echo", metav1.DeleteOptions{}))
	require.Eventually(t, func() bool {
		s := f.reg.Service(host)
		return s != nil && len(s.Clusters) == 1 && s.Shards["cluster-2"] == nil
	}, 10*time.Second, 5*time.Millisecond)
	require.Len(t, f.reg.Service(host).Shards["cluster-1"], 2)
	require.Empty(t, f.reg.Workload("cluster-2/demo/echo-0").Services, "the pods no longer back the service")

	// Removing cluster-2's Secret removes everything of cluster-2 in one event.
	time.Sleep(100 * time.Millisecond)
	before = len(f.events.snapshot())
	var c2Workloads int
	for _, wl := range f.reg.Workloads() {
		if wl.Cluster == "cluster-2" {
			c2Workloads++
		}
	}
	// 3 echo pods, kube-dns, the marker, the node agent, and the API
	// server's own endpoint of the selector-less kubernetes service (from
	// its EndpointSlice).
	require.Equal(t, 7, c2Workloads)
	require.NotNil(t, f.reg.Workload("cluster-2/default/endpointslice.kubernetes."+kubernetesEndpoint(t, c2)))
	f.unregister(t, "cluster-2")
	require.Eventually(t, func() bool { return f.reg.Workload("cluster-2/demo/echo-0") == nil }, 10*time.Second, 5*time.Millisecond)
	time.Sleep(100 * time.Millisecond)
	removal := f.events.snapshot()[before:]
	require.Len(t, removal, 1, "one change set")
	var removedWorkloads int
	for _, ch := range removal[0].Changes {
		if ch.Kind == model.WorkloadChange && ch.Op == model.Removed {
			removedWorkloads++
		}
	}
	require.Equal(t, c2Workloads, removedWorkloads)
	require.Nil(t, f.reg.Service("kube-dns.kube-system.svc.cluster.local"))
	for _, wl := range f.reg.Workloads() {
		require.Equal(t, model.ClusterID("cluster-1"), wl.Cluster)
	}
}

// kubernetesEndpoint returns the address the API server publishes in the
// EndpointSlice of the kubernetes service.
func kubernetesEndpoint(t *testing.T, c *framework.Cluster) string {
	t.Helper()
	var addr string
	require.Eventually(t, func() bool {
		es, err := c.Client.DiscoveryV1().EndpointSlices("default").Get(context.Background(), "kubernetes", metav1.GetOptions{})
		if err != nil || len(es.Endpoints) == 0 {
			return false
		}
		addr = es.Endpoints[0].Addresses[0]
		return true
	}, 10*time.Second, 10*time.Millisecond)
	return addr
}
