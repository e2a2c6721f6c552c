package policy

import (
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"

	"istio.io/api/security/v1beta1"
	securityclient "istio.io/client-go/pkg/apis/security/v1"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	securityv1 "github.com/isthmus-mesh/isthmus/pilot/api/security/v1"
)

// Reasons of Problems: a fixed set, used as metric labels.
const (
	// ReasonUnsupportedAttribute: an attribute ztunnel cannot check at L4
	// (methods, paths, hosts, request principals, headers...).
	ReasonUnsupportedAttribute = "unsupported_attribute"
	// ReasonInvalidValue: a value that does not parse (an address, a port),
	// handled like an unsupported attribute.
	ReasonInvalidValue = "invalid_value"
	// ReasonUnsupportedAction: CUSTOM or AUDIT, which ztunnel does not
	// enforce (as in Istio's ztunnel).
	ReasonUnsupportedAction = "unsupported_action"
	// ReasonTargetRef: the policy targets a waypoint, gateway or service
	// (targetRef/targetRefs), not the workloads ztunnel serves.
	ReasonTargetRef = "target_ref"
	// ReasonIgnoredField: a field Istio ignores in that place (a
	// PeerAuthentication's port-level modes without a selector), or that
	// makes Istio ignore the whole policy (a selector on a PeerAuthentication
	// of the root namespace: it applies to no workload).
	ReasonIgnoredField = "ignored_field"
)

// Reasons lists every Problem reason.
var Reasons = []string{ReasonUnsupportedAttribute, ReasonInvalidValue, ReasonUnsupportedAction, ReasonTargetRef, ReasonIgnoredField}

// Effects of problems, as reported.
const (
	effectAllowRule  = "this ALLOW rule matches nothing (fail closed)"
	effectDenyAttr   = "treated as matching: the rule denies at L4 without this condition (fail closed)"
	effectNotEnforce = "the policy is not enforced by ztunnel"
	effectIgnored    = "ignored, as Istio does"
)

// Policy is one AuthorizationPolicy as pilot holds it: its L4 form, if
// ztunnel enforces it, and what it does not enforce as written.
type Policy struct {
	Namespace, Name string
	// Selector is the workload selector (nil: the whole namespace, or the
	// mesh for the root namespace).
	Selector map[string]string
	// Proto is the L4 form; nil when ztunnel does not enforce the policy
	// (CUSTOM, AUDIT, targetRefs).
	Proto *securityv1.Policy
	// Problems are also in Proto.Problems when Proto is set.
	Problems []*securityv1.Problem
	// Generation is the object's metadata.generation.
	Generation int64
}

// Key returns "<namespace>/<name>".
func (p *Policy) Key() string { return p.Namespace + "/" + p.Name }

// TrustDomains are the mesh's trust domain and its aliases, as Istio's
// MeshConfig trustDomain and trustDomainAliases: a principal written with
// the local trust domain (or cluster.local, or an alias) also matches the
// same namespace and ServiceAccount in every alias.
type TrustDomains struct {
	// Local is the mesh's trust domain; empty: principals are matched as
	// written.
	Local string
	// Aliases are the trust domains whose identities count as the local
	// domain's in principals.
	Aliases []string
}

// expand returns principal (without spiffe://) as written or, when it
// names the local trust domain, an alias or cluster.local (Istio's name
// for "the local domain"), once with the local domain and once with each
// alias: Istio's ReplaceTrustDomainAliases. A principal that does not
// enforce a trust domain ("*", "*/ns/...") or names another domain is kept
// as written.
func (t TrustDomains) expand(principal string) []string {
	if t.Local == "" || strings.HasPrefix(principal, "*") {
		return []string{principal}
	}
	td, rest, ok := strings.Cut(principal, "/")
	all := append([]string{t.Local}, t.Aliases...)
	if !ok || td != defaults.TrustDomain && !slices.Contains(all, td) {
		return []string{principal}
	}
	out := make([]string, 0, len(all))
	for _, d := range all {
		if p := d + "/" + rest; !slices.Contains(out, p) {
			out = append(out, p)
		}
	}
	return out
}

// ConvertAuthorizationPolicy converts the L4 part of ap, matching
// principals as written. rootNS is the mesh's root namespace (the control
// plane's): a policy there without a selector applies to the whole mesh,
// one with a selector to the matching workloads of every namespace.
func ConvertAuthorizationPolicy(rootNS string, ap *securityclient.AuthorizationPolicy) *Policy {
	return ConvertAuthorizationPolicyIn(rootNS, TrustDomains{}, ap)
}

// ConvertAuthorizationPolicyIn is ConvertAuthorizationPolicy in a mesh of
// trust domain tds.Local with aliases tds.Aliases (see TrustDomains).
func ConvertAuthorizationPolicyIn(rootNS string, tds TrustDomains, ap *securityclient.AuthorizationPolicy) *Policy {
	spec := &ap.Spec
	out := &Policy{Namespace: ap.Namespace, Name: ap.Name, Generation: ap.Generation}
	if ml := spec.GetSelector().GetMatchLabels(); len(ml) > 0 {
		out.Selector = maps.Clone(ml)
	}
	if spec.GetTargetRef() != nil || len(spec.GetTargetRefs()) > 0 {
		out.Problems = append(out.Problems, problem(ReasonTargetRef, "spec.targetRefs", effectNotEnforce+": it targets a waypoint, gateway or service"))
		return out
	}
	var action securityv1.Action
	switch spec.GetAction() {
	case v1beta1.AuthorizationPolicy_ALLOW:
		action = securityv1.Action_ALLOW
	case v1beta1.AuthorizationPolicy_DENY:
		action = securityv1.Action_DENY
	default:
		out.Problems = append(out.Problems, problem(ReasonUnsupportedAction, "spec.action", fmt.Sprintf("%s: ztunnel supports ALLOW and DENY only", effectNotEnforce)))
		return out
	}
	p := &securityv1.Policy{Name: ap.Name, Namespace: ap.Namespace, Action: action, Selector: out.Selector}
	// Scope as Istio's: a selector (with labels) selects in the policy's
	// namespace and, for the root namespace, in every namespace
	// (pilot/pkg/serviceregistry/kube/controller/ambient/workloads.go
	// buildWorkloadPolicies matches a selector policy of the workload's
	// namespace or of the root one; the AuthorizationPolicy reference: "If
	// the authorization policy is in the root namespace, the selector will
	// additionally match with workloads in all namespaces"). Without one, or
	// with `selector: {}` (which selects every workload of those
	// namespaces), the policy is namespace-wide, or mesh-wide in the root
	// namespace. Unlike PeerAuthentication (ConvertPeerAuthentication).
	switch {
	case out.Selector != nil:
		p.Scope = securityv1.Scope_SELECTOR
	case ap.Namespace == rootNS:
		p.Scope = securityv1.Scope_MESH
	default:
		p.Scope = securityv1.Scope_NAMESPACE
	}
	cv := &converter{deny: action == securityv1.Action_DENY, ns: ap.Namespace, tds: tds}
	for i, r := range spec.GetRules() {
		if rule := cv.rule(i, r); rule != nil {
			p.Rules = append(p.Rules, rule)
		}
	}
	p.Problems = cv.problems
	out.Proto, out.Problems = p, cv.problems
	return out
}

func problem(reason, field, effect string) *securityv1.Problem {
	return &securityv1.Problem{Reason: reason, Field: field, Effect: effect}
}

// converter converts the rules of one policy and collects its problems.
type converter struct {
	deny     bool
	ns       string
	tds      TrustDomains
	problems []*securityv1.Problem
	// bad is set while converting a rule that holds something ztunnel
	// cannot check: an ALLOW rule is then dropped.
	bad bool
}

// report records that field cannot be checked as written.
func (cv *converter) report(reason, field string) {
	effect := effectDenyAttr
	if !cv.deny {
		effect = effectAllowRule
	}
	cv.problems = append(cv.problems, problem(reason, field, effect))
	cv.bad = true
}

// rule converts rule i; nil when an ALLOW rule is dropped (it matches
// nothing). In a DENY rule, what cannot be checked is left out, so the rule
// matches as if it held.
func (cv *converter) rule(i int, r *v1beta1.Rule) *securityv1.Rule {
	cv.bad = false
	out := &securityv1.Rule{}
	if len(r.GetFrom()) > 0 {
		c := &securityv1.Clause{}
		for j, f := range r.GetFrom() {
			c.Matches = append(c.Matches, cv.source(fmt.Sprintf("rules[%d].from[%d].source", i, j), f.GetSource()))
		}
		out.Clauses = append(out.Clauses, c)
	}
	if len(r.GetTo()) > 0 {
		c := &securityv1.Clause{}
		for j, t := range r.GetTo() {
			c.Matches = append(c.Matches, cv.operation(fmt.Sprintf("rules[%d].to[%d].operation", i, j), t.GetOperation()))
		}
		out.Clauses = append(out.Clauses, c)
	}
	for j, w := range r.GetWhen() {
		if m := cv.condition(fmt.Sprintf("rules[%d].when[%d]", i, j), w); m != nil {
			out.Clauses = append(out.Clauses, &securityv1.Clause{Matches: []*securityv1.Match{m}})
		}
	}
	if cv.bad && !cv.deny {
		return nil
	}
	return out
}

// unsupported reports each named field of a source or operation that is
// set: ztunnel cannot check it.
func (cv *converter) unsupported(path string, fields map[string][]string) {
	for _, name := range sortedKeys(fields) {
		if len(fields[name]) > 0 {
			cv.report(ReasonUnsupportedAttribute, path+"."+name)
		}
	}
}

// empty reports whether every list is empty.
func empty(lists ...[]string) bool {
	for _, l := range lists {
		if len(l) > 0 {
			return false
		}
	}
	return true
}

func (cv *converter) source(path string, s *v1beta1.Source) *securityv1.Match {
	m := &securityv1.Match{}
	// Istio's validation refuses an empty (or absent) source ("`from.source`
	// must not be empty", pkg/config/validation); without that webhook it
	// would match every peer here, so it is an invalid value: an ALLOW rule
	// holding it matches nothing.
	if empty(s.GetPrincipals(), s.GetNotPrincipals(), s.GetRequestPrincipals(), s.GetNotRequestPrincipals(),
		s.GetNamespaces(), s.GetNotNamespaces(), s.GetServiceAccounts(), s.GetNotServiceAccounts(),
		s.GetIpBlocks(), s.GetNotIpBlocks(), s.GetRemoteIpBlocks(), s.GetNotRemoteIpBlocks(),
		s.GetTrustDomains(), s.GetNotTrustDomains()) {
		cv.report(ReasonInvalidValue, path+" (empty)")
		return m
	}
	cv.unsupported(path, map[string][]string{
		"requestPrincipals": s.GetRequestPrincipals(), "notRequestPrincipals": s.GetNotRequestPrincipals(),
		"remoteIpBlocks": s.GetRemoteIpBlocks(), "notRemoteIpBlocks": s.GetNotRemoteIpBlocks(),
		"trustDomains": s.GetTrustDomains(), "notTrustDomains": s.GetNotTrustDomains(),
	})
	m.Principals = cv.principals(s.GetPrincipals())
	m.NotPrincipals = cv.principals(s.GetNotPrincipals())
	m.Namespaces = strings2(s.GetNamespaces())
	m.NotNamespaces = strings2(s.GetNotNamespaces())
	if len(s.GetServiceAccounts())+len(s.GetNotServiceAccounts()) > 0 {
		if len(m.Principals)+len(m.NotPrincipals)+len(m.Namespaces)+len(m.NotNamespaces) > 0 {
			cv.report(ReasonInvalidValue, path+".serviceAccounts (set with principals or namespaces)")
		} else {
			m.Principals = cv.serviceAccounts(s.GetServiceAccounts())
			m.NotPrincipals = cv.serviceAccounts(s.GetNotServiceAccounts())
		}
	}
	var ok bool
	if m.SourceIps, ok = cidrs(s.GetIpBlocks()); !ok {
		cv.report(ReasonInvalidValue, path+".ipBlocks")
		m.SourceIps = nil
	}
	if m.NotSourceIps, ok = cidrs(s.GetNotIpBlocks()); !ok {
		cv.report(ReasonInvalidValue, path+".notIpBlocks")
		m.NotSourceIps = nil
	}
	return m
}

// serviceAccounts turns "<ns>/<sa>" (or "<sa>", in the policy's namespace)
// into principal matches of any trust domain.
func (cv *converter) serviceAccounts(sas []string) []*securityv1.StringMatch {
	var out []*securityv1.StringMatch
	for _, sa := range sas {
		ns, name, ok := strings.Cut(sa, "/")
		if !ok {
			ns, name = cv.ns, sa
		}
		out = append(out, &securityv1.StringMatch{Kind: &securityv1.StringMatch_Suffix{Suffix: "/ns/" + ns + "/sa/" + name}})
	}
	return out
}

func (cv *converter) operation(path string, o *v1beta1.Operation) *securityv1.Match {
	m := &securityv1.Match{}
	// Likewise "`to.operation` must not be empty".
	if empty(o.GetHosts(), o.GetNotHosts(), o.GetPorts(), o.GetNotPorts(), o.GetMethods(), o.GetNotMethods(), o.GetPaths(), o.GetNotPaths()) {
		cv.report(ReasonInvalidValue, path+" (empty)")
		return m
	}
	cv.unsupported(path, map[string][]string{
		"hosts": o.GetHosts(), "notHosts": o.GetNotHosts(), "methods": o.GetMethods(), "notMethods": o.GetNotMethods(),
		"paths": o.GetPaths(), "notPaths": o.GetNotPaths(),
	})
	var ok bool
	if m.DestinationPorts, ok = ports(o.GetPorts()); !ok {
		cv.report(ReasonInvalidValue, path+".ports")
		m.DestinationPorts = nil
	}
	if m.NotDestinationPorts, ok = ports(o.GetNotPorts()); !ok {
		cv.report(ReasonInvalidValue, path+".notPorts")
		m.NotDestinationPorts = nil
	}
	return m
}

// condition converts one `when` condition; nil when it is left out.
func (cv *converter) condition(path string, c *v1beta1.Condition) *securityv1.Match {
	field := fmt.Sprintf("%s (%s)", path, c.GetKey())
	if len(c.GetValues())+len(c.GetNotValues()) == 0 {
		cv.report(ReasonInvalidValue, field)
		return nil
	}
	m := &securityv1.Match{}
	ok1, ok2 := true, true
	switch c.GetKey() {
	case "source.ip":
		m.SourceIps, ok1 = cidrs(c.GetValues())
		m.NotSourceIps, ok2 = cidrs(c.GetNotValues())
	case "destination.ip":
		m.DestinationIps, ok1 = cidrs(c.GetValues())
		m.NotDestinationIps, ok2 = cidrs(c.GetNotValues())
	case "destination.port":
		m.DestinationPorts, ok1 = ports(c.GetValues())
		m.NotDestinationPorts, ok2 = ports(c.GetNotValues())
	case "source.namespace":
		m.Namespaces, m.NotNamespaces = strings2(c.GetValues()), strings2(c.GetNotValues())
	case "source.principal":
		m.Principals, m.NotPrincipals = cv.principals(c.GetValues()), cv.principals(c.GetNotValues())
	default:
		cv.report(ReasonUnsupportedAttribute, field)
		return nil
	}
	if !ok1 || !ok2 {
		cv.report(ReasonInvalidValue, field)
		return nil
	}
	return m
}

// stringMatch parses Istio's string forms: "*" (any non-empty value),
// "abc*" (prefix), "*abc" (suffix), or an exact value.
func stringMatch(s string) *securityv1.StringMatch {
	switch {
	case s == "*":
		return &securityv1.StringMatch{Kind: &securityv1.StringMatch_Presence{Presence: true}}
	case strings.HasSuffix(s, "*"):
		return &securityv1.StringMatch{Kind: &securityv1.StringMatch_Prefix{Prefix: strings.TrimSuffix(s, "*")}}
	case strings.HasPrefix(s, "*"):
		return &securityv1.StringMatch{Kind: &securityv1.StringMatch_Suffix{Suffix: strings.TrimPrefix(s, "*")}}
	default:
		return &securityv1.StringMatch{Kind: &securityv1.StringMatch_Exact{Exact: s}}
	}
}

func strings2(in []string) []*securityv1.StringMatch {
	var out []*securityv1.StringMatch
	for _, s := range in {
		out = append(out, stringMatch(s))
	}
	return out
}

// principals parses principal values: Istio's "<td>/ns/<ns>/sa/<sa>", also
// accepted in the spiffe:// form, each expanded to the trust-domain
// aliases.
func (cv *converter) principals(in []string) []*securityv1.StringMatch {
	var out []*securityv1.StringMatch
	for _, s := range in {
		for _, p := range cv.tds.expand(strings.TrimPrefix(s, "spiffe://")) {
			out = append(out, stringMatch(p))
		}
	}
	return out
}

// cidrs parses addresses and CIDR blocks; ok is false when one does not
// parse.
func cidrs(in []string) (out []*securityv1.CIDR, ok bool) {
	for _, s := range in {
		var p netip.Prefix
		var err error
		if strings.Contains(s, "/") {
			p, err = netip.ParsePrefix(strings.TrimSpace(s))
		} else {
			var a netip.Addr
			a, err = netip.ParseAddr(strings.TrimSpace(s))
			p = netip.PrefixFrom(a, a.BitLen())
		}
		if err != nil {
			return nil, false
		}
		p = p.Masked()
		out = append(out, &securityv1.CIDR{Address: p.Addr().Unmap().AsSlice(), Length: uint32(p.Bits())})
	}
	return out, true
}

// ports parses port numbers 1..65535; ok is false when one does not.
func ports(in []string) (out []uint32, ok bool) {
	for _, s := range in {
		n, err := strconv.ParseUint(strings.TrimSpace(s), 10, 16)
		if err != nil || n == 0 {
			return nil, false
		}
		out = append(out, uint32(n))
	}
	return out, true
}

// PeerAuth is one PeerAuthentication as pilot holds it.
type PeerAuth struct {
	Namespace, Name string
	// Selector is the workload selector (nil: none, or an empty one).
	Selector map[string]string
	// Ignored marks a policy that applies to no workload: one in the root
	// namespace with a selector (see ConvertPeerAuthentication).
	Ignored bool
	// Mode is the top-level mode; ok false when UNSET (inherited).
	Mode    securityv1.MTLSMode
	ModeSet bool
	// Ports are the port-level modes that are set.
	Ports    map[uint32]securityv1.MTLSMode
	Created  time.Time
	Problems []*securityv1.Problem
}

// Key returns "<namespace>/<name>".
func (p *PeerAuth) Key() string { return p.Namespace + "/" + p.Name }

// effectRootSelector is the effect of a selector on a root-namespace
// PeerAuthentication.
const effectRootSelector = "ignored, as Istio does: a PeerAuthentication in the root namespace with a selector applies to no workload, neither mesh-wide nor to the workloads it selects"

// ConvertPeerAuthentication converts pa. Its level is Istio's:
//
//   - no selector, or one without labels (`selector: {}`): mesh-wide in the
//     root namespace, namespace-wide elsewhere;
//   - a selector with labels outside the root namespace: the workloads it
//     selects in its own namespace, with its port-level modes;
//   - a selector with labels in the root namespace: no workload at all. The
//     policy is kept (listed, reported as ReasonIgnoredField on
//     spec.selector) but is never part of any workload's mode.
//
// The last rule is what Istio's code does in both data planes, and it
// matters because the obvious readings are wrong: such a policy is not
// mesh-wide, and it is not workload-specific either, not even for the
// root namespace's own workloads. Sidecars:
// pilot/pkg/security/authn/policy_applier.go, ComposePeerAuthentication
// ("Workload-level policy, aka the one with selector and not in root
// namespace"; root-namespace ones "will be safely ignored"). Ambient
// (ztunnel): pilot/pkg/serviceregistry/kube/controller/ambient/workloads.go
// fetchPeerAuthentications offers it only to the root namespace's own
// workloads, then authorization.go convertedSelectorPeerAuthentications
// drops it by the same rule and convertPeerAuthentication returns nil for
// every root-namespace policy. (The `selector` field's text in Istio's
// PeerAuthentication reference says a root-namespace selector "will
// additionally match with workloads in all namespace"; neither data plane
// does so.)
//
// Port-level modes count only at the workload level; elsewhere they are
// ignored, as in Istio (its CRD refuses them without a selector), and
// reported.
func ConvertPeerAuthentication(rootNS string, pa *securityclient.PeerAuthentication) *PeerAuth {
	out := &PeerAuth{Namespace: pa.Namespace, Name: pa.Name, Created: pa.CreationTimestamp.Time}
	out.Mode, out.ModeSet = mtlsMode(pa.Spec.GetMtls().GetMode())
	if ml := pa.Spec.GetSelector().GetMatchLabels(); len(ml) > 0 {
		out.Selector = maps.Clone(ml)
		if pa.Namespace == rootNS {
			out.Ignored = true
			out.Problems = append(out.Problems, problem(ReasonIgnoredField, "spec.selector", effectRootSelector))
			return out
		}
	}
	for port, m := range pa.Spec.GetPortLevelMtls() {
		if out.Selector == nil {
			out.Problems = append(out.Problems, problem(ReasonIgnoredField, fmt.Sprintf("spec.portLevelMtls[%d]", port), effectIgnored+": port-level modes need a workload selector"))
			continue
		}
		if port == 0 || port > 65535 {
			out.Problems = append(out.Problems, problem(ReasonInvalidValue, fmt.Sprintf("spec.portLevelMtls[%d]", port), effectIgnored))
			continue
		}
		if mode, ok := mtlsMode(m.GetMode()); ok {
			if out.Ports == nil {
				out.Ports = map[uint32]securityv1.MTLSMode{}
			}
			out.Ports[port] = mode
		}
	}
	return out
}

// mtlsMode converts a mode; ok is false for UNSET.
func mtlsMode(m v1beta1.PeerAuthentication_MutualTLS_Mode) (securityv1.MTLSMode, bool) {
	switch m {
	case v1beta1.PeerAuthentication_MutualTLS_STRICT:
		return securityv1.MTLSMode_STRICT, true
	case v1beta1.PeerAuthentication_MutualTLS_PERMISSIVE:
		return securityv1.MTLSMode_PERMISSIVE, true
	case v1beta1.PeerAuthentication_MutualTLS_DISABLE:
		return securityv1.MTLSMode_DISABLE, true
	default:
		return securityv1.MTLSMode_STRICT, false
	}
}
