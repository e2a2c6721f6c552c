package policy_test

import (
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"istio.io/api/security/v1beta1"
	typev1beta1 "istio.io/api/type/v1beta1"
	securityclient "istio.io/client-go/pkg/apis/security/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	securityv1 "github.com/isthmus-mesh/isthmus/pilot/api/security/v1"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/policy"
	"github.com/isthmus-mesh/isthmus/ztunnel/authz"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
)

const root = "istio-system"

// ap parses an AuthorizationPolicy written as Istio users write them.
func ap(t *testing.T, ns, name, spec string) *securityclient.AuthorizationPolicy {
	t.Helper()
	out := &securityclient.AuthorizationPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
	require.NoError(t, yaml.Unmarshal([]byte(spec), &out.Spec), spec)
	return out
}

var (
	api    = &model.Workload{Placement: &model.Placement{Cluster: "c1", Node: "n1", Namespace: "prod", ServiceAccount: "api"}, UID: "c1/prod/api-0", Labels: map[string]string{"app": "api"}}
	client = identity.Identity{TrustDomain: "cluster.local", Namespace: "front", ServiceAccount: "web"}
	conn   = authz.Conn{Workload: api.UID, Peer: client, SourceIP: netip.MustParseAddr("10.1.0.7"), DestinationIP: netip.MustParseAddr("10.0.0.5"), DestinationPort: 8080}
)

// decide converts the policies, sends the api workload's resources through
// the same path pilot serves them and ztunnel reads them, and checks c.
func decide(t *testing.T, c authz.Conn, aps ...*securityclient.AuthorizationPolicy) authz.Decision {
	t.Helper()
	var pols []*policy.Policy
	for _, a := range aps {
		pols = append(pols, policy.ConvertAuthorizationPolicy(root, a))
	}
	snap, err := policy.NewSnapshot(root, pols, nil)
	require.NoError(t, err)
	res, err := snap.NodeResources([]*model.Workload{api})
	require.NoError(t, err)
	var all []*securityv1.Authorization
	for _, b := range res {
		a := &securityv1.Authorization{}
		require.NoError(t, protoUnmarshal(b, a))
		all = append(all, a)
	}
	zs, err := authz.NewSnapshot(all)
	require.NoError(t, err)
	return zs.Evaluate(c)
}

// TestConvertedSemantics takes AuthorizationPolicies as users write them
// through conversion, distribution and ztunnel's check.
func TestConvertedSemantics(t *testing.T) {
	allowed := authz.Decision{Allowed: true}
	deniedBy := func(ns, name string) authz.Decision {
		return authz.Decision{Reason: authz.ReasonDenyPolicy, Namespace: ns, Name: name}
	}
	unmatched := authz.Decision{Reason: authz.ReasonAllowUnmatched}
	allowedBy := func(ns, name string) authz.Decision { return authz.Decision{Allowed: true, Namespace: ns, Name: name} }
	for _, tc := range []struct {
		name string
		aps  []*securityclient.AuthorizationPolicy
		conn authz.Conn
		want authz.Decision
	}{
		{"mesh-wide DENY by principal", []*securityclient.AuthorizationPolicy{ap(t, root, "deny-web", `
action: DENY
rules: [{from: [{source: {principals: ["cluster.local/ns/front/sa/web"]}}]}]`)}, conn, deniedBy(root, "deny-web")},
		{"principal in the spiffe:// form", []*securityclient.AuthorizationPolicy{ap(t, "prod", "allow-web", `
rules: [{from: [{source: {principals: ["spiffe://cluster.local/ns/front/sa/web"]}}]}]`)}, conn, allowedBy("prod", "allow-web")},
		{"principals of another cluster's trust domain do not match", []*securityclient.AuthorizationPolicy{ap(t, "prod", "allow-web", `
rules: [{from: [{source: {principals: ["other.domain/ns/front/sa/web"]}}]}]`)}, conn, unmatched},
		{"namespace-wide ALLOW of another namespace refuses", []*securityclient.AuthorizationPolicy{ap(t, "prod", "only-back", `
rules: [{from: [{source: {namespaces: ["back"]}}]}]`)}, conn, unmatched},
		{"another namespace's policy does not apply", []*securityclient.AuthorizationPolicy{ap(t, "dev", "nothing", `{}`)}, conn, allowed},
		{"empty spec allows nothing", []*securityclient.AuthorizationPolicy{ap(t, "prod", "allow-nothing", `{}`)}, conn, unmatched},
		{"one empty rule allows all", []*securityclient.AuthorizationPolicy{ap(t, "prod", "allow-all", `rules: [{}]`)}, conn, allowedBy("prod", "allow-all")},
		{"selector that matches", []*securityclient.AuthorizationPolicy{ap(t, "prod", "api-only-back", `
selector: {matchLabels: {app: api}}
rules: [{from: [{source: {namespaces: ["back"]}}]}]`)}, conn, unmatched},
		{"selector that does not match", []*securityclient.AuthorizationPolicy{ap(t, "prod", "db", `
selector: {matchLabels: {app: db}}
rules: [{from: [{source: {namespaces: ["back"]}}]}]`)}, conn, allowed},
		{"root-namespace selector selects in every namespace", []*securityclient.AuthorizationPolicy{ap(t, root, "apis", `
action: DENY
selector: {matchLabels: {app: api}}
rules: [{}]`)}, conn, deniedBy(root, "apis")},
		{"serviceAccounts", []*securityclient.AuthorizationPolicy{ap(t, "prod", "sa", `
rules: [{from: [{source: {serviceAccounts: ["front/web"]}}]}]`)}, conn, allowedBy("prod", "sa")},
		{"serviceAccounts of the policy's namespace", []*securityclient.AuthorizationPolicy{ap(t, "prod", "sa", `
rules: [{from: [{source: {serviceAccounts: ["web"]}}]}]`)}, conn, unmatched},
		{"ports and ipBlocks", []*securityclient.AuthorizationPolicy{ap(t, "prod", "p", `
rules: [{from: [{source: {ipBlocks: ["10.1.0.0/16"]}}], to: [{operation: {ports: ["8080"]}}]}]`)}, conn, allowedBy("prod", "p")},
		{"notPorts", []*securityclient.AuthorizationPolicy{ap(t, "prod", "p", `
action: DENY
rules: [{to: [{operation: {notPorts: ["9090"]}}]}]`)}, conn, deniedBy("prod", "p")},
		{"when keys", []*securityclient.AuthorizationPolicy{ap(t, "prod", "w", `
rules:
- when:
  - {key: source.ip, values: ["10.1.0.7"]}
  - {key: source.namespace, values: ["front"]}
  - {key: source.principal, values: ["*/sa/web"]}
  - {key: destination.port, values: ["8080"]}
  - {key: destination.ip, notValues: ["10.9.9.9"]}`)}, conn, allowedBy("prod", "w")},
		{"ALLOW with methods matches nothing", []*securityclient.AuthorizationPolicy{ap(t, "prod", "get-only", `
rules: [{from: [{source: {namespaces: ["front"]}}], to: [{operation: {methods: ["GET"]}}]}]`)}, conn, unmatched},
		{"ALLOW: the L7 rule is dropped, the L4 rule still allows", []*securityclient.AuthorizationPolicy{ap(t, "prod", "mixed", `
rules:
- to: [{operation: {paths: ["/admin"]}}]
- from: [{source: {namespaces: ["front"]}}]`)}, conn, allowedBy("prod", "mixed")},
		{"DENY with methods denies at L4", []*securityclient.AuthorizationPolicy{ap(t, "prod", "no-post", `
action: DENY
rules: [{from: [{source: {namespaces: ["front"]}}], to: [{operation: {methods: ["POST"]}}]}]`)}, conn, deniedBy("prod", "no-post")},
		{"DENY with an L7 when denies at L4", []*securityclient.AuthorizationPolicy{ap(t, "prod", "hdr", `
action: DENY
rules: [{when: [{key: "request.headers[x-user]", values: ["mallory"]}]}]`)}, conn, deniedBy("prod", "hdr")},
		{"DENY keeps its L4 conditions", []*securityclient.AuthorizationPolicy{ap(t, "prod", "no-back-post", `
action: DENY
rules: [{from: [{source: {namespaces: ["back"]}}], to: [{operation: {methods: ["POST"]}}]}]`)}, conn, allowed},
		{"DENY with requestPrincipals denies its L4 part", []*securityclient.AuthorizationPolicy{ap(t, "prod", "jwt", `
action: DENY
rules: [{from: [{source: {requestPrincipals: ["*"], namespaces: ["front"]}}]}]`)}, conn, deniedBy("prod", "jwt")},
		{"trustDomains in ALLOW matches nothing", []*securityclient.AuthorizationPolicy{ap(t, "prod", "td", `
rules: [{from: [{source: {trustDomains: ["cluster.local"]}}]}]`)}, conn, unmatched},
		{"serviceAccounts with namespaces in ALLOW matches nothing (Istio refuses it)", []*securityclient.AuthorizationPolicy{ap(t, "prod", "sa-ns", `
rules: [{from: [{source: {serviceAccounts: ["front/web"], namespaces: ["front"]}}]}]`)}, conn, unmatched},
		{"an empty source in ALLOW matches nothing (Istio refuses it)", []*securityclient.AuthorizationPolicy{ap(t, "prod", "empty-src", `
rules: [{from: [{source: {}}]}]`)}, conn, unmatched},
		{"an absent source in ALLOW matches nothing", []*securityclient.AuthorizationPolicy{ap(t, "prod", "no-src", `
rules: [{from: [{}]}]`)}, conn, unmatched},
		{"an empty operation in ALLOW matches nothing", []*securityclient.AuthorizationPolicy{ap(t, "prod", "empty-op", `
rules: [{to: [{operation: {}}]}]`)}, conn, unmatched},
		{"an empty source in DENY denies", []*securityclient.AuthorizationPolicy{ap(t, "prod", "deny-empty", `
action: DENY
rules: [{from: [{source: {}}]}]`)}, conn, deniedBy("prod", "deny-empty")},
		{"empty selector is namespace-wide", []*securityclient.AuthorizationPolicy{ap(t, "prod", "ns", `
action: DENY
selector: {}
rules: [{}]`)}, conn, deniedBy("prod", "ns")},
		{"root-namespace empty selector is mesh-wide", []*securityclient.AuthorizationPolicy{ap(t, root, "mesh", `
action: DENY
selector: {matchLabels: {}}
rules: [{}]`)}, conn, deniedBy(root, "mesh")},
		{"an invalid port in ALLOW matches nothing", []*securityclient.AuthorizationPolicy{ap(t, "prod", "bad", `
rules: [{to: [{operation: {ports: ["http"]}}]}]`)}, conn, unmatched},
		{"CUSTOM is not enforced", []*securityclient.AuthorizationPolicy{ap(t, "prod", "ext", `
action: CUSTOM
provider: {name: ext-authz}
rules: [{}]`)}, conn, allowed},
		{"AUDIT is not enforced", []*securityclient.AuthorizationPolicy{ap(t, "prod", "audit", `
action: AUDIT
rules: [{}]`)}, conn, allowed},
		{"targetRefs are not ztunnel's", []*securityclient.AuthorizationPolicy{ap(t, "prod", "waypoint", `
targetRefs: [{kind: Gateway, group: gateway.networking.k8s.io, name: waypoint}]`)}, conn, allowed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, decide(t, tc.conn, tc.aps...))
		})
	}
}

// TestProblemsReported lists what each unenforceable part becomes.
func TestProblemsReported(t *testing.T) {
	p := policy.ConvertAuthorizationPolicy(root, ap(t, "prod", "mixed", `
rules:
- from: [{source: {requestPrincipals: ["*"], remoteIpBlocks: ["1.2.3.4"]}}]
  to: [{operation: {methods: ["GET"], hosts: ["x"], ports: ["80"]}}]
  when: [{key: "request.auth.claims[iss]", values: ["x"]}, {key: source.ip, values: ["not-an-ip"]}]`))
	require.NotNil(t, p.Proto)
	require.Empty(t, p.Proto.GetRules(), "the ALLOW rule is dropped")
	var got [][2]string
	for _, pr := range p.Problems {
		got = append(got, [2]string{pr.GetReason(), pr.GetField()})
		require.Contains(t, pr.GetEffect(), "matches nothing")
	}
	require.Equal(t, [][2]string{
		{policy.ReasonUnsupportedAttribute, "rules[0].from[0].source.remoteIpBlocks"},
		{policy.ReasonUnsupportedAttribute, "rules[0].from[0].source.requestPrincipals"},
		{policy.ReasonUnsupportedAttribute, "rules[0].to[0].operation.hosts"},
		{policy.ReasonUnsupportedAttribute, "rules[0].to[0].operation.methods"},
		{policy.ReasonUnsupportedAttribute, "rules[0].when[0] (request.auth.claims[iss])"},
		{policy.ReasonInvalidValue, "rules[0].when[1] (source.ip)"},
	}, got)

	for action, reason := range map[string]string{"CUSTOM": policy.ReasonUnsupportedAction, "AUDIT": policy.ReasonUnsupportedAction} {
		p := policy.ConvertAuthorizationPolicy(root, ap(t, "prod", "x", "action: "+action))
		require.Nil(t, p.Proto)
		require.Equal(t, reason, p.Problems[0].GetReason())
	}
	p = policy.ConvertAuthorizationPolicy(root, ap(t, "prod", "x", `targetRef: {kind: Service, group: "", name: s}`))
	require.Nil(t, p.Proto)
	require.Equal(t, policy.ReasonTargetRef, p.Problems[0].GetReason())

	snap, err := policy.NewSnapshot(root, []*policy.Policy{
		policy.ConvertAuthorizationPolicy(root, ap(t, "prod", "a", "action: CUSTOM")),
		policy.ConvertAuthorizationPolicy(root, ap(t, "prod", "b", "action: AUDIT")),
		policy.ConvertAuthorizationPolicy(root, ap(t, "prod", "c", `rules: [{to: [{operation: {methods: ["GET"], paths: ["/"]}}]}]`)),
	}, nil)
	require.NoError(t, err)
	require.Equal(t, map[[2]string]int{
		{policy.KindAuthorizationPolicy, policy.ReasonUnsupportedAction}:    2,
		{policy.KindAuthorizationPolicy, policy.ReasonUnsupportedAttribute}: 1,
	}, snap.ProblemCounts())
}

func pa(ns, name string, age time.Duration, selector map[string]string, mode v1beta1.PeerAuthentication_MutualTLS_Mode, ports map[uint32]v1beta1.PeerAuthentication_MutualTLS_Mode) *securityclient.PeerAuthentication {
	out := &securityclient.PeerAuthentication{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, CreationTimestamp: metav1.NewTime(time.Unix(1e9, 0).Add(-age))}}
	out.Spec.Mtls = &v1beta1.PeerAuthentication_MutualTLS{Mode: mode}
	if selector != nil {
		out.Spec.Selector = &typev1beta1.WorkloadSelector{MatchLabels: selector}
	}
	for p, m := range ports {
		if out.Spec.PortLevelMtls == nil {
			out.Spec.PortLevelMtls = map[uint32]*v1beta1.PeerAuthentication_MutualTLS{}
		}
		out.Spec.PortLevelMtls[p] = &v1beta1.PeerAuthentication_MutualTLS{Mode: m}
	}
	return out
}

// TestPeerAuthenticationPrecedence: STRICT by default; workload over
// namespace over mesh, UNSET inheriting; the oldest of a level wins; port
// modes only from a workload-level policy.
func TestPeerAuthenticationPrecedence(t *testing.T) {
	const (
		unset      = v1beta1.PeerAuthentication_MutualTLS_UNSET
		strict     = v1beta1.PeerAuthentication_MutualTLS_STRICT
		permissive = v1beta1.PeerAuthentication_MutualTLS_PERMISSIVE
		disable    = v1beta1.PeerAuthentication_MutualTLS_DISABLE
	)
	app := map[string]string{"app": "api"}
	for _, tc := range []struct {
		name string
		pas  []*securityclient.PeerAuthentication
		want *securityv1.PeerAuthentication
	}{
		{"default STRICT", nil, &securityv1.PeerAuthentication{}},
		{"mesh PERMISSIVE", []*securityclient.PeerAuthentication{pa(root, "mesh", 0, nil, permissive, nil)},
			&securityv1.PeerAuthentication{Mode: securityv1.MTLSMode_PERMISSIVE, Sources: []string{root + "/mesh"}}},
		{"namespace over mesh", []*securityclient.PeerAuthentication{pa(root, "mesh", 0, nil, permissive, nil), pa("prod", "ns", 0, nil, strict, nil)},
			&securityv1.PeerAuthentication{Mode: securityv1.MTLSMode_STRICT, Sources: []string{root + "/mesh", "prod/ns"}}},
		{"UNSET namespace inherits", []*securityclient.PeerAuthentication{pa(root, "mesh", 0, nil, disable, nil), pa("prod", "ns", 0, nil, unset, nil)},
			&securityv1.PeerAuthentication{Mode: securityv1.MTLSMode_DISABLE, Sources: []string{root + "/mesh", "prod/ns"}}},
		{"oldest namespace policy wins", []*securityclient.PeerAuthentication{pa("prod", "young", time.Hour, nil, strict, nil), pa("prod", "old", 2*time.Hour, nil, permissive, nil)},
			&securityv1.PeerAuthentication{Mode: securityv1.MTLSMode_PERMISSIVE, Sources: []string{"prod/old"}}},
		{"workload ports", []*securityclient.PeerAuthentication{pa("prod", "ns", 0, nil, permissive, nil), pa("prod", "api", 0, app, unset, map[uint32]v1beta1.PeerAuthentication_MutualTLS_Mode{8080: strict, 9090: unset})},
			&securityv1.PeerAuthentication{Mode: securityv1.MTLSMode_PERMISSIVE, Ports: map[uint32]securityv1.MTLSMode{8080: securityv1.MTLSMode_STRICT}, Sources: []string{"prod/ns", "prod/api"}}},
		{"selector of another workload", []*securityclient.PeerAuthentication{pa("prod", "db", 0, map[string]string{"app": "db"}, permissive, nil)},
			&securityv1.PeerAuthentication{}},
		{"port levels without selector are ignored", []*securityclient.PeerAuthentication{pa("prod", "ns", 0, nil, permissive, map[uint32]v1beta1.PeerAuthentication_MutualTLS_Mode{8080: strict})},
			&securityv1.PeerAuthentication{Mode: securityv1.MTLSMode_PERMISSIVE, Sources: []string{"prod/ns"}}},
		// Istio: a root-namespace policy with a selector is no level at all.
		{"root-namespace selector is not mesh-wide", []*securityclient.PeerAuthentication{pa(root, "legacy", time.Hour, map[string]string{"app": "legacy"}, permissive, nil), pa(root, "default", 0, nil, strict, nil)},
			&securityv1.PeerAuthentication{Mode: securityv1.MTLSMode_STRICT, Sources: []string{root + "/default"}}},
		{"root-namespace selector alone leaves the default", []*securityclient.PeerAuthentication{pa(root, "legacy", 0, map[string]string{"app": "legacy"}, disable, nil)},
			&securityv1.PeerAuthentication{}},
		{"root-namespace selector matching the workload does not apply either", []*securityclient.PeerAuthentication{pa(root, "apis", 0, app, permissive, map[uint32]v1beta1.PeerAuthentication_MutualTLS_Mode{8080: disable})},
			&securityv1.PeerAuthentication{}},
		{"root-namespace empty selector is mesh-wide", []*securityclient.PeerAuthentication{pa(root, "mesh", 0, map[string]string{}, permissive, nil)},
			&securityv1.PeerAuthentication{Mode: securityv1.MTLSMode_PERMISSIVE, Sources: []string{root + "/mesh"}}},
		{"namespace empty selector is namespace-wide", []*securityclient.PeerAuthentication{pa(root, "mesh", 0, nil, permissive, nil), pa("prod", "ns", 0, map[string]string{}, strict, nil)},
			&securityv1.PeerAuthentication{Mode: securityv1.MTLSMode_STRICT, Sources: []string{root + "/mesh", "prod/ns"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var pas []*policy.PeerAuth
			for _, p := range tc.pas {
				pas = append(pas, policy.ConvertPeerAuthentication(root, p))
			}
			snap, err := policy.NewSnapshot(root, nil, pas)
			require.NoError(t, err)
			require.Equal(t, protoText(tc.want), protoText(snap.PeerAuthentication("prod", app)))
		})
	}
	p := policy.ConvertPeerAuthentication(root, pa("prod", "ns", 0, nil, strict, map[uint32]v1beta1.PeerAuthentication_MutualTLS_Mode{8080: permissive}))
	require.Equal(t, policy.ReasonIgnoredField, p.Problems[0].GetReason())
}

// TestRootNamespaceSelectorPeerAuthentication: an operator exempts a legacy
// app from mTLS with a PERMISSIVE PeerAuthentication in the root namespace
// whose selector is {app: legacy}, next to a STRICT mesh default. Istio
// applies it to no workload (not mesh-wide, not to the workloads it
// selects, in any namespace, the root one included), and so does Isthmus:
// plaintext to every workload, legacy or not, in prod or in the root
// namespace, is refused by ztunnel's check. The policy is listed as
// ignored, with the reason.
func TestRootNamespaceSelectorPeerAuthentication(t *testing.T) {
	legacy := pa(root, "legacy", time.Hour, map[string]string{"app": "legacy"}, v1beta1.PeerAuthentication_MutualTLS_PERMISSIVE, nil)
	def := pa(root, "default", 0, nil, v1beta1.PeerAuthentication_MutualTLS_STRICT, nil)
	converted := policy.ConvertPeerAuthentication(root, legacy)
	require.True(t, converted.Ignored)
	require.Equal(t, map[string]string{"app": "legacy"}, converted.Selector)
	require.Len(t, converted.Problems, 1)
	require.Equal(t, policy.ReasonIgnoredField, converted.Problems[0].GetReason())
	require.Equal(t, "spec.selector", converted.Problems[0].GetField())
	require.Contains(t, converted.Problems[0].GetEffect(), "applies to no workload")
	snap, err := policy.NewSnapshot(root, nil, []*policy.PeerAuth{converted, policy.ConvertPeerAuthentication(root, def)})
	require.NoError(t, err)
	require.Len(t, snap.PeerAuths(), 2, "both are listed")

	var locals []*model.Workload
	for _, ns := range []string{"prod", root} {
		for _, app := range []string{"legacy", "api"} {
			locals = append(locals, &model.Workload{Placement: &model.Placement{Cluster: "c1", Node: "n1", Namespace: ns, ServiceAccount: app},
				UID: "c1/" + ns + "/" + app, Labels: map[string]string{"app": app}})
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
	for _, w := range locals {
		t.Run(w.UID, func(t *testing.T) {
			got := snap.PeerAuthentication(w.Namespace, w.Labels)
			require.Equal(t, securityv1.MTLSMode_STRICT, got.GetMode())
			require.Equal(t, []string{root + "/default"}, got.GetSources())
			d := zs.Evaluate(authz.Conn{Workload: w.UID, Plaintext: true, SourceIP: netip.MustParseAddr("10.9.0.1"), DestinationPort: 8080})
			require.Equal(t, authz.Decision{Reason: authz.ReasonMTLSRequired, Namespace: root, Name: "default"}, d)
		})
	}
}

// TestTrustDomainAliases: Istio's meshConfig trustDomainAliases, through
// conversion, distribution and ztunnel's check. The mesh is
// network-1.example with alias network-2.example: a principal written with
// either (or with cluster.local, Istio's name for the local domain) matches
// the same namespace and ServiceAccount in both; an identity of a domain
// that is no alias, or a principal naming such a domain, matches only as
// written; "*" prefixes are left alone.
func TestTrustDomainAliases(t *testing.T) {
	tds := policy.TrustDomains{Local: "network-1.example", Aliases: []string{"network-2.example"}}
	decideIn := func(t *testing.T, tds policy.TrustDomains, peer identity.Identity, spec string) authz.Decision {
		t.Helper()
		p := policy.ConvertAuthorizationPolicyIn(root, tds, ap(t, "prod", "allow", spec))
		snap, err := policy.NewSnapshot(root, []*policy.Policy{p}, nil)
		require.NoError(t, err)
		res, err := snap.NodeResources([]*model.Workload{api})
		require.NoError(t, err)
		var all []*securityv1.Authorization
		for _, b := range res {
			a := &securityv1.Authorization{}
			require.NoError(t, protoUnmarshal(b, a))
			all = append(all, a)
		}
		zs, err := authz.NewSnapshot(all)
		require.NoError(t, err)
		c := conn
		c.Peer = peer
		return zs.Evaluate(c)
	}
	web := func(td string) identity.Identity {
		return identity.Identity{TrustDomain: td, Namespace: "front", ServiceAccount: "web"}
	}
	allowed := authz.Decision{Allowed: true, Namespace: "prod", Name: "allow"}
	unmatched := authz.Decision{Reason: authz.ReasonAllowUnmatched}
	for _, tc := range []struct {
		name      string
		principal string
		peer      identity.Identity
		want      authz.Decision
	}{
		{"local principal, alias peer", "network-1.example/ns/front/sa/web", web("network-2.example"), allowed},
		{"local principal, local peer", "network-1.example/ns/front/sa/web", web("network-1.example"), allowed},
		{"alias principal, local peer", "spiffe://network-2.example/ns/front/sa/web", web("network-1.example"), allowed},
		{"cluster.local principal, alias peer", "cluster.local/ns/front/sa/web", web("network-2.example"), allowed},
		{"local principal, peer of a domain that is no alias", "network-1.example/ns/front/sa/web", web("network-3.example"), unmatched},
		{"local principal, alias peer of another account", "network-1.example/ns/front/sa/web",
			identity.Identity{TrustDomain: "network-2.example", Namespace: "front", ServiceAccount: "other"}, unmatched},
		{"principal of a domain that is no alias matches only itself", "network-3.example/ns/front/sa/web", web("network-3.example"), allowed},
		{"principal of a domain that is no alias, alias peer", "network-3.example/ns/front/sa/web", web("network-2.example"), unmatched},
		{"prefix pattern of the local domain", "network-1.example/ns/front/*", web("network-2.example"), allowed},
		{"suffix pattern is left alone", "*/ns/front/sa/web", web("network-3.example"), allowed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			spec := `rules: [{from: [{source: {principals: ["` + tc.principal + `"]}}]}]`
			require.Equal(t, tc.want, decideIn(t, tds, tc.peer, spec))
		})
	}
	t.Run("without aliases, an alias peer is refused", func(t *testing.T) {
		spec := `rules: [{from: [{source: {principals: ["network-1.example/ns/front/sa/web"]}}]}]`
		require.Equal(t, unmatched, decideIn(t, policy.TrustDomains{Local: "network-1.example"}, web("network-2.example"), spec))
	})
	t.Run("notPrincipals expand too", func(t *testing.T) {
		spec := "action: DENY\nrules: [{from: [{source: {notPrincipals: [\"network-1.example/ns/front/sa/web\"]}}]}]"
		require.Equal(t, authz.Decision{Allowed: true}, decideIn(t, tds, web("network-2.example"), spec), "not denied: the alias peer is the excluded principal")
	})
}

// TestFederatedPeerNamespaces pins a known behaviour, Istio's: the
// namespace and service-account fields of a source (namespaces,
// serviceAccounts, when source.namespace) name a namespace and account of
// ANY trust domain the mesh accepts peers from. Istio's ztunnel matches
// them on the peer identity's namespace and account with the trust domain
// ignored (src/rbac.rs: ServiceAccountMatch, namespaces), and its sidecars
// match namespaces as ".*/ns/<ns>/.*" on the principal. So a workload of a
// federated trust domain running as front/web passes an ALLOW written for
// front or front/web, exactly as the local front/web does; nothing else
// does: not another account or namespace of that domain, not plaintext.
// Only principals name a trust domain, so they are how a policy admits the
// local domain alone.
func TestFederatedPeerNamespaces(t *testing.T) {
	id := func(td, ns, sa string) identity.Identity {
		return identity.Identity{TrustDomain: td, Namespace: ns, ServiceAccount: sa}
	}
	const local, federated = "cluster.local", "partner.example"
	allowed := authz.Decision{Allowed: true, Namespace: "prod", Name: "allow"}
	unmatched := authz.Decision{Reason: authz.ReasonAllowUnmatched}
	for _, tc := range []struct {
		name, spec string
		peer       identity.Identity
		want       authz.Decision
	}{
		{"namespaces: local peer", `rules: [{from: [{source: {namespaces: ["front"]}}]}]`, id(local, "front", "web"), allowed},
		{"namespaces: federated peer of that namespace", `rules: [{from: [{source: {namespaces: ["front"]}}]}]`, id(federated, "front", "other"), allowed},
		{"namespaces: federated peer of another namespace", `rules: [{from: [{source: {namespaces: ["front"]}}]}]`, id(federated, "back", "web"), unmatched},
		{"namespaces: no peer identity", `rules: [{from: [{source: {namespaces: ["front"]}}]}]`, identity.Identity{}, unmatched},
		{"when source.namespace: federated peer", `rules: [{when: [{key: source.namespace, values: ["front"]}]}]`, id(federated, "front", "web"), allowed},
		{"serviceAccounts: federated peer of that account", `rules: [{from: [{source: {serviceAccounts: ["front/web"]}}]}]`, id(federated, "front", "web"), allowed},
		{"serviceAccounts: federated peer of another account", `rules: [{from: [{source: {serviceAccounts: ["front/web"]}}]}]`, id(federated, "front", "other"), unmatched},
		{"serviceAccounts: federated peer of another namespace", `rules: [{from: [{source: {serviceAccounts: ["front/web"]}}]}]`, id(federated, "back", "web"), unmatched},
		{"serviceAccounts: an account whose name ends like it", `rules: [{from: [{source: {serviceAccounts: ["front/web"]}}]}]`, id(federated, "front", "myweb"), unmatched},
		{"principals of the local domain: federated peer refused", `rules: [{from: [{source: {principals: ["cluster.local/ns/front/sa/web"]}}]}]`, id(federated, "front", "web"), unmatched},
		{"principals of the local domain: local peer", `rules: [{from: [{source: {principals: ["cluster.local/ns/front/sa/web"]}}]}]`, id(local, "front", "web"), allowed},
		{"principals of the local domain's namespace: federated peer refused", `rules: [{from: [{source: {principals: ["cluster.local/ns/front/*"]}}]}]`, id(federated, "front", "web"), unmatched},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := conn
			c.Peer = tc.peer // zero: no identity, as a plaintext connection has
			require.Equal(t, tc.want, decide(t, c, ap(t, "prod", "allow", tc.spec)))
		})
	}
}
