package xds

import (
	"bytes"
	"fmt"
	"slices"
	"strings"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"
	"istio.io/istio/pkg/workloadapi/security"

	securityv1 "github.com/isthmus-mesh/isthmus/pilot/api/security/v1"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/policy"
)

// IstioAuthorizationType is the type URL of Istio's authorization
// resources, served per node as AuthorizationType is (authzServer), each
// encoded from the node's Isthmus resources: the same policies, no
// bindings (Istio's workloads name their selector policies themselves, in
// authorization_policies), and Istio's static STRICT policy when a local
// workload's PeerAuthentication refuses plaintext.
const IstioAuthorizationType = "type.googleapis.com/istio.security.Authorization"

// istioPolicyName is the Istio resource name of policy ns/name.
func istioPolicyName(ns, name string) string { return ns + "/" + name }

// istioAuthorization translates a converted policy. The two forms nest
// alike: a policy matches when one of its groups (Isthmus rules) does, a
// group when all its rules (clauses) do, a rule when one of its matches
// does, and a match when every field set holds. Principals are written
// alike ("<trust domain>/ns/<ns>/sa/<sa>").
func istioAuthorization(p *securityv1.Policy) *security.Authorization {
	out := &security.Authorization{Name: p.GetName(), Namespace: p.GetNamespace(), Action: security.Action_ALLOW}
	switch p.GetScope() {
	case securityv1.Scope_MESH:
		out.Scope = security.Scope_GLOBAL
	case securityv1.Scope_NAMESPACE:
		out.Scope = security.Scope_NAMESPACE
	default:
		out.Scope = security.Scope_WORKLOAD_SELECTOR
	}
	if p.GetAction() == securityv1.Action_DENY {
		out.Action = security.Action_DENY
	}
	for _, r := range p.GetRules() {
		g := &security.Group{}
		for _, c := range r.GetClauses() {
			rs := &security.Rules{}
			for _, m := range c.GetMatches() {
				rs.Matches = append(rs.Matches, istioMatch(m))
			}
			g.Rules = append(g.Rules, rs)
		}
		out.Groups = append(out.Groups, g)
	}
	return out
}

func istioMatch(m *securityv1.Match) *security.Match {
	return &security.Match{
		Principals:          istioStrings(m.GetPrincipals()),
		NotPrincipals:       istioStrings(m.GetNotPrincipals()),
		Namespaces:          istioStrings(m.GetNamespaces()),
		NotNamespaces:       istioStrings(m.GetNotNamespaces()),
		SourceIps:           istioCIDRs(m.GetSourceIps()),
		NotSourceIps:        istioCIDRs(m.GetNotSourceIps()),
		DestinationIps:      istioCIDRs(m.GetDestinationIps()),
		NotDestinationIps:   istioCIDRs(m.GetNotDestinationIps()),
		DestinationPorts:    m.GetDestinationPorts(),
		NotDestinationPorts: m.GetNotDestinationPorts(),
	}
}

func istioStrings(in []*securityv1.StringMatch) []*security.StringMatch {
	var out []*security.StringMatch
	for _, s := range in {
		var m security.StringMatch
		switch k := s.GetKind().(type) {
		case *securityv1.StringMatch_Exact:
			m.MatchType = &security.StringMatch_Exact{Exact: k.Exact}
		case *securityv1.StringMatch_Prefix:
			m.MatchType = &security.StringMatch_Prefix{Prefix: k.Prefix}
		case *securityv1.StringMatch_Suffix:
			m.MatchType = &security.StringMatch_Suffix{Suffix: k.Suffix}
		case *securityv1.StringMatch_Presence:
			m.MatchType = &security.StringMatch_Presence{Presence: &emptypb.Empty{}}
		default:
			continue // the converter sets one kind always
		}
		out = append(out, &m)
	}
	return out
}

func istioCIDRs(in []*securityv1.CIDR) []*security.Address {
	var out []*security.Address
	for _, c := range in {
		out = append(out, &security.Address{Address: c.GetAddress(), Length: c.GetLength()})
	}
	return out
}

// istioStaticStrict is Istio's static STRICT policy in root namespace
// root: it refuses every connection without a peer identity (plaintext),
// for the workloads that name it.
func istioStaticStrict(root string) *security.Authorization {
	return &security.Authorization{
		Name: IstioStaticStrictPolicy, Namespace: root, Scope: security.Scope_WORKLOAD_SELECTOR, Action: security.Action_DENY,
		Groups: []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{{
			NotPrincipals: []*security.StringMatch{{MatchType: &security.StringMatch_Presence{Presence: &emptypb.Empty{}}}},
		}}}}}},
	}
}

// refusesPlaintext reports whether an effective PeerAuthentication refuses
// plaintext on any port. Istio's ztunnel is told so for the whole workload:
// a STRICT workload's PERMISSIVE port, or a PERMISSIVE workload's STRICT
// port, is STRICT there (fail closed; Istio's per-port policies are not
// generated).
func refusesPlaintext(pa *securityv1.PeerAuthentication) bool {
	if pa.GetMode() == securityv1.MTLSMode_STRICT {
		return true
	}
	for _, m := range pa.GetPorts() {
		if m == securityv1.MTLSMode_STRICT {
			return true
		}
	}
	return false
}

// istioPolicyNames lists what Istio's workload w names in
// authorization_policies: the selector policies that select it and, when
// its PeerAuthentication refuses plaintext, the static STRICT policy. A
// workload no node ztunnel enforces for names none.
func istioPolicyNames(snap *policy.Snapshot, w *model.Workload) []string {
	if snap == nil || !policy.Enforced(w) {
		return nil
	}
	b := snap.Binding(w)
	out := slices.Clone(b.GetPolicies()) // already "<namespace>/<name>"
	if refusesPlaintext(b.GetPeerAuthentication()) {
		out = append(out, istioPolicyName(snap.RootNamespace(), IstioStaticStrictPolicy))
	}
	slices.Sort(out)
	return out
}

// istioMemo is the Istio encoding of one Isthmus policy encoding.
type istioMemo struct{ src, out []byte }

// istioNodeResources translates a node's Isthmus authorization resources
// (policy.Snapshot.NodeResources) into Istio's. Policies are decoded and
// encoded once per snapshot and shared between nodes (memo, reset with
// each snapshot: policy encodings are shared there too). The caller holds
// authzServer.mu.
func (a *authzServer) istioNodeResources(snap *policy.Snapshot, res map[string][]byte) (map[string][]byte, error) {
	if a.memoSnap != snap {
		a.memoSnap, a.memo = snap, map[string]istioMemo{}
	}
	out := make(map[string][]byte, len(res))
	strict := false
	for name, b := range res {
		if rest, ok := strings.CutPrefix(name, securityv1.PolicyPrefix); ok {
			if m, ok := a.memo[name]; ok && bytes.Equal(m.src, b) {
				out[rest] = m.out
				continue
			}
			var r securityv1.Authorization
			if err := proto.Unmarshal(b, &r); err != nil {
				return nil, fmt.Errorf("decode %s: %w", name, err)
			}
			enc, err := proto.MarshalOptions{Deterministic: true}.Marshal(istioAuthorization(r.GetPolicy()))
			if err != nil {
				return nil, fmt.Errorf("encode %s for Istio: %w", name, err)
			}
			a.memo[name] = istioMemo{src: b, out: enc}
			out[rest] = enc
			continue
		}
		if strict {
			continue
		}
		var r securityv1.Authorization
		if err := proto.Unmarshal(b, &r); err != nil {
			return nil, fmt.Errorf("decode %s: %w", name, err)
		}
		strict = refusesPlaintext(r.GetWorkload().GetPeerAuthentication())
	}
	if strict {
		name := istioPolicyName(snap.RootNamespace(), IstioStaticStrictPolicy)
		m, ok := a.memo[name]
		if !ok {
			enc, err := proto.MarshalOptions{Deterministic: true}.Marshal(istioStaticStrict(snap.RootNamespace()))
			if err != nil {
				return nil, fmt.Errorf("encode %s: %w", name, err)
			}
			m = istioMemo{out: enc}
			a.memo[name] = m
		}
		out[name] = m.out
	}
	return out, nil
}
