package xds_test

import (
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/structpb"
	"istio.io/api/security/v1beta1"
	typev1beta1 "istio.io/api/type/v1beta1"
	securityclient "istio.io/client-go/pkg/apis/security/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	securityv1 "github.com/isthmus-mesh/isthmus/pilot/api/security/v1"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/policy"
	"github.com/isthmus-mesh/isthmus/pilot/xds"
	"github.com/isthmus-mesh/isthmus/pilot/xds/xdstest"
)

const rootNS = "istio-system"

// fakePolicies is a policy source the test sets by hand (the real one,
// pilot/policy.Watcher, is tested on a real API server).
type fakePolicies struct {
	mu     sync.Mutex
	synced atomic.Bool
	snap   atomic.Pointer[policy.Snapshot]
	subs   []func()
}

func newFakePolicies(t *testing.T, synced bool, aps ...*securityclient.AuthorizationPolicy) *fakePolicies {
	f := &fakePolicies{}
	f.set(t, aps...)
	f.synced.Store(synced)
	return f
}

func (f *fakePolicies) HasSynced() bool            { return f.synced.Load() }
func (f *fakePolicies) Snapshot() *policy.Snapshot { return f.snap.Load() }
func (f *fakePolicies) Subscribe(fn func()) func() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.subs = append(f.subs, fn)
	return func() {}
}

// set replaces the policies (without notifying).
func (f *fakePolicies) set(t *testing.T, aps ...*securityclient.AuthorizationPolicy) {
	var ps []*policy.Policy
	for _, a := range aps {
		ps = append(ps, policy.ConvertAuthorizationPolicy(rootNS, a))
	}
	s, err := policy.NewSnapshot(rootNS, ps, nil)
	require.NoError(t, err)
	f.snap.Store(s)
}

func (f *fakePolicies) notify() {
	f.mu.Lock()
	subs := slices.Clone(f.subs)
	f.mu.Unlock()
	for _, fn := range subs {
		fn()
	}
}

// authPolicy is an AuthorizationPolicy denying everything, with selector
// labels if given.
func authPolicy(ns, name string, selector map[string]string) *securityclient.AuthorizationPolicy {
	ap := &securityclient.AuthorizationPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
	ap.Spec.Action = v1beta1.AuthorizationPolicy_DENY
	ap.Spec.Rules = []*v1beta1.Rule{{}}
	if selector != nil {
		ap.Spec.Selector = &typev1beta1.WorkloadSelector{MatchLabels: selector}
	}
	return ap
}

// onNode is a pod workload on node of cluster.
func onNode(cluster model.ClusterID, node, ns, name, app string) *model.Workload {
	w := xdstest.Pod(cluster, "net1", ns, name, ip("10.0.0.1"))
	w.Placement = &model.Placement{Cluster: cluster, Network: "net1", Node: node, Namespace: ns, ServiceAccount: "default"}
	w.Labels = map[string]string{"app": app}
	return w
}

func nodeClaims(id string, cluster model.ClusterID, nodeName string) *corev3.Node {
	md, _ := structpb.NewStruct(map[string]any{xds.MetadataClusterID: string(cluster), xds.MetadataNodeName: nodeName, xds.MetadataNetwork: "net1"})
	return &corev3.Node{Id: id, Metadata: md}
}

func authzRequest(n *corev3.Node) *discovery.DeltaDiscoveryRequest {
	return &discovery.DeltaDiscoveryRequest{Node: n, TypeUrl: xds.AuthorizationType}
}

func sortedState(c *deltaClient) []string { return slices.Sorted(maps.Keys(c.state)) }

// TestAuthorizationServedPerNode: each node ztunnel gets the mesh-wide
// policies, the namespace policies of the namespaces it runs (in any
// cluster: namespace sameness), the selector policies that select one of
// its workloads, and a binding per local workload; a new workload arrives
// with its policies in one response; a policy change reaches only the nodes
// it concerns.
func TestAuthorizationServedPerNode(t *testing.T) {
	reg := xdstest.New()
	reg.Update(func(tx *xdstest.Tx) {
		tx.SetWorkload(onNode("c1", "n1", "prod", "a", "a"))
		tx.SetWorkload(onNode("c1", "n2", "dev", "b", "b"))
		tx.SetWorkload(onNode("c2", "n1", "prod", "c", "c"))
		zt := onNode("c1", "n1", rootNS, "ztunnel", "ztunnel")
		zt.HostNetwork = true
		tx.SetWorkload(zt)
	})
	src := newFakePolicies(t, true,
		authPolicy(rootNS, "mesh", nil), authPolicy("prod", "prod-all", nil), authPolicy("dev", "dev-all", nil),
		authPolicy("prod", "for-a", map[string]string{"app": "a"}), authPolicy("prod", "for-z", map[string]string{"app": "z"}),
		authPolicy(rootNS, "root-for-c", map[string]string{"app": "c"}))
	e := startWith(t, reg, xds.Config{AllowPlaintext: true, Policies: src})
	cc := dial(t, e.addr)

	open := func(cluster model.ClusterID, nodeName string) *deltaClient {
		c := openDelta(t, cc, authzRequest(nodeClaims("ztunnel~"+nodeName, cluster, nodeName)))
		c.apply(c.next())
		return c
	}
	c1n1, c1n2, c2n1 := open("c1", "n1"), open("c1", "n2"), open("c2", "n1")
	require.Equal(t, []string{"policy/istio-system/mesh", "policy/prod/for-a", "policy/prod/prod-all", "workload/c1/prod/a"}, sortedState(c1n1))
	require.Equal(t, []string{"policy/dev/dev-all", "policy/istio-system/mesh", "workload/c1/dev/b"}, sortedState(c1n2))
	require.Equal(t, []string{"policy/istio-system/mesh", "policy/istio-system/root-for-c", "policy/prod/prod-all", "workload/c2/prod/c"}, sortedState(c2n1))

	// A dev workload lands on c1/n1: its namespace's policy comes with its
	// binding, in one response.
	reg.SetWorkload(onNode("c1", "n1", "dev", "d", "d"))
	r := c1n1.next()
	require.ElementsMatch(t, []string{"policy/dev/dev-all", "workload/c1/dev/d"}, names(r))
	c1n1.apply(r)

	// The selector starts matching another workload: only its node hears.
	src.set(t, authPolicy(rootNS, "mesh", nil), authPolicy("prod", "prod-all", nil), authPolicy("dev", "dev-all", nil),
		authPolicy("prod", "for-a", map[string]string{"app": "a"}), authPolicy("prod", "for-z", map[string]string{"app": "c"}),
		authPolicy(rootNS, "root-for-c", map[string]string{"app": "c"}))
	src.notify()
	r = c2n1.next()
	require.ElementsMatch(t, []string{"policy/prod/for-z", "workload/c2/prod/c"}, names(r))
	c2n1.apply(r)
	// The binding names the selector policies and the PeerAuthentication.
	var b securityv1.Authorization
	for _, res := range r.GetResources() {
		if res.GetName() == "workload/c2/prod/c" {
			require.NoError(t, res.GetResource().UnmarshalTo(&b))
		}
	}
	require.Equal(t, []string{"istio-system/root-for-c", "prod/for-z"}, b.GetWorkload().GetPolicies())
	require.Equal(t, securityv1.MTLSMode_STRICT, b.GetWorkload().GetPeerAuthentication().GetMode())
	c1n1.quiet(200 * time.Millisecond)
	c1n2.quiet(0)

	// The workload leaves: its binding goes, and its namespace's policy
	// with it.
	reg.RemoveWorkload("c1/dev/d")
	r = c1n1.next()
	require.ElementsMatch(t, []string{"policy/dev/dev-all", "workload/c1/dev/d"}, r.GetRemovedResources())
}

// TestAuthorizationWaitsForPolicies: before the policies have synced a
// ztunnel is answered nothing (it then refuses connections whose policies
// it does not know); the answer comes when they sync.
func TestAuthorizationWaitsForPolicies(t *testing.T) {
	reg := xdstest.New()
	reg.SetWorkload(onNode("c1", "n1", "prod", "a", "a"))
	src := newFakePolicies(t, false, authPolicy("prod", "prod-all", nil))
	e := startWith(t, reg, xds.Config{AllowPlaintext: true, Policies: src})
	c := openDelta(t, dial(t, e.addr), authzRequest(nodeClaims("zt", "c1", "n1")))
	c.quiet(300 * time.Millisecond)
	src.synced.Store(true)
	src.notify()
	c.apply(c.next())
	require.Equal(t, []string{"policy/prod/prod-all", "workload/c1/prod/a"}, sortedState(c))
}

// TestAuthorizationNodeAccountsOnly: over TLS the type is served to a node
// account on the node it was placed on; another identity is refused even
// when it claims the verified-node metadata itself.
func TestAuthorizationNodeAccountsOnly(t *testing.T) {
	e := startTLS(t, authRegistry())
	zt := openDelta(t, e.dialAs(t, e.ca, ztunnelID, n1), authzRequest(claims("zt-1", "c1", "", "c1-n1")))
	r := zt.next()
	require.Equal(t, xds.AuthorizationType, r.GetTypeUrl())

	n := claims("liar", "c1", "", "c1-n1")
	n.Metadata.Fields[xds.MetadataVerifiedNode] = structpb.NewStringValue("c1-node")
	msg := refusedWith(t, e.dialAs(t, e.ca, clientID), authzRequest(n), codes.PermissionDenied)
	require.Contains(t, msg, "node proxies")
}
