package endpoints_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/registry"
	"github.com/isthmus-mesh/isthmus/pilot/xds"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// address is one address of a slice written by putSlice.
type address struct {
	addr  string
	ready bool
	node  string
	pod   string // targetRef pod name ("" for none)
}

// putSlice creates or replaces EndpointSlice name of service svc in ns,
// port "sql" 5432, with addrs.
func putSlice(ctx context.Context, c *framework.Cluster, ns, name, svc string, addrs ...address) error {
	es := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{discoveryv1.LabelServiceName: svc}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: ptr.To("sql"), Port: ptr.To[int32](5432), Protocol: ptr.To(corev1.ProtocolTCP)}},
	}
	for _, a := range addrs {
		ep := discoveryv1.Endpoint{Addresses: []string{a.addr}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(a.ready)}}
		if a.node != "" {
			ep.NodeName = ptr.To(a.node)
		}
		if a.pod != "" {
			ep.TargetRef = &corev1.ObjectReference{Kind: "Pod", Namespace: ns, Name: a.pod}
		}
		es.Endpoints = append(es.Endpoints, ep)
	}
	api := c.Client.DiscoveryV1().EndpointSlices(ns)
	cur, err := api.Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		_, err = api.Create(ctx, es, metav1.CreateOptions{})
		return err
	}
	if err != nil {
		return err
	}
	es.ResourceVersion = cur.ResourceVersion
	_, err = api.Update(ctx, es, metav1.UpdateOptions{})
	return err
}

// dbFixture is a selector-less service "db" (port sql 5432) in ns of one
// cluster whose slice "db-1" lists addr, naming pod "db-0".
type dbFixture struct {
	c        *framework.Cluster
	ns, addr string
	host     string
}

func newDB(t *testing.T, c *framework.Cluster, ns, addr string) *dbFixture {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, c.EnsureNamespace(ctx, ns, nil))
	for node, region := range map[string]string{"node-a": "region-a", "node-b": "region-b", "node-c": "region-c"} {
		if _, err := c.CreateNode(ctx, node, map[string]string{corev1.LabelTopologyRegion: region}); !apierrors.IsAlreadyExists(err) {
			require.NoError(t, err)
		}
	}
	_, err := c.CreateService(ctx, ns, "db", nil, framework.ServicePort{Name: "sql", Port: 5432, TargetPort: 5432})
	require.NoError(t, err)
	return &dbFixture{c: c, ns: ns, addr: addr, host: model.Hostname("db", ns, "")}
}

// pod creates pod db-0 at the fixture's address with service account sa on
// node.
func (f *dbFixture) pod(t *testing.T, sa, node string, ready bool) *corev1.Pod {
	t.Helper()
	p, err := f.c.CreatePod(context.Background(), framework.PodOptions{Namespace: f.ns, Name: "db-0", ServiceAccount: sa, Node: node,
		IP: netip.MustParseAddr(f.addr), Ready: ready})
	require.NoError(t, err)
	return p
}

// slice writes slice db-1: the address on node-b, naming db-0.
func (f *dbFixture) slice(t *testing.T, ready bool) {
	t.Helper()
	require.NoError(t, putSlice(context.Background(), f.c, f.ns, "db-1", "db", address{addr: f.addr, ready: ready, node: "node-b", pod: "db-0"}))
}

func (f *dbFixture) setPodReady(t *testing.T, ready bool) {
	t.Helper()
	p, err := f.c.Client.CoreV1().Pods(f.ns).Get(context.Background(), "db-0", metav1.GetOptions{})
	require.NoError(t, err)
	_, err = f.c.SetPodStatus(context.Background(), p, netip.Addr{}, ready)
	require.NoError(t, err)
}

// want is what pilot must say of the fixture's endpoint.
type want struct {
	ready            bool
	identity, node   string
	locality, podSvc string
	podReady         *bool // the pod's own workload's readiness (nil: no pod)
}

// expectEndpoint waits until the registry (as /debug/endpointz shows it),
// EDS and the pod's workload say w of the fixture's address.
func (f *dbFixture) expectEndpoint(t *testing.T, p *pilot, w want) {
	t.Helper()
	health := corev3.HealthStatus_HEALTHY
	if !w.ready {
		health = corev3.HealthStatus_UNHEALTHY
	}
	cluster := model.ClusterID(f.c.Name)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		ev := p.endpointView(f.host, cluster, f.addr)
		require.NotNil(c, ev)
		assert.Equal(c, registry.EndpointView{Address: f.addr, Workload: model.SliceWorkloadPrefix(cluster, model.ServiceKey{Namespace: f.ns, Name: "db"}) + f.addr,
			Cluster: cluster, Network: network, Locality: w.locality, Identity: w.identity, Node: w.node, Ready: w.ready,
			Ports: []model.PortMapping{{ServicePort: 5432, TargetPort: 5432}}}, *ev)
		assert.Equal(c, map[string]corev3.HealthStatus{f.addr + ":5432": health}, p.edsHealth(c, xds.ClusterName(f.host, 5432)))
		pw := p.Registry.Workload(model.WorkloadUID(cluster, f.ns, "db-0"))
		if w.podReady == nil {
			assert.Nil(c, pw)
			assert.Equal(c, []string{ev.Workload}, p.workloadsAt(c, f.addr), "the slice address is served alone")
			return
		}
		require.NotNil(c, pw)
		assert.Equal(c, *w.podReady, pw.Ready, "the pod's own readiness")
		assert.Contains(c, pw.Services, f.host, "the pod is bound to the service")
		assert.Equal(c, []string{pw.UID}, p.workloadsAt(c, f.addr), "the pod's workload is served for its address")
	}, time.Minute, 20*time.Millisecond)
}

var orders = []string{"pod first", "slice first"}

// TestSliceAddressReadiness: the readiness of a slice address naming a pod
// is the slice's, whatever the order in which the pod and the slice were
// made and change: a pod turning unready before its slice follows leaves
// the endpoint ready until the slice says otherwise, and a slice turning
// unready first makes it unready at once (it used to keep the readiness the
// pod had when the slice was last read).
func TestSliceAddressReadiness(t *testing.T) {
	registerRemotes(t, "isthmus-readiness")
	p := startPilot(t, "isthmus-readiness")
	bound := want{ready: true, identity: "", node: "node-a", locality: "region-a//", podReady: ptr.To(true)}
	for i, order := range orders {
		t.Run(order, func(t *testing.T) {
			f := newDB(t, clusters.Cluster("cluster-1"), "readiness-"+[]string{"a", "b"}[i], "10.91.0."+[]string{"1", "2"}[i])
			w := bound
			w.identity = f.ns + "/db"
			if order == "pod first" {
				f.pod(t, "db", "node-a", true)
				f.slice(t, true)
			} else {
				f.slice(t, true)
				f.pod(t, "db", "node-a", true)
			}
			f.expectEndpoint(t, p, w)
			// The pod turns unready and its slice follows, in this order.
			if order == "pod first" {
				f.setPodReady(t, false)
				w.podReady = ptr.To(false)
				f.expectEndpoint(t, p, w) // the slice still says ready
				f.slice(t, false)
			} else {
				f.slice(t, false)
				w.ready = false
				f.expectEndpoint(t, p, w) // the pod still is
				f.setPodReady(t, false)
			}
			w.ready, w.podReady = false, ptr.To(false)
			f.expectEndpoint(t, p, w)
			// And back.
			if order == "pod first" {
				f.setPodReady(t, true)
				f.slice(t, true)
			} else {
				f.slice(t, true)
				f.setPodReady(t, true)
			}
			w.ready, w.podReady = true, ptr.To(true)
			f.expectEndpoint(t, p, w)
		})
	}
}

// TestSliceAddressIdentity: a slice address naming a pod has the pod's
// identity and placement while the pod exists with that address, whichever
// came first; when the pod goes it stands alone (the slice's node, the
// namespace's default account, nothing of the dead pod); a pod recreated
// under another account on another node is followed at once.
func TestSliceAddressIdentity(t *testing.T) {
	registerRemotes(t, "isthmus-identity")
	p := startPilot(t, "isthmus-identity")
	for i, order := range orders {
		t.Run(order, func(t *testing.T) {
			f := newDB(t, clusters.Cluster("cluster-2"), "identity-"+[]string{"a", "b"}[i], "10.92.0."+[]string{"1", "2"}[i])
			if order == "pod first" {
				f.pod(t, "db", "node-a", true)
				f.slice(t, true)
			} else {
				f.slice(t, true)
				f.pod(t, "db", "node-a", true)
			}
			f.expectEndpoint(t, p, want{ready: true, identity: f.ns + "/db", node: "node-a", locality: "region-a//", podReady: ptr.To(true)})

			ctx := context.Background()
			require.NoError(t, f.c.Client.CoreV1().Pods(f.ns).Delete(ctx, "db-0", metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}))
			f.expectEndpoint(t, p, want{ready: true, identity: f.ns + "/default", node: "node-b", locality: "region-b//"})
			uid := model.SliceWorkloadPrefix(model.ClusterID(f.c.Name), model.ServiceKey{Namespace: f.ns, Name: "db"}) + f.addr
			assert.Equal(t, f.addr, p.Registry.Workload(uid).Name, "no name of the dead pod")

			f.pod(t, "db-v2", "node-c", true)
			f.expectEndpoint(t, p, want{ready: true, identity: f.ns + "/db-v2", node: "node-c", locality: "region-c//", podReady: ptr.To(true)})
		})
	}
}

// TestSliceAddressStartup: whichever of the pod and the slice was made
// first, a pilot started afterwards binds the address to the pod, and
// every restart gives the same endpoint (it used to depend on which watch
// listed first).
func TestSliceAddressStartup(t *testing.T) {
	registerRemotes(t, "isthmus-startup")
	for i, order := range orders {
		t.Run(order, func(t *testing.T) {
			f := newDB(t, clusters.Cluster("cluster-3"), "startup-"+[]string{"a", "b"}[i], "10.93.0."+[]string{"1", "2"}[i])
			if order == "pod first" {
				f.pod(t, "db", "node-a", true)
				f.slice(t, false)
			} else {
				f.slice(t, false)
				f.pod(t, "db", "node-a", true)
			}
			var first *registry.EndpointView
			for range 3 {
				p := startPilot(t, "isthmus-startup")
				f.expectEndpoint(t, p, want{ready: false, identity: f.ns + "/db", node: "node-a", locality: "region-a//", podReady: ptr.To(true)})
				ev := p.endpointView(f.host, model.ClusterID(f.c.Name), f.addr)
				if first == nil {
					first = ev
				}
				assert.Equal(t, *first, *ev, "the same endpoint after a restart")
				require.NoError(t, p.stop())
			}
		})
	}
}
