package authz

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"

	securityv1 "github.com/isthmus-mesh/isthmus/pilot/api/security/v1"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
)

// Reasons a connection is refused: a fixed set, used as metric labels.
const (
	// ReasonDenyPolicy: a DENY policy matched.
	ReasonDenyPolicy = "deny_policy"
	// ReasonAllowUnmatched: ALLOW policies apply and none matched.
	ReasonAllowUnmatched = "allow_unmatched"
	// ReasonPolicyUnknown: the destination's policies are not (yet) known
	// to this ztunnel.
	ReasonPolicyUnknown = "policy_unknown"
	// ReasonMTLSRequired: plaintext to a port whose PeerAuthentication is
	// STRICT.
	ReasonMTLSRequired = "mtls_required"
)

// Reasons lists every refusal reason.
var Reasons = []string{ReasonDenyPolicy, ReasonAllowUnmatched, ReasonPolicyUnknown, ReasonMTLSRequired}

// Conn is what a connection is checked by.
type Conn struct {
	// Workload is the uid of the destination workload, one of this node's.
	Workload string
	// Peer is the verified identity of the source; zero for a plaintext
	// connection.
	Peer identity.Identity
	// SourceIP is the source workload's address; the zero Addr when it is
	// not known (see the package documentation).
	SourceIP netip.Addr
	// DestinationIP and DestinationPort are the workload address and port
	// the connection is for.
	DestinationIP   netip.Addr
	DestinationPort uint16
	// Plaintext marks a connection that arrived without mutual TLS (the
	// inbound plaintext port, 15006): PeerAuthentication decides first
	// whether it may come in at all.
	Plaintext bool
}

// Decision is the outcome of a check.
type Decision struct {
	Allowed bool
	// Reason is one of the Reason constants when the connection is refused.
	Reason string `json:",omitempty"`
	// Namespace and Name are the deciding policy: the DENY policy that
	// matched, the ALLOW policy that matched, or the PeerAuthentication
	// that requires mutual TLS; empty when none decided (no ALLOW policy
	// applies, none matched, the policies are unknown, or the STRICT
	// default).
	Namespace string `json:",omitempty"`
	Name      string `json:",omitempty"`
}

// Policy returns "<namespace>/<name>" of the deciding policy, or "".
func (d Decision) Policy() string {
	if d.Name == "" {
		return ""
	}
	return d.Namespace + "/" + d.Name
}

// Snapshot is an immutable, indexed set of authorization resources: the
// policies this ztunnel holds and the bindings of its workloads. A check
// touches only the policies that apply to its destination workload (the
// list is computed when the snapshot is built). Safe for concurrent use.
type Snapshot struct {
	policies  map[string]*policy // by "<namespace>/<name>"
	mesh      []*policy
	byNS      map[string][]*policy // NAMESPACE scope
	workloads map[string]*bound
}

// bound is one workload with the policies that apply to it, DENY and
// ALLOW apart, in name order.
type bound struct {
	src         *securityv1.WorkloadPolicies
	deny, allow []*policy
	pa          peerAuth
	// missing are selected policies this ztunnel does not hold: the
	// workload's policies are then unknown and its connections refused.
	missing []string
}

// emptySnapshot knows no workload: every check is refused as unknown.
var emptySnapshot = build(nil, nil)

// NewSnapshot compiles resources into a Snapshot; it fails on the first
// invalid resource.
func NewSnapshot(resources []*securityv1.Authorization) (*Snapshot, error) {
	pols := map[string]*policy{}
	wls := map[string]*boundSource{}
	var errs []error
	for _, r := range resources {
		switch k := r.GetKind().(type) {
		case *securityv1.Authorization_Policy:
			p, err := compilePolicy(k.Policy)
			if err != nil {
				errs = append(errs, err)
				continue
			}
			pols[p.key()] = p
		case *securityv1.Authorization_Workload:
			b, err := compileBinding(k.Workload)
			if err != nil {
				errs = append(errs, err)
				continue
			}
			wls[b.src.GetUid()] = b
		default:
			errs = append(errs, fmt.Errorf("%w: resource without a kind", errInvalid))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return build(pols, wls), nil
}

// boundSource is a compiled WorkloadPolicies before its policies are
// resolved.
type boundSource struct {
	src *securityv1.WorkloadPolicies
	pa  peerAuth
}

func compileBinding(w *securityv1.WorkloadPolicies) (*boundSource, error) {
	if w.GetUid() == "" || w.GetNamespace() == "" {
		return nil, fmt.Errorf("%w: workload binding without uid or namespace", errInvalid)
	}
	pa, err := compilePeerAuth(w.GetPeerAuthentication())
	if err != nil {
		return nil, fmt.Errorf("workload %s: %w", w.GetUid(), err)
	}
	for _, name := range w.GetPolicies() {
		if ns, n, ok := strings.Cut(name, "/"); !ok || ns == "" || n == "" {
			return nil, fmt.Errorf("%w: workload %s: policy name %q is not <namespace>/<name>", errInvalid, w.GetUid(), name)
		}
	}
	return &boundSource{src: w, pa: pa}, nil
}

// build indexes compiled policies and bindings. It costs O(policies +
// bindings × the policies that apply to each).
func build(pols map[string]*policy, wls map[string]*boundSource) *Snapshot {
	s := &Snapshot{policies: pols, byNS: map[string][]*policy{}, workloads: make(map[string]*bound, len(wls))}
	if s.policies == nil {
		s.policies = map[string]*policy{}
	}
	keys := slices.Sorted(maps.Keys(s.policies))
	for _, k := range keys {
		p := s.policies[k]
		switch p.scope {
		case securityv1.Scope_MESH:
			s.mesh = append(s.mesh, p)
		case securityv1.Scope_NAMESPACE:
			s.byNS[p.namespace] = append(s.byNS[p.namespace], p)
		}
	}
	for uid, b := range wls {
		bw := &bound{src: b.src, pa: b.pa}
		apply := slices.Concat(s.mesh, s.byNS[b.src.GetNamespace()])
		for _, name := range b.src.GetPolicies() {
			p, ok := s.policies[name]
			if !ok {
				bw.missing = append(bw.missing, name)
				continue
			}
			if p.scope == securityv1.Scope_SELECTOR {
				apply = append(apply, p)
			}
		}
		slices.SortFunc(apply, func(a, b *policy) int {
			return cmp.Or(cmp.Compare(a.namespace, b.namespace), cmp.Compare(a.name, b.name))
		})
		apply = slices.CompactFunc(apply, func(a, b *policy) bool { return a == b })
		for _, p := range apply {
			if p.deny {
				bw.deny = append(bw.deny, p)
			} else {
				bw.allow = append(bw.allow, p)
			}
		}
		s.workloads[uid] = bw
	}
	return s
}

// Known reports whether the policies of workload uid are known.
func (s *Snapshot) Known(uid string) bool {
	b := s.workloads[uid]
	return b != nil && len(b.missing) == 0
}

// Len returns the number of policies held.
func (s *Snapshot) Len() int { return len(s.policies) }

// Evaluate decides c: for plaintext, PeerAuthentication first; then DENY
// policies, then, if any ALLOW policy applies, one must match.
func (s *Snapshot) Evaluate(c Conn) Decision {
	b := s.workloads[c.Workload]
	if b == nil || len(b.missing) > 0 {
		return Decision{Reason: ReasonPolicyUnknown}
	}
	if c.Plaintext && b.pa.modeFor(c.DestinationPort) == securityv1.MTLSMode_STRICT {
		d := Decision{Reason: ReasonMTLSRequired}
		if src := b.src.GetPeerAuthentication().GetSources(); len(src) > 0 {
			d.Namespace, d.Name, _ = strings.Cut(src[len(src)-1], "/")
		}
		return d
	}
	a := attrsOf(c)
	for _, p := range b.deny {
		if p.matches(&a) {
			return Decision{Reason: ReasonDenyPolicy, Namespace: p.namespace, Name: p.name}
		}
	}
	if len(b.allow) == 0 {
		return Decision{Allowed: true}
	}
	for _, p := range b.allow {
		if p.matches(&a) {
			return Decision{Allowed: true, Namespace: p.namespace, Name: p.name}
		}
	}
	return Decision{Reason: ReasonAllowUnmatched}
}

// attrs are a connection's attributes as the matchers read them.
type attrs struct {
	hasPeer              bool
	principal, namespace string
	src, dst             netip.Addr
	port                 uint16
}

func attrsOf(c Conn) attrs {
	a := attrs{src: c.SourceIP.Unmap(), dst: c.DestinationIP.Unmap(), port: c.DestinationPort}
	if !c.Peer.IsZero() {
		a.hasPeer = true
		a.principal = Principal(c.Peer)
		a.namespace = c.Peer.Namespace
	}
	return a
}

// Principal writes id as Istio's principal attribute:
// "<trust domain>/ns/<namespace>/sa/<service account>".
func Principal(id identity.Identity) string {
	return id.TrustDomain + "/ns/" + id.Namespace + "/sa/" + id.ServiceAccount
}

func (p *policy) matches(a *attrs) bool {
	for i := range p.rules {
		if p.rules[i].holds(a, p.deny) {
			return true
		}
	}
	return false
}

// matchingRule returns the index of the first rule that matches, or -1.
func (p *policy) matchingRule(a *attrs) int {
	for i := range p.rules {
		if p.rules[i].holds(a, p.deny) {
			return i
		}
	}
	return -1
}

func (r rule) holds(a *attrs, deny bool) bool {
	for _, c := range r {
		if !c.holds(a, deny) {
			return false
		}
	}
	return true
}

func (c clause) holds(a *attrs, deny bool) bool {
	for i := range c {
		if c[i].holds(a, deny) {
			return true
		}
	}
	return false
}

// holds evaluates m. An unknown source address satisfies IP fields only in
// a DENY policy (unknown), so that neither kind of policy lets more through
// than it would with the address known.
func (m *match) holds(a *attrs, unknown bool) bool {
	if len(m.principals) > 0 && (!a.hasPeer || !anyString(m.principals, a.principal)) {
		return false
	}
	if len(m.notPrincipals) > 0 && a.hasPeer && anyString(m.notPrincipals, a.principal) {
		return false
	}
	if len(m.namespaces) > 0 && (!a.hasPeer || !anyString(m.namespaces, a.namespace)) {
		return false
	}
	if len(m.notNamespaces) > 0 && a.hasPeer && anyString(m.notNamespaces, a.namespace) {
		return false
	}
	if len(m.srcIPs) > 0 && !ipHolds(m.srcIPs, a.src, true, unknown) {
		return false
	}
	if len(m.notSrcIPs) > 0 && !ipHolds(m.notSrcIPs, a.src, false, unknown) {
		return false
	}
	if len(m.dstIPs) > 0 && !ipHolds(m.dstIPs, a.dst, true, unknown) {
		return false
	}
	if len(m.notDstIPs) > 0 && !ipHolds(m.notDstIPs, a.dst, false, unknown) {
		return false
	}
	if len(m.ports) > 0 && !slices.Contains(m.ports, a.port) {
		return false
	}
	if len(m.notPorts) > 0 && slices.Contains(m.notPorts, a.port) {
		return false
	}
	return true
}

func anyString(ms []strMatch, s string) bool {
	for _, m := range ms {
		if m.matches(s) {
			return true
		}
	}
	return false
}

// ipHolds evaluates an IP field: positive when one block contains ip,
// negative when none does; unknown when ip is not known.
func ipHolds(blocks []netip.Prefix, ip netip.Addr, positive, unknown bool) bool {
	if !ip.IsValid() {
		return unknown
	}
	in := false
	for _, b := range blocks {
		if b.Contains(ip) {
			in = true
			break
		}
	}
	return in == positive
}
