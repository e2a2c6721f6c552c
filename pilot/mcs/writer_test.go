package mcs_test

import (
	"context"
	"fmt"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	mcsv1beta1 "sigs.k8s.io/mcs-api/pkg/apis/v1beta1"

	"github.com/isthmus-mesh/isthmus/pilot/mcs"
)

var crdOnce sync.Once

// env installs the MCS CRDs once and gives each test its own namespaces.
type env struct {
	mu       sync.Mutex
	services []mcs.Service
	dyn      map[string]dynamic.Interface
	ns       string
	networks map[string]string // cluster -> network; unset: "network-1"
}

func newEnv(t *testing.T) *env {
	t.Helper()
	crdOnce.Do(func() {
		for _, c := range clusters.Clusters {
			require.NoError(t, c.InstallCRDs("../../manifests/base/crds"))
		}
	})
	e := &env{dyn: map[string]dynamic.Interface{}, ns: fmt.Sprintf("mcs-%d", time.Now().UnixNano())}
	for _, c := range clusters.Clusters {
		d, err := dynamic.NewForConfig(c.Config)
		require.NoError(t, err)
		e.dyn[c.Name] = d
	}
	return e
}

func (e *env) set(s ...mcs.Service) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.services = s
}

func (e *env) deps() mcs.Deps {
	return mcs.Deps{
		Services: func() []mcs.Service {
			e.mu.Lock()
			defer e.mu.Unlock()
			return append([]mcs.Service(nil), e.services...)
		},
		Clusters: func() []mcs.Cluster {
			var out []mcs.Cluster
			for _, c := range clusters.Clusters {
				nw := e.networks[c.Name]
				if nw == "" {
					nw = "network-1"
				}
				out = append(out, mcs.Cluster{Name: c.Name, Client: e.dyn[c.Name], Network: nw})
			}
			return out
		},
	}
}

func (e *env) get(t require.TestingT, cluster, ns, name string) (*mcsv1beta1.ServiceImport, bool) {
	u, err := e.dyn[cluster].Resource(mcs.ServiceImportGVR).Namespace(ns).Get(context.Background(), name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, false
	}
	require.NoError(t, err)
	var si mcsv1beta1.ServiceImport
	require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &si))
	return &si, true
}

var (
	created = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	vip4    = netip.MustParseAddr("240.240.3.4")
	vip6    = netip.MustParseAddr("2001:2::304")
)

// TestServiceImports proves, on two real API servers: a ServiceImport per
// exported service in every cluster where its namespace exists (type,
// ports, IPs, exporting clusters, Ready and Conflict conditions); a port
// conflict settled by the oldest export and reported; the namespace
// appearing later gets its import; the import goes with the last export;
// an unmanaged ServiceImport is never touched.
func TestServiceImports(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	c1, c2 := clusters.Cluster("cluster-1"), clusters.Cluster("cluster-2")
	require.NoError(t, c1.EnsureNamespace(ctx, e.ns, nil))
	w, err := mcs.New(mcs.Config{}, e.deps())
	require.NoError(t, err)

	echo := mcs.Service{Namespace: e.ns, Name: "echo", IPs: []netip.Addr{vip4, vip6}, Exports: []mcs.ClusterExport{
		{Cluster: "cluster-1", Created: created, Ports: []mcs.Port{{Name: "http", Port: 80}}},
		{Cluster: "cluster-2", Created: created.Add(time.Minute), Ports: []mcs.Port{{Name: "http", Port: 8080}, {Name: "grpc", Port: 9090, AppProtocol: "grpc"}}},
	}}
	db := mcs.Service{Namespace: e.ns, Name: "db", Exports: []mcs.ClusterExport{
		{Cluster: "cluster-2", Created: created, Headless: true, Ports: []mcs.Port{{Name: "pg", Port: 5432}}},
	}}
	e.set(echo, db)
	require.NoError(t, w.Reconcile(ctx))

	si, ok := e.get(t, "cluster-1", e.ns, "echo")
	require.True(t, ok)
	require.Equal(t, mcsv1beta1.ClusterSetIP, si.Spec.Type)
	require.Equal(t, []string{"240.240.3.4", "2001:2::304"}, si.Spec.IPs)
	require.Len(t, si.Spec.Ports, 2)
	require.Equal(t, int32(80), si.Spec.Ports[0].Port, "the oldest export's http wins")
	require.Equal(t, "grpc", *si.Spec.Ports[1].AppProtocol)
	require.Equal(t, []mcsv1beta1.ClusterStatus{{Cluster: "cluster-1"}, {Cluster: "cluster-2"}}, si.Status.Clusters)
	require.True(t, meta.IsStatusConditionTrue(si.Status.Conditions, "Ready"))
	cf := meta.FindStatusCondition(si.Status.Conditions, mcs.ConditionConflict)
	require.NotNil(t, cf)
	require.Equal(t, metav1.ConditionTrue, cf.Status)
	require.Equal(t, mcs.ReasonPortConflict, cf.Reason)
	require.Contains(t, cf.Message, "cluster-2")
	require.Equal(t, []string{"cluster-2"}, w.Conflicts(e.ns, "echo")[0].Clusters, "exposed for the ServiceExports")

	hl, ok := e.get(t, "cluster-1", e.ns, "db")
	require.True(t, ok)
	require.Equal(t, mcsv1beta1.Headless, hl.Spec.Type)
	require.Empty(t, hl.Spec.IPs)
	require.Equal(t, metav1.ConditionFalse, meta.FindStatusCondition(hl.Status.Conditions, mcs.ConditionConflict).Status)
	_, ok = e.get(t, "cluster-2", e.ns, "echo")
	require.False(t, ok, "no namespace in cluster-2: no import there")

	// A reconcile with nothing changed writes nothing.
	rv := si.ResourceVersion
	require.NoError(t, w.Reconcile(ctx))
	si, _ = e.get(t, "cluster-1", e.ns, "echo")
	require.Equal(t, rv, si.ResourceVersion, "no write when nothing changed")

	// The namespace appears in cluster-2; an unmanaged import is there too.
	require.NoError(t, c2.EnsureNamespace(ctx, e.ns, nil))
	foreign := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "multicluster.x-k8s.io/v1beta1", "kind": "ServiceImport",
		"metadata": map[string]any{"name": "foreign", "namespace": e.ns},
		"spec":     map[string]any{"type": "ClusterSetIP", "ports": []any{map[string]any{"port": int64(1)}}},
	}}
	_, err = e.dyn["cluster-2"].Resource(mcs.ServiceImportGVR).Namespace(e.ns).Create(ctx, foreign, metav1.CreateOptions{})
	require.NoError(t, err)
	require.NoError(t, w.Reconcile(ctx))
	_, ok = e.get(t, "cluster-2", e.ns, "echo")
	require.True(t, ok)

	// echo loses its last export; db stays.
	echo.Exports = nil
	e.set(echo, db)
	require.NoError(t, w.Reconcile(ctx))
	for _, c := range []string{"cluster-1", "cluster-2"} {
		_, ok := e.get(t, c, e.ns, "echo")
		require.False(t, ok, c)
		_, ok = e.get(t, c, e.ns, "db")
		require.True(t, ok, c)
	}
	_, ok = e.get(t, "cluster-2", e.ns, "foreign")
	require.True(t, ok, "an unmanaged ServiceImport is left alone")
}

// TestRunFollowsChanges proves Run writes a change soon after Notify (the
// acceptance: within the debounce), repairs a deleted import at resync, and
// stops with its context.
func TestRunFollowsChanges(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	for _, c := range clusters.Clusters {
		require.NoError(t, c.EnsureNamespace(ctx, e.ns, nil))
	}
	w, err := mcs.New(mcs.Config{Debounce: 50 * time.Millisecond, Resync: 500 * time.Millisecond}, e.deps())
	require.NoError(t, err)
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- w.Run(rctx) }()
	defer func() {
		cancel()
		require.NoError(t, <-done)
	}()

	svc := mcs.Service{Namespace: e.ns, Name: "web", IPs: []netip.Addr{vip4}, Exports: []mcs.ClusterExport{
		{Cluster: "cluster-1", Created: created, Ports: []mcs.Port{{Name: "http", Port: 80}}},
	}}
	e.set(svc)
	w.Notify()
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		for _, cl := range []string{"cluster-1", "cluster-2"} {
			si, ok := e.get(c, cl, e.ns, "web")
			require.True(c, ok, cl)
			require.Equal(c, []string{"240.240.3.4"}, si.Spec.IPs)
		}
	}, 30*time.Second, 10*time.Millisecond)

	// A new value, not an edit of the one the writer may be reading.
	svc.Exports = []mcs.ClusterExport{{Cluster: "cluster-1", Created: created, Ports: []mcs.Port{{Name: "http", Port: 80}, {Name: "https", Port: 443}}}}
	e.set(svc)
	w.Notify()
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		si, ok := e.get(c, "cluster-2", e.ns, "web")
		require.True(c, ok)
		require.Len(c, si.Spec.Ports, 2)
	}, 30*time.Second, 10*time.Millisecond)

	require.NoError(t, e.dyn["cluster-1"].Resource(mcs.ServiceImportGVR).Namespace(e.ns).Delete(ctx, "web", metav1.DeleteOptions{}))
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		_, ok := e.get(c, "cluster-1", e.ns, "web")
		require.True(c, ok, "recreated at resync")
	}, 30*time.Second, 10*time.Millisecond)

	e.set()
	w.Notify()
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		for _, cl := range []string{"cluster-1", "cluster-2"} {
			_, ok := e.get(c, cl, e.ns, "web")
			require.False(c, ok, cl)
		}
	}, 30*time.Second, 10*time.Millisecond)
}

// TestUnreachableCluster proves a cluster that cannot be written does not
// stop the others, and its error names it.
func TestUnreachableCluster(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	require.NoError(t, clusters.Cluster("cluster-1").EnsureNamespace(ctx, e.ns, nil))
	dead, err := dynamic.NewForConfig(&rest.Config{Host: "https://127.0.0.1:1"})
	require.NoError(t, err)
	deps := e.deps()
	live := deps.Clusters
	deps.Clusters = func() []mcs.Cluster { return append([]mcs.Cluster{{Name: "gone", Client: dead}}, live()...) }
	w, err := mcs.New(mcs.Config{ClusterTimeout: 5 * time.Second}, deps)
	require.NoError(t, err)
	e.set(mcs.Service{Namespace: e.ns, Name: "echo", IPs: []netip.Addr{vip4}, Exports: []mcs.ClusterExport{
		{Cluster: "cluster-1", Created: created, Ports: []mcs.Port{{Name: "http", Port: 80}}},
	}})
	err = w.Reconcile(ctx)
	require.ErrorContains(t, err, "cluster gone")
	_, ok := e.get(t, "cluster-1", e.ns, "echo")
	require.True(t, ok, "the reachable cluster got its import")
}
