package server_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/controller"
	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// TestServiceScopeInXDS runs a LOCAL-default pilot (Istio's default) with
// two serviceScopeConfigs rules and watches workload xDS as a ztunnel of
// the remote cluster and one of the primary. Services of the primary are
// seen by the remote's ztunnel only when global: by the istio.io/global
// label of the Service (which wins over its namespace's) or of its
// namespace, or by a GLOBAL rule selecting the namespace or the service.
// Relabelling a namespace global makes its services visible to the remote
// without restarting anything; relabelling it back hides them again.
func TestServiceScopeInXDS(t *testing.T) {
	ctx := context.Background()
	const cp = "scope-system"
	primary := clusters.Cluster("primary")
	require.NoError(t, primary.EnsureNamespace(ctx, cp, nil))
	for ns, l := range map[string]map[string]string{
		"scope-plain":  nil,
		"scope-global": {controller.GlobalLabel: "true"},
		"scope-team":   {"team": "shared"},
	} {
		require.NoError(t, primary.EnsureNamespace(ctx, ns, l))
	}
	svc := func(ns, name string, labels map[string]string) {
		t.Helper()
		s, err := primary.CreateService(ctx, ns, name, map[string]string{"app": name}, framework.ServicePort{Name: "http", Port: 80, TargetPort: 8080})
		require.NoError(t, err)
		if labels != nil {
			s.Labels = labels
			_, err = primary.Client.CoreV1().Services(ns).Update(ctx, s, metav1.UpdateOptions{})
			require.NoError(t, err)
		}
	}
	svc("scope-plain", "unlabelled", nil)                                               // default: local
	svc("scope-plain", "opted-out", map[string]string{controller.GlobalLabel: "false"}) // local, and stays so when the namespace turns global
	svc("scope-plain", "picked", map[string]string{"expose": "mesh"})                   // a GLOBAL rule selects it
	svc("scope-global", "inherits", nil)                                                // its namespace is global
	svc("scope-global", "overrides", map[string]string{controller.GlobalLabel: "false"})
	svc("scope-team", "team-svc", nil)                                     // a GLOBAL rule selects its namespace
	svc("scope-team", "team-private", map[string]string{"private": "yes"}) // a LOCAL rule too: GLOBAL wins

	p := runPilot(t, server.Config{
		ClusterID: "primary", Namespace: cp, Network: "network-1", NoLeaderElection: true,
		DebugAddr: defaults.Disabled, MonitoringAddr: defaults.Disabled, GRPCAddr: defaults.Disabled, XDSPlaintextAddr: "127.0.0.1:0",
		Discovery: controller.Config{ServiceScope: controller.ServiceScope{Default: controller.ScopeLocal, Rules: []controller.ServiceScopeRule{
			{NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"team": "shared"}}, Scope: controller.ScopeGlobal},
			{ServicesSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"expose": "mesh"}}, Scope: controller.ScopeGlobal},
			{ServicesSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"private": "yes"}}, Scope: controller.ScopeLocal},
		}}},
	})
	require.Eventually(t, func() bool { return p.XDSPlaintextAddr() != "" }, 20*time.Second, 10*time.Millisecond)
	watchCtx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	remote := watchXDS(t, watchCtx, p.XDSPlaintextAddr(), "ztunnel~node-2.scope-system", "remote", "network-1")
	local := watchXDS(t, watchCtx, p.XDSPlaintextAddr(), "ztunnel~node-1.scope-system", "primary", "network-1")

	all := []string{"unlabelled.scope-plain", "opted-out.scope-plain", "picked.scope-plain", "inherits.scope-global",
		"overrides.scope-global", "team-svc.scope-team", "team-private.scope-team"}
	expectSeen := func(msg string, want ...string) {
		t.Helper()
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			// The primary's ztunnel sees every one of its cluster's services,
			// local or not: the remote's view below is then complete too.
			require.ElementsMatch(c, all, seenServices(local.Load(), all), "primary's ztunnel")
			require.ElementsMatch(c, want, seenServices(remote.Load(), all), "remote's ztunnel: %s", msg)
		}, 30*time.Second, 20*time.Millisecond)
	}
	expectSeen("global by label, namespace label or rule",
		"picked.scope-plain", "inherits.scope-global", "team-svc.scope-team", "team-private.scope-team")

	relabel := func(ns string, l map[string]string) {
		t.Helper()
		obj, err := primary.Client.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{})
		require.NoError(t, err)
		obj.Labels = l
		_, err = primary.Client.CoreV1().Namespaces().Update(ctx, obj, metav1.UpdateOptions{})
		require.NoError(t, err)
	}
	relabel("scope-plain", map[string]string{controller.GlobalLabel: "true"})
	expectSeen("scope-plain labelled global: its services but the one labelled false",
		"unlabelled.scope-plain", "picked.scope-plain", "inherits.scope-global", "team-svc.scope-team", "team-private.scope-team")

	relabel("scope-team", map[string]string{"team": "other"})
	relabel("scope-plain", map[string]string{controller.GlobalLabel: "false"})
	expectSeen("scope-team out of the rule, scope-plain labelled local (over the rule that picks a service)",
		"inherits.scope-global")
}

// seenServices returns which of names (<name>.<ns>) snapshot holds.
func seenServices(snap *state.Snapshot, names []string) []string {
	var out []string
	for _, n := range names {
		if _, ok := snap.ServiceByHostname(n + ".svc.cluster.local"); ok {
			out = append(out, n)
		}
	}
	return out
}
