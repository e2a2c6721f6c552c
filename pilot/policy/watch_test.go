package policy_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/protobuf/encoding/protojson"
	"istio.io/api/security/v1beta1"
	securityclient "istio.io/client-go/pkg/apis/security/v1"
	"istio.io/client-go/pkg/clientset/versioned"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/internal/promread"
	securityv1 "github.com/isthmus-mesh/isthmus/pilot/api/security/v1"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/policy"
	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/ztunnel/authz"
)

var clusters *framework.ClusterSet

func TestMain(m *testing.M) {
	code := framework.Main(m, framework.Options{Names: []string{"config", "bare"}}, &clusters)
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// runWatcher runs a Watcher on cluster until the test ends.
func runWatcher(t *testing.T, cluster string, reg prometheus.Registerer) (*policy.Watcher, versioned.Interface) {
	t.Helper()
	client, err := versioned.NewForConfig(clusters.Cluster(cluster).Config)
	require.NoError(t, err)
	w, err := policy.New(policy.Config{RootNamespace: root}, policy.Deps{Client: client, Registerer: reg,
		Log: slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelInfo}))})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	return w, client
}

// TestWatcherFollowsConfigCluster creates, changes and deletes policies on a
// real API server with Istio's CRDs: each change reaches the snapshot and
// subscribers, problems are counted and listed, and /debug/authz gives
// exactly what a ztunnel needs to decide for one workload.
func TestWatcherFollowsConfigCluster(t *testing.T) {
	ctx := context.Background()
	c := clusters.Cluster("config")
	require.NoError(t, c.InstallCRDs("../../manifests/base/crds"))
	require.NoError(t, c.EnsureNamespace(ctx, "prod", nil))
	reg := prometheus.NewRegistry()
	w, client := runWatcher(t, "config", reg)
	var notified atomic.Int32
	cancel := w.Subscribe(func() { notified.Add(1) })
	defer cancel()
	require.Eventually(t, w.HasSynced, 30*time.Second, 10*time.Millisecond)
	require.Empty(t, w.Absent())

	deny := ap(t, "prod", "no-post", `
action: DENY
rules: [{from: [{source: {namespaces: ["front"]}}], to: [{operation: {methods: ["POST"]}}]}]`)
	_, err := client.SecurityV1().AuthorizationPolicies("prod").Create(ctx, deny, metav1.CreateOptions{})
	require.NoError(t, err)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		p := w.Snapshot().Policy("prod/no-post")
		require.NotNil(c, p)
		require.NotNil(c, p.Proto)
		require.Len(c, p.Problems, 1)
	}, 30*time.Second, 10*time.Millisecond)
	require.Positive(t, notified.Load())
	require.Equal(t, 1.0, testutil.ToFloat64(problemGauge(reg, policy.KindAuthorizationPolicy, policy.ReasonUnsupportedAttribute)))

	perm := pa("prod", "permissive", 0, nil, v1beta1.PeerAuthentication_MutualTLS_PERMISSIVE, nil)
	perm.CreationTimestamp = metav1.Time{}
	_, err = client.SecurityV1().PeerAuthentications("prod").Create(ctx, perm, metav1.CreateOptions{})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		return w.Snapshot().PeerAuthentication("prod", nil).GetMode() == securityv1.MTLSMode_PERMISSIVE
	}, 30*time.Second, 10*time.Millisecond)

	// /debug/authz: the workload's resources decide as its ztunnel would.
	wl := &model.Workload{Placement: &model.Placement{Cluster: "c2", Node: "n1", Namespace: "prod", ServiceAccount: "api"}, UID: "c2/prod/api-0",
		Addresses: []netip.Addr{netip.MustParseAddr("10.0.0.5")}, Labels: map[string]string{"app": "api"}}
	srv := httptest.NewServer(w.DebugHandler(func(uid string) *model.Workload {
		if uid == wl.UID {
			return wl
		}
		return nil
	}))
	defer srv.Close()
	var out struct {
		Workload  policy.WorkloadInfo
		Resources []json.RawMessage
	}
	getJSON(t, srv.URL+"/debug/authz?workload="+wl.UID, &out)
	require.True(t, out.Workload.Enforced)
	var res []*securityv1.Authorization
	for _, r := range out.Resources {
		a := &securityv1.Authorization{}
		require.NoError(t, protojson.Unmarshal(r, a))
		res = append(res, a)
	}
	zs, err := authz.NewSnapshot(res)
	require.NoError(t, err)
	c2 := conn
	c2.Workload = wl.UID
	require.Equal(t, authz.ReasonDenyPolicy, zs.Evaluate(c2).Reason, "DENY with methods denies at L4")
	plain := authz.Conn{Workload: wl.UID, Plaintext: true, DestinationPort: 8080}
	require.True(t, zs.Evaluate(plain).Allowed, "PERMISSIVE lets plaintext in")
	resp, err := http.Get(srv.URL + "/debug/authz?workload=c9/none/x")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusNotFound, resp.StatusCode)

	var sum policy.Summary
	getJSON(t, srv.URL+"/debug/authorizationz", &sum)
	require.True(t, sum.Synced)
	require.Len(t, sum.AuthorizationPolicies, 1)
	require.Equal(t, "unsupported_attribute", sum.AuthorizationPolicies[0].Problems[0].GetReason())
	require.Equal(t, "PERMISSIVE", sum.PeerAuthentications[0].Mode)

	// Delete: gone from the snapshot and the counts.
	require.NoError(t, client.SecurityV1().AuthorizationPolicies("prod").Delete(ctx, "no-post", metav1.DeleteOptions{}))
	require.Eventually(t, func() bool { return w.Snapshot().Policy("prod/no-post") == nil }, 30*time.Second, 10*time.Millisecond)
	require.Zero(t, testutil.ToFloat64(problemGauge(reg, policy.KindAuthorizationPolicy, policy.ReasonUnsupportedAttribute)))

	// Istio's pilot_k8s_cfg_events counted each informer event by kind.
	events := func(kind, event string) float64 {
		v, err := promread.Value(reg, "pilot_k8s_cfg_events", map[string]string{"type": kind, "event": event})
		require.NoError(t, err)
		return v
	}
	require.Equal(t, 1.0, events(policy.KindAuthorizationPolicy, policy.EventAdd))
	require.Equal(t, 1.0, events(policy.KindAuthorizationPolicy, policy.EventDelete))
	require.Equal(t, 1.0, events(policy.KindPeerAuthentication, policy.EventAdd))
	require.Zero(t, events(policy.KindPeerAuthentication, policy.EventDelete))
}

// TestWatcherWithoutCRDs: a config cluster without Istio's CRDs has no
// policies (none can exist): the watcher syncs, reports the CRDs absent,
// and picks policies up once the CRDs are installed.
func TestWatcherWithoutCRDs(t *testing.T) {
	ctx := context.Background()
	c := clusters.Cluster("bare")
	w, client := runWatcher(t, "bare", nil)
	require.Eventually(t, w.HasSynced, 30*time.Second, 10*time.Millisecond)
	require.ElementsMatch(t, []string{policy.KindAuthorizationPolicy, policy.KindPeerAuthentication}, w.Absent())
	require.Empty(t, w.Snapshot().Policies())

	require.NoError(t, c.InstallCRDs("../../manifests/base/crds"))
	require.NoError(t, c.EnsureNamespace(ctx, "prod", nil))
	_, err := client.SecurityV1().AuthorizationPolicies("prod").Create(ctx, ap(t, "prod", "allow-nothing", `{}`), metav1.CreateOptions{})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return w.Snapshot().Policy("prod/allow-nothing") != nil }, 2*time.Minute, 50*time.Millisecond,
		"the policy is seen once its CRD exists")
	require.Eventually(t, func() bool { return len(w.Absent()) == 0 }, 2*time.Minute, 50*time.Millisecond)
}

func getJSON(t *testing.T, url string, into any) {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.NoError(t, json.NewDecoder(resp.Body).Decode(into))
}

func problemGauge(reg *prometheus.Registry, kind, reason string) prometheus.Collector {
	return gaugeOf(reg, "isthmus_policy_problems", map[string]string{"kind": kind, "reason": reason})
}

// gaugeOf returns one series of a gathered gauge as a collector.
func gaugeOf(reg *prometheus.Registry, name string, labels map[string]string) prometheus.Collector {
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "x"})
	g.Set(-1)
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if labels[lp.GetName()] != lp.GetValue() {
					continue next
				}
			}
			g.Set(m.GetGauge().GetValue())
		}
	}
	return g
}

// TestWatcherRootSelectorPeerAuthentication: on a real API server, the
// control-plane operator writes a PERMISSIVE PeerAuthentication in the root
// namespace with selector {app: legacy} (created first, so it is the oldest
// root-namespace policy), then the STRICT mesh default. As in Istio, the
// selector policy applies to no workload: no workload's mode changes, in a
// tenant namespace or in the root namespace, legacy or not; plaintext to
// each is refused by the resources its ztunnel gets. The policy is listed
// as ignored, and counted and logged as an ignored_field problem.
func TestWatcherRootSelectorPeerAuthentication(t *testing.T) {
	ctx := context.Background()
	c := clusters.Cluster("config")
	require.NoError(t, c.InstallCRDs("../../manifests/base/crds"))
	require.NoError(t, c.EnsureNamespace(ctx, root, nil))
	require.NoError(t, c.EnsureNamespace(ctx, "billing", nil))
	reg := prometheus.NewRegistry()
	w, client := runWatcher(t, "config", reg)
	require.Eventually(t, w.HasSynced, 30*time.Second, 10*time.Millisecond)
	pas := client.SecurityV1().PeerAuthentications(root)
	create := func(p *securityclient.PeerAuthentication) {
		t.Helper()
		p.CreationTimestamp = metav1.Time{}
		_, err := pas.Create(ctx, p, metav1.CreateOptions{})
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, pas.Delete(context.Background(), p.Name, metav1.DeleteOptions{})) })
	}
	create(pa(root, "legacy", 0, map[string]string{"app": "legacy"}, v1beta1.PeerAuthentication_MutualTLS_PERMISSIVE, nil))
	waitNewerSecond(t)
	create(pa(root, "default", 0, nil, v1beta1.PeerAuthentication_MutualTLS_STRICT, nil))
	rootPAs := func(s *policy.Snapshot) []string {
		var out []string
		for _, p := range s.PeerAuths() { // oldest first
			if p.Namespace == root {
				out = append(out, p.Key())
			}
		}
		return out
	}
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.Equal(c, []string{root + "/legacy", root + "/default"}, rootPAs(w.Snapshot()), "the selector policy is the older one")
	}, 30*time.Second, 10*time.Millisecond)
	snap := w.Snapshot()

	var locals []*model.Workload
	for _, ns := range []string{"billing", root} {
		for _, app := range []string{"legacy", "api"} {
			locals = append(locals, &model.Workload{Placement: &model.Placement{Cluster: "c1", Node: "n1", Namespace: ns, ServiceAccount: app},
				UID: "c1/" + ns + "/" + app + "-0", Labels: map[string]string{"app": app}})
		}
	}
	res, err := snap.NodeResources(locals)
	require.NoError(t, err)
	var all []*securityv1.Authorization
	for _, b := range res {
		a := &securityv1.Authorization{}
		require.NoError(t, protoUnmarshal(b, a))
		all = append(all, a)
	}
	zs, err := authz.NewSnapshot(all)
	require.NoError(t, err)
	for _, wl := range locals {
		got := snap.PeerAuthentication(wl.Namespace, wl.Labels)
		require.Equal(t, securityv1.MTLSMode_STRICT, got.GetMode(), wl.UID)
		require.Equal(t, []string{root + "/default"}, got.GetSources(), wl.UID)
		d := zs.Evaluate(authz.Conn{Workload: wl.UID, Plaintext: true, SourceIP: netip.MustParseAddr("10.9.0.1"), DestinationPort: 8080})
		require.Equal(t, authz.Decision{Reason: authz.ReasonMTLSRequired, Namespace: root, Name: "default"}, d, wl.UID)
	}

	require.True(t, snap.PeerAuths()[slices.IndexFunc(snap.PeerAuths(), func(p *policy.PeerAuth) bool { return p.Key() == root+"/legacy" })].Ignored)
	require.Equal(t, 1.0, testutil.ToFloat64(problemGauge(reg, policy.KindPeerAuthentication, policy.ReasonIgnoredField)))
	srv := httptest.NewServer(w.DebugHandler(func(string) *model.Workload { return nil }))
	defer srv.Close()
	var sum policy.Summary
	getJSON(t, srv.URL+"/debug/authorizationz", &sum)
	var ignored []string
	for _, p := range sum.PeerAuthentications {
		if p.Ignored {
			ignored = append(ignored, p.Namespace+"/"+p.Name)
			require.Equal(t, "spec.selector", p.Problems[0].GetField())
		}
	}
	require.Equal(t, []string{root + "/legacy"}, ignored)
}

// waitNewerSecond waits until the wall clock is in a later second, so that
// the next object created has a later creationTimestamp (whole seconds).
func waitNewerSecond(t *testing.T) {
	t.Helper()
	start := time.Now().Truncate(time.Second)
	require.Eventually(t, func() bool { return time.Now().Truncate(time.Second).After(start) }, 5*time.Second, 20*time.Millisecond)
}
