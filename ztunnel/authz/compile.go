package authz

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"

	securityv1 "github.com/isthmus-mesh/isthmus/pilot/api/security/v1"
)

// policy is a compiled securityv1.Policy: its matchers in the form the
// check walks without allocating.
type policy struct {
	namespace, name string
	deny            bool
	scope           securityv1.Scope
	rules           []rule
	src             *securityv1.Policy
}

// key is "<namespace>/<name>".
func (p *policy) key() string { return p.namespace + "/" + p.name }

// rule holds when every clause does.
type rule []clause

// clause holds when any match does.
type clause []match

// match holds when every field that is set holds.
type match struct {
	principals, notPrincipals []strMatch
	namespaces, notNamespaces []strMatch
	srcIPs, notSrcIPs         []netip.Prefix
	dstIPs, notDstIPs         []netip.Prefix
	ports, notPorts           []uint16
}

type strKind uint8

const (
	strExact strKind = iota
	strPrefix
	strSuffix
	strPresence
)

// strMatch is one of Istio's string forms.
type strMatch struct {
	kind strKind
	v    string
}

func (m strMatch) matches(s string) bool {
	switch m.kind {
	case strExact:
		return s == m.v
	case strPrefix:
		return strings.HasPrefix(s, m.v)
	case strSuffix:
		return strings.HasSuffix(s, m.v)
	default:
		return s != ""
	}
}

// errInvalid wraps every compile error.
var errInvalid = errors.New("invalid policy")

// compilePolicy checks and compiles p. Errors name the offending field.
func compilePolicy(p *securityv1.Policy) (*policy, error) {
	if p.GetName() == "" || p.GetNamespace() == "" {
		return nil, fmt.Errorf("%w: policy without name or namespace", errInvalid)
	}
	if _, ok := securityv1.Action_name[int32(p.GetAction())]; !ok {
		return nil, fmt.Errorf("%w: %s/%s: action %d", errInvalid, p.GetNamespace(), p.GetName(), p.GetAction())
	}
	if _, ok := securityv1.Scope_name[int32(p.GetScope())]; !ok {
		return nil, fmt.Errorf("%w: %s/%s: scope %d", errInvalid, p.GetNamespace(), p.GetName(), p.GetScope())
	}
	out := &policy{
		namespace: p.GetNamespace(), name: p.GetName(),
		deny: p.GetAction() == securityv1.Action_DENY, scope: p.GetScope(), src: p,
		rules: make([]rule, 0, len(p.GetRules())),
	}
	for i, r := range p.GetRules() {
		cr := make(rule, 0, len(r.GetClauses()))
		for j, c := range r.GetClauses() {
			cc := make(clause, 0, len(c.GetMatches()))
			for k, m := range c.GetMatches() {
				cm, err := compileMatch(m)
				if err != nil {
					return nil, fmt.Errorf("%w: %s/%s: rules[%d].clauses[%d].matches[%d]: %w", errInvalid, p.GetNamespace(), p.GetName(), i, j, k, err)
				}
				cc = append(cc, cm)
			}
			cr = append(cr, cc)
		}
		out.rules = append(out.rules, cr)
	}
	return out, nil
}

func compileMatch(m *securityv1.Match) (match, error) {
	var out match
	var err error
	strs := []struct {
		in  []*securityv1.StringMatch
		out *[]strMatch
	}{
		{m.GetPrincipals(), &out.principals}, {m.GetNotPrincipals(), &out.notPrincipals},
		{m.GetNamespaces(), &out.namespaces}, {m.GetNotNamespaces(), &out.notNamespaces},
	}
	for _, s := range strs {
		if *s.out, err = compileStrings(s.in); err != nil {
			return match{}, err
		}
	}
	cidrs := []struct {
		in  []*securityv1.CIDR
		out *[]netip.Prefix
	}{
		{m.GetSourceIps(), &out.srcIPs}, {m.GetNotSourceIps(), &out.notSrcIPs},
		{m.GetDestinationIps(), &out.dstIPs}, {m.GetNotDestinationIps(), &out.notDstIPs},
	}
	for _, c := range cidrs {
		if *c.out, err = compileCIDRs(c.in); err != nil {
			return match{}, err
		}
	}
	if out.ports, err = compilePorts(m.GetDestinationPorts()); err != nil {
		return match{}, err
	}
	if out.notPorts, err = compilePorts(m.GetNotDestinationPorts()); err != nil {
		return match{}, err
	}
	return out, nil
}

func compileStrings(in []*securityv1.StringMatch) ([]strMatch, error) {
	if len(in) == 0 {
		return nil, nil
	}
	out := make([]strMatch, 0, len(in))
	for _, s := range in {
		switch k := s.GetKind().(type) {
		case *securityv1.StringMatch_Exact:
			out = append(out, strMatch{kind: strExact, v: k.Exact})
		case *securityv1.StringMatch_Prefix:
			out = append(out, strMatch{kind: strPrefix, v: k.Prefix})
		case *securityv1.StringMatch_Suffix:
			out = append(out, strMatch{kind: strSuffix, v: k.Suffix})
		case *securityv1.StringMatch_Presence:
			out = append(out, strMatch{kind: strPresence})
		default:
			return nil, errors.New("string match without a kind")
		}
	}
	return out, nil
}

func compileCIDRs(in []*securityv1.CIDR) ([]netip.Prefix, error) {
	if len(in) == 0 {
		return nil, nil
	}
	out := make([]netip.Prefix, 0, len(in))
	for _, c := range in {
		a, ok := netip.AddrFromSlice(c.GetAddress())
		if !ok {
			return nil, fmt.Errorf("address of %d bytes", len(c.GetAddress()))
		}
		a = a.Unmap()
		if int(c.GetLength()) > a.BitLen() {
			return nil, fmt.Errorf("prefix length %d for %s", c.GetLength(), a)
		}
		p, err := a.Prefix(int(c.GetLength()))
		if err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, nil
}

func compilePorts(in []uint32) ([]uint16, error) {
	if len(in) == 0 {
		return nil, nil
	}
	out := make([]uint16, 0, len(in))
	for _, p := range in {
		if p == 0 || p > 65535 {
			return nil, fmt.Errorf("port %d", p)
		}
		out = append(out, uint16(p))
	}
	return out, nil
}

// peerAuth is a compiled securityv1.PeerAuthentication.
type peerAuth struct {
	mode  securityv1.MTLSMode
	ports map[uint16]securityv1.MTLSMode
}

func compilePeerAuth(pa *securityv1.PeerAuthentication) (peerAuth, error) {
	out := peerAuth{mode: pa.GetMode()}
	if _, ok := securityv1.MTLSMode_name[int32(out.mode)]; !ok {
		return peerAuth{}, fmt.Errorf("%w: mTLS mode %d", errInvalid, out.mode)
	}
	for port, mode := range pa.GetPorts() {
		if port == 0 || port > 65535 {
			return peerAuth{}, fmt.Errorf("%w: port-level mTLS for port %d", errInvalid, port)
		}
		if _, ok := securityv1.MTLSMode_name[int32(mode)]; !ok {
			return peerAuth{}, fmt.Errorf("%w: mTLS mode %d for port %d", errInvalid, mode, port)
		}
		if out.ports == nil {
			out.ports = map[uint16]securityv1.MTLSMode{}
		}
		out.ports[uint16(port)] = mode
	}
	return out, nil
}

// modeFor returns the mTLS mode of port.
func (pa peerAuth) modeFor(port uint16) securityv1.MTLSMode {
	if m, ok := pa.ports[port]; ok {
		return m
	}
	return pa.mode
}
