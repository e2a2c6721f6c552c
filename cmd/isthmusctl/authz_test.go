package main

import (
	"context"
	"encoding/json"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"istio.io/api/security/v1beta1"
	typev1beta1 "istio.io/api/type/v1beta1"
	securityclient "istio.io/client-go/pkg/apis/security/v1"
	"istio.io/client-go/pkg/clientset/versioned"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/policy"
	"github.com/isthmus-mesh/isthmus/ztunnel/authz"
)

// TestAuthzCheck runs `authz check` against pilot's /debug/authz served by
// a real policy watcher on a real API server: it lists the policies that
// select the workload (and why not as written), and explains decisions for
// a source principal and for plaintext.
func TestAuthzCheck(t *testing.T) {
	ctx := context.Background()
	c := clusters.Cluster("primary")
	require.NoError(t, c.InstallCRDs("../../manifests/base/crds"))
	require.NoError(t, c.EnsureNamespace(ctx, "shop", nil))
	client, err := versioned.NewForConfig(c.Config)
	require.NoError(t, err)
	create := func(name string, spec *v1beta1.AuthorizationPolicy) {
		ap := &securityclient.AuthorizationPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: name}}
		ap.Spec.Action, ap.Spec.Rules, ap.Spec.Selector = spec.Action, spec.Rules, spec.Selector
		_, err := client.SecurityV1().AuthorizationPolicies("shop").Create(ctx, ap, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	create("no-post", &v1beta1.AuthorizationPolicy{Action: v1beta1.AuthorizationPolicy_DENY, Rules: []*v1beta1.Rule{{
		From: []*v1beta1.Rule_From{{Source: &v1beta1.Source{Namespaces: []string{"guests"}}}},
		To:   []*v1beta1.Rule_To{{Operation: &v1beta1.Operation{Methods: []string{"POST"}}}},
	}}})
	create("cart-from-front", &v1beta1.AuthorizationPolicy{Selector: &typev1beta1.WorkloadSelector{MatchLabels: map[string]string{"app": "cart"}},
		Rules: []*v1beta1.Rule{{From: []*v1beta1.Rule_From{{Source: &v1beta1.Source{Principals: []string{"cluster.local/ns/front/sa/web"}}}}}}})

	w, err := policy.New(policy.Config{RootNamespace: "isthmus-system"}, policy.Deps{Client: client})
	require.NoError(t, err)
	wctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- w.Run(wctx) }()
	require.Eventually(t, func() bool { return w.HasSynced() && len(w.Snapshot().Policies()) == 2 }, 30*time.Second, 10*time.Millisecond)
	// The watcher stops (keeping its snapshot) before isthmusctl runs in
	// this process: the command sets klog's global logger, which the
	// watcher's reflectors read.
	cancel()
	require.NoError(t, <-done)

	cart := &model.Workload{UID: "remote/shop/cart-0", Name: "cart-0", Labels: map[string]string{"app": "cart"},
		Addresses: []netip.Addr{netip.MustParseAddr("10.2.0.9")},
		Placement: &model.Placement{Cluster: "remote", Node: "node-r", Namespace: "shop", ServiceAccount: "cart"}}
	srv := httptest.NewServer(w.DebugHandler(func(uid string) *model.Workload {
		if uid == cart.UID {
			return cart
		}
		return nil
	}))
	defer srv.Close()

	out, _, err := runCtl(t, "--pilot", srv.URL, "authz", "check", "--workload", cart.UID)
	require.NoError(t, err)
	require.Contains(t, out, "Workload:            remote/shop/cart-0 (namespace shop, cluster remote, node node-r)")
	require.Contains(t, out, "PeerAuthentication:  STRICT (default)")
	head, rows := parseTable(t, out[strings.Index(out, "POLICY"):])
	require.Equal(t, []string{"POLICY", "ACTION", "SCOPE", "SELECTOR", "NOT ENFORCED AS WRITTEN"}, head)
	require.Equal(t, []string{"shop/no-post", "DENY", "NAMESPACE", "-", "rules[0].to[0].operation.methods (unsupported_attribute)"}, rows[0])
	require.Equal(t, []string{"shop/cart-from-front", "ALLOW", "SELECTOR", "app=cart", "-"}, rows[1])

	out, _, err = runCtl(t, "--pilot", srv.URL, "authz", "check", "--workload", cart.UID, "--source", "cluster.local/ns/front/sa/web", "--port", "8080")
	require.NoError(t, err)
	require.Contains(t, out, "Decision:            ALLOWED by shop/cart-from-front")
	out, _, err = runCtl(t, "--pilot", srv.URL, "authz", "check", "--workload", cart.UID, "--source", "spiffe://cluster.local/ns/guests/sa/x", "--port", "8080")
	require.NoError(t, err)
	require.Contains(t, out, "Decision:            DENIED by shop/no-post (deny_policy)")
	out, _, err = runCtl(t, "--pilot", srv.URL, "authz", "check", "--workload", cart.UID, "--source", "other.domain/ns/front/sa/web", "--port", "8080", "-o", "json")
	require.NoError(t, err)
	var res authzCheckResult
	require.NoError(t, json.Unmarshal([]byte(out), &res))
	require.Equal(t, authz.Decision{Reason: authz.ReasonAllowUnmatched}, res.Explanation.Decision)
	require.Equal(t, "10.2.0.9", res.Connection.Address)
	out, _, err = runCtl(t, "--pilot", srv.URL, "authz", "check", "--workload", cart.UID, "--plaintext", "--port", "8080")
	require.NoError(t, err)
	require.Contains(t, out, "Decision:            DENIED: mutual TLS required, STRICT by default (mtls_required)")

	for _, args := range [][]string{
		{"--workload", "remote/shop/none"},
		{},
		{"--workload", cart.UID, "--source", "not-a-principal", "--port", "1"},
		{"--workload", cart.UID, "--source", "cluster.local/ns/a/sa/b"},
		{"--workload", cart.UID, "--plaintext", "--source", "cluster.local/ns/a/sa/b", "--port", "1"},
		{"--workload", cart.UID, "--port", "1"},
	} {
		_, _, err := runCtl(t, append([]string{"--pilot", srv.URL, "authz", "check"}, args...)...)
		require.Error(t, err, "%v", args)
	}
}
