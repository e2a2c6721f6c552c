package authz

import (
	"maps"
	"slices"

	securityv1 "github.com/isthmus-mesh/isthmus/pilot/api/security/v1"
)

// Explanation says which policies apply to a connection's destination and
// how each judged it. It is for people (isthmusctl authz check), not for
// the data path: Evaluate decides without building it.
type Explanation struct {
	Decision Decision `json:"decision"`
	// Known is false when the destination's policies are not known;
	// Missing then lists selected policies that are not held.
	Known   bool     `json:"known"`
	Missing []string `json:"missing,omitempty"`
	// PeerAuthentication is the destination's effective mTLS mode for the
	// connection's port, and the PeerAuthentications that set it.
	PeerAuthentication PeerAuthResult `json:"peerAuthentication"`
	// Policies are the applicable policies, DENY ones first, in the order
	// they are checked.
	Policies []PolicyResult `json:"policies"`
}

// PeerAuthResult is the effective PeerAuthentication of a port.
type PeerAuthResult struct {
	Mode    string   `json:"mode"`
	Sources []string `json:"sources,omitempty"`
	// Checked is true for a plaintext connection (HBONE is always mutual
	// TLS, so the mode does not apply to it).
	Checked bool `json:"checked"`
}

// PolicyResult is how one policy judged a connection.
type PolicyResult struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	Action    string `json:"action"`
	// Scope says why the policy applies: MESH, NAMESPACE or SELECTOR.
	Scope    string            `json:"scope"`
	Selector map[string]string `json:"selector,omitempty"`
	// Matched reports whether the policy matched; Rule is the first rule
	// that did (-1 when none).
	Matched bool `json:"matched"`
	Rule    int  `json:"rule"`
	// Problems are what ztunnel does not enforce as written in it.
	Problems []Problem `json:"problems,omitempty"`
}

// Problem is a securityv1.Problem in plain form.
type Problem struct {
	Reason string `json:"reason"`
	Field  string `json:"field"`
	Effect string `json:"effect"`
}

// ProblemsOf converts a policy's problems.
func ProblemsOf(p *securityv1.Policy) []Problem {
	var out []Problem
	for _, pr := range p.GetProblems() {
		out = append(out, Problem{Reason: pr.GetReason(), Field: pr.GetField(), Effect: pr.GetEffect()})
	}
	return out
}

// Explain decides c as Evaluate does and says why.
func (s *Snapshot) Explain(c Conn) Explanation {
	ex := Explanation{Decision: s.Evaluate(c)}
	b := s.workloads[c.Workload]
	if b == nil {
		return ex
	}
	ex.Missing = b.missing
	ex.Known = len(b.missing) == 0
	ex.PeerAuthentication = PeerAuthResult{
		Mode:    b.pa.modeFor(c.DestinationPort).String(),
		Sources: b.src.GetPeerAuthentication().GetSources(),
		Checked: c.Plaintext,
	}
	a := attrsOf(c)
	for _, p := range slices.Concat(b.deny, b.allow) {
		r := p.matchingRule(&a)
		ex.Policies = append(ex.Policies, PolicyResult{
			Namespace: p.namespace, Name: p.name,
			Action: p.src.GetAction().String(), Scope: p.scope.String(),
			Selector: maps.Clone(p.src.GetSelector()),
			Matched:  r >= 0, Rule: r, Problems: ProblemsOf(p.src),
		})
	}
	return ex
}
