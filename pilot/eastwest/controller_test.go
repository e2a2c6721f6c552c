package eastwest_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"
	gwv1 "sigs.k8s.io/gateway-api/apis/v1"

	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/pilot/eastwest"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

var clusters *framework.ClusterSet

func TestMain(m *testing.M) {
	ctrllog.SetLogger(logr.Discard())
	code := framework.Main(m, framework.Options{Names: []string{"cluster-1", "cluster-2"}}, &clusters)
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

const (
	wait = 30 * time.Second
	poll = 20 * time.Millisecond
	ns   = "isthmus-system"
)

// installGatewayAPI installs the GatewayClass and Gateway CRDs of the
// sigs.k8s.io/gateway-api module in c.
func installGatewayAPI(t *testing.T, c *framework.Cluster) {
	t.Helper()
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "sigs.k8s.io/gateway-api").Output()
	require.NoError(t, err)
	dir := filepath.Join(strings.TrimSpace(string(out)), "config", "crd", "standard")
	require.NoError(t, c.InstallCRDs(filepath.Join(dir, "gateway.networking.k8s.io_gatewayclasses.yaml"),
		filepath.Join(dir, "gateway.networking.k8s.io_gateways.yaml")))
}

func newClient(t *testing.T, c *framework.Cluster) client.Client {
	t.Helper()
	s := runtime.NewScheme()
	require.NoError(t, corev1.AddToScheme(s))
	require.NoError(t, appsv1.AddToScheme(s))
	require.NoError(t, gwv1.Install(s))
	cl, err := client.New(c.Config, client.Options{Scheme: s})
	require.NoError(t, err)
	return cl
}

// start builds the controller's component for c until the test ends.
// trustDomain is the cluster's own ("": the mesh's).
func start(t *testing.T, cfg eastwest.Config, deps eastwest.Deps, c *framework.Cluster, trustDomain string) (*eastwest.Controller, multicluster.Component) {
	t.Helper()
	ctl, err := eastwest.New(cfg, deps)
	require.NoError(t, err)
	comp, err := ctl.Build(t.Context(), &multicluster.Cluster{ID: "c", Client: &multicluster.Client{REST: c.Config}, Network: "n", TrustDomain: trustDomain})
	require.NoError(t, err)
	t.Cleanup(comp.Close)
	return ctl, comp
}

func gateway(namespace, name, network string) *gwv1.Gateway {
	return &gwv1.Gateway{
		ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name, Labels: map[string]string{eastwest.NetworkLabel: network}},
		Spec: gwv1.GatewaySpec{GatewayClassName: eastwest.ClassName,
			Listeners: []gwv1.Listener{{Name: "hbone", Port: eastwest.HBONEPort, Protocol: eastwest.HBONEProtocol}}},
	}
}

// accepted returns the Gateway's Accepted condition (nil: none yet).
func accepted(ctx context.Context, cl client.Client, gw *gwv1.Gateway) *metav1.Condition {
	var got gwv1.Gateway
	if err := cl.Get(ctx, client.ObjectKeyFromObject(gw), &got); err != nil {
		return nil
	}
	return meta.FindStatusCondition(got.Status.Conditions, string(gwv1.GatewayConditionAccepted))
}

func deployed(ctx context.Context, cl client.Client, gw *gwv1.Gateway) error {
	var d appsv1.Deployment
	return cl.Get(ctx, client.ObjectKey{Namespace: gw.Namespace, Name: eastwest.ObjectName(gw.Name)}, &d)
}

// TestGatewayAPILateAndLeadership runs the controller on a cluster without
// the Gateway API (synced, nothing to do), then installs it; a follower
// writes nothing, and the same replica becoming the leader (Resync)
// writes the class, deploys the Gateway and writes its status.
func TestGatewayAPILateAndLeadership(t *testing.T) {
	ctx := t.Context()
	c := clusters.Cluster("cluster-1")
	require.NoError(t, c.EnsureNamespace(ctx, ns, nil))
	var leading atomic.Bool
	ctl, comp := start(t, eastwest.Config{Namespace: ns, CRDRecheck: 50 * time.Millisecond}, eastwest.Deps{Leading: leading.Load}, c, "")
	require.Eventually(t, comp.HasSynced, wait, poll, "a cluster without the Gateway API counts as synced")

	installGatewayAPI(t, c)
	cl := newClient(t, c)
	gw := gateway(ns, "follower", "net-a")
	require.NoError(t, cl.Create(ctx, gw))
	// The follower's reconciler has run once the class key was handled;
	// give it the same chance at the Gateway, then check nothing changed.
	ctl.Resync()
	require.Eventually(t, func() bool {
		var l gwv1.GatewayList
		return cl.List(ctx, &l) == nil && len(l.Items) == 1
	}, wait, poll)
	var gc gwv1.GatewayClass
	require.True(t, apierrors.IsNotFound(cl.Get(ctx, client.ObjectKey{Name: eastwest.ClassName}, &gc)), "a follower writes no GatewayClass")
	// (The CRD defaults status to Accepted=Unknown, Pending.)
	require.Equal(t, string(gwv1.GatewayReasonPending), accepted(ctx, cl, gw).Reason, "a follower writes no Gateway status")
	require.True(t, apierrors.IsNotFound(deployed(ctx, cl, gw)), "a follower deploys nothing")

	leading.Store(true)
	ctl.Resync()
	require.EventuallyWithT(t, func(co *assert.CollectT) {
		require.NoError(co, cl.Get(ctx, client.ObjectKey{Name: eastwest.ClassName}, &gc))
		require.NoError(co, deployed(ctx, cl, gw))
		cond := accepted(ctx, cl, gw)
		require.NotNil(co, cond)
		require.Equal(co, metav1.ConditionTrue, cond.Status)
	}, wait, poll, "the leader writes")

	// Level-based: what was deployed and is deleted by hand comes back.
	var d appsv1.Deployment
	require.NoError(t, cl.Get(ctx, client.ObjectKey{Namespace: ns, Name: eastwest.ObjectName(gw.Name)}, &d))
	require.NoError(t, cl.Delete(ctx, &d))
	require.Eventually(t, func() bool {
		var again appsv1.Deployment
		return cl.Get(ctx, client.ObjectKeyFromObject(&d), &again) == nil && again.UID != d.UID
	}, wait, poll, "the Deployment is recreated")
	require.NoError(t, cl.Delete(ctx, gw))
	require.Eventually(t, func() bool { return apierrors.IsNotFound(deployed(ctx, cl, gw)) }, wait, poll)
}

// TestGatewayWaitingForTheClass: a Gateway reconciled while the class
// belongs to another controller is not served; once that class is deleted
// and the leader writes its own, the waiting Gateway is deployed with no
// other event (the class's events reconcile its Gateways).
func TestGatewayWaitingForTheClass(t *testing.T) {
	ctx := t.Context()
	c := clusters.Cluster("cluster-1")
	require.NoError(t, c.EnsureNamespace(ctx, ns, nil))
	installGatewayAPI(t, c)
	cl := newClient(t, c)
	foreign := &gwv1.GatewayClass{ObjectMeta: metav1.ObjectMeta{Name: eastwest.ClassName},
		Spec: gwv1.GatewayClassSpec{ControllerName: "example.com/another-controller"}}
	require.Eventually(t, func() bool {
		err := cl.Delete(ctx, &gwv1.GatewayClass{ObjectMeta: metav1.ObjectMeta{Name: eastwest.ClassName}})
		return err == nil || apierrors.IsNotFound(err)
	}, wait, poll)
	require.Eventually(t, func() bool { return cl.Create(ctx, foreign.DeepCopy()) == nil }, wait, poll, "the foreign class is created once the old one is gone")

	_, comp := start(t, eastwest.Config{Namespace: ns, CRDRecheck: 50 * time.Millisecond}, eastwest.Deps{Leading: func() bool { return true }}, c, "")
	require.Eventually(t, comp.HasSynced, wait, poll)
	gw := gateway(ns, "waiting", "net-a")
	require.NoError(t, cl.Create(ctx, gw))
	var gc gwv1.GatewayClass
	require.NoError(t, cl.Get(ctx, client.ObjectKey{Name: eastwest.ClassName}, &gc))
	require.Equal(t, foreign.Spec.ControllerName, gc.Spec.ControllerName, "the other controller's class is left alone")

	require.NoError(t, cl.Delete(ctx, &gc))
	require.EventuallyWithT(t, func(co *assert.CollectT) {
		var ours gwv1.GatewayClass
		require.NoError(co, cl.Get(ctx, client.ObjectKey{Name: eastwest.ClassName}, &ours))
		require.Equal(co, eastwest.ControllerName, string(ours.Spec.ControllerName))
		require.NoError(co, deployed(ctx, cl, gw))
	}, wait, poll, "the leader writes its class and deploys the Gateway that waited for it")
	require.NoError(t, cl.Delete(ctx, gw))
	require.Eventually(t, func() bool { return apierrors.IsNotFound(deployed(ctx, cl, gw)) }, wait, poll)
}

// TestNamespaceSelectorAndRoots serves Gateways in namespaces chosen by
// GatewayNamespaceSelector: the roots and trust bundle are copied there
// (owned by the Gateway), and the gateway is an identity of its cluster's
// own trust domain; relabelling the namespace out of the selection refuses
// the Gateway and removes what was deployed and the copy.
func TestNamespaceSelectorAndRoots(t *testing.T) {
	ctx := t.Context()
	c := clusters.Cluster("cluster-2")
	installGatewayAPI(t, c)
	const gwNS = "edge"
	require.NoError(t, c.EnsureNamespace(ctx, ns, nil))
	require.NoError(t, c.EnsureNamespace(ctx, gwNS, map[string]string{"isthmus.io/gateways": "true"}))
	roots := []byte("-----BEGIN CERTIFICATE-----\nroots\n-----END CERTIFICATE-----\n")
	bundle := []byte(`{"trust_domains":{}}`)
	start(t, eastwest.Config{Namespace: ns, GatewayNamespaceSelector: labels.SelectorFromSet(labels.Set{"isthmus.io/gateways": "true"})},
		eastwest.Deps{Roots: func() []byte { return roots }, TrustBundle: func() []byte { return bundle }}, c, "edge.example")
	cl := newClient(t, c)
	gw := gateway(gwNS, "edge", "net-b")
	require.NoError(t, cl.Create(ctx, gw))
	root := client.ObjectKey{Namespace: gwNS, Name: "isthmus-ca-root-cert"}
	require.EventuallyWithT(t, func(co *assert.CollectT) {
		require.NoError(co, deployed(ctx, cl, gw))
		var cm corev1.ConfigMap
		require.NoError(co, cl.Get(ctx, root, &cm))
		require.Equal(co, string(roots), cm.Data["root-cert.pem"])
		require.Equal(co, string(bundle), cm.Data["trust-bundle.json"])
		require.Equal(co, "Gateway", cm.OwnerReferences[0].Kind)
	}, wait, poll, "served in a selected namespace, with the root bundle")
	var d appsv1.Deployment
	require.NoError(t, cl.Get(ctx, client.ObjectKey{Namespace: gwNS, Name: eastwest.ObjectName(gw.Name)}, &d))
	require.Contains(t, d.Spec.Template.Spec.Containers[0].Args, "--trust-domain=edge.example", "a gateway is an identity of its cluster's trust domain")

	var n corev1.Namespace
	require.NoError(t, cl.Get(ctx, client.ObjectKey{Name: gwNS}, &n))
	n.Labels["isthmus.io/gateways"] = "false"
	require.NoError(t, cl.Update(ctx, &n))
	require.EventuallyWithT(t, func(co *assert.CollectT) {
		cond := accepted(ctx, cl, gw)
		require.NotNil(co, cond)
		require.Equal(co, eastwest.ReasonUntrustedNamespace, cond.Reason)
		require.True(co, apierrors.IsNotFound(deployed(ctx, cl, gw)))
		for _, o := range []client.Object{&corev1.Service{}, &corev1.ServiceAccount{}} {
			require.True(co, apierrors.IsNotFound(cl.Get(ctx, client.ObjectKey{Namespace: gwNS, Name: eastwest.ObjectName(gw.Name)}, o)))
		}
		require.True(co, apierrors.IsNotFound(cl.Get(ctx, root, &corev1.ConfigMap{})))
	}, wait, poll, "refused once its namespace is no longer selected, and cleaned")
}
