package policy_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"istio.io/api/security/v1beta1"
	typev1beta1 "istio.io/api/type/v1beta1"
	securityclient "istio.io/client-go/pkg/apis/security/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	securityv1 "github.com/isthmus-mesh/isthmus/pilot/api/security/v1"
	"github.com/isthmus-mesh/isthmus/pilot/policy"
)

// picker builds a policy from fuzz bytes: each choice takes a byte; a
// string is one of a pool of valid and invalid values, or raw bytes.
type picker struct{ b []byte }

func (p *picker) n(max int) int {
	if len(p.b) == 0 {
		return 0
	}
	v := int(p.b[0]) % max
	p.b = p.b[1:]
	return v
}

func (p *picker) str(pool []string) string {
	if i := p.n(len(pool) + 1); i < len(pool) {
		return pool[i]
	}
	n := min(p.n(24), len(p.b))
	s := string(p.b[:n])
	p.b = p.b[n:]
	return s
}

func (p *picker) list(pool []string) []string {
	var out []string
	for range p.n(4) {
		out = append(out, p.str(pool))
	}
	return out
}

var (
	fuzzPorts      = []string{"80", "8080", " 443 ", "65535", "0", "65536", "-1", "8o", ""}
	fuzzIPs        = []string{"10.0.0.1", "10.0.0.0/8", "10.1.2.3/16", "::1", "fd00::/8", "::ffff:10.0.0.1", " 10.1.2.3 ", "10.0.0.0/33", "1.2.3", ""}
	fuzzPrincipals = []string{"cluster.local/ns/a/sa/b", "spiffe://cluster.local/ns/a/sa/b", "td.one/ns/a/sa/*", "td.two/ns/b/sa/c", "other.td/ns/a/sa/b", "*", "*/ns/a/sa/*", "pre*", ""}
	fuzzNames      = []string{"a", "b*", "*", "*x", "ns/sa", "sa", ""}
	fuzzL7         = []string{"GET", "/path", "example.com", "*", ""}
	fuzzKeys       = []string{"source.ip", "destination.ip", "destination.port", "source.namespace", "source.principal", "request.headers[x]", "request.auth.claims[iss]", "connection.sni", ""}
)

// fuzzPolicy builds an AuthorizationPolicy in namespace "prod" or the root
// namespace from b.
func fuzzPolicy(b []byte) (*securityclient.AuthorizationPolicy, policy.TrustDomains) {
	p := &picker{b: b}
	ap := &securityclient.AuthorizationPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: []string{"prod", root}[p.n(2)], Name: "fuzz"}}
	tds := []policy.TrustDomains{{}, {Local: "td.one", Aliases: []string{"td.two"}}}[p.n(2)]
	spec := &ap.Spec
	spec.Action = v1beta1.AuthorizationPolicy_Action(p.n(5))
	if p.n(4) == 0 {
		spec.Selector = &typev1beta1.WorkloadSelector{MatchLabels: map[string]string{"app": p.str(fuzzNames)}}
	}
	if p.n(8) == 0 {
		spec.TargetRefs = []*typev1beta1.PolicyTargetReference{{Kind: "Service", Name: "s"}}
	}
	for range p.n(4) {
		r := &v1beta1.Rule{}
		for range p.n(3) {
			r.From = append(r.From, &v1beta1.Rule_From{Source: &v1beta1.Source{
				Principals: p.list(fuzzPrincipals), NotPrincipals: p.list(fuzzPrincipals),
				Namespaces: p.list(fuzzNames), NotNamespaces: p.list(fuzzNames),
				ServiceAccounts: p.list(fuzzNames), NotServiceAccounts: p.list(fuzzNames),
				IpBlocks: p.list(fuzzIPs), NotIpBlocks: p.list(fuzzIPs),
				RemoteIpBlocks: p.list(fuzzIPs), RequestPrincipals: p.list(fuzzPrincipals),
			}})
		}
		for range p.n(3) {
			r.To = append(r.To, &v1beta1.Rule_To{Operation: &v1beta1.Operation{
				Ports: p.list(fuzzPorts), NotPorts: p.list(fuzzPorts),
				Methods: p.list(fuzzL7), Paths: p.list(fuzzL7), Hosts: p.list(fuzzL7),
			}})
		}
		for range p.n(3) {
			key := p.str(fuzzKeys)
			pool := map[string][]string{"source.ip": fuzzIPs, "destination.ip": fuzzIPs, "destination.port": fuzzPorts, "source.principal": fuzzPrincipals}[key]
			if pool == nil {
				pool = fuzzNames
			}
			r.When = append(r.When, &v1beta1.Condition{Key: key, Values: p.list(pool), NotValues: p.list(pool)})
		}
		spec.Rules = append(spec.Rules, r)
	}
	return ap, tds
}

// FuzzConvertAuthorizationPolicy: any tenant may write an
// AuthorizationPolicy, and pilot converts it to the L4 form ztunnel
// enforces. Over policies built from pools of valid and invalid values (and
// raw bytes), the conversion never widens what an ALLOW policy allows: a
// rule with anything ztunnel cannot check is dropped, and reported; every
// other value of every kept rule is in the output, none silently left out.
// A DENY rule keeps every rule, leaving out only what it reports. Problems
// carry a reason from the fixed set (they become metric labels) and a field
// of the policy; the output keeps the policy's namespace and name.
func FuzzConvertAuthorizationPolicy(f *testing.F) {
	for _, seed := range []string{"", "\x00\x00\x00\x01\x00\x00\x01\x01\x02", "\x01\x01\x01\x00\x00\x00\x03\x02\x02\x02\x01\x05\x06\x07", "\x00\x00\x01\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x01\x02\x01\x05\x02\x06\x01\x00\x00\x00"} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		ap, tds := fuzzPolicy(b)
		got := policy.ConvertAuthorizationPolicyIn(root, tds, ap)
		if got.Namespace != ap.Namespace || got.Name != ap.Name {
			t.Fatalf("converted as %s/%s", got.Namespace, got.Name)
		}
		for _, pr := range got.Problems {
			if !slices.Contains(policy.Reasons, pr.GetReason()) {
				t.Fatalf("problem reason %q is not one of %v", pr.GetReason(), policy.Reasons)
			}
			if !strings.HasPrefix(pr.GetField(), "spec.") && !strings.HasPrefix(pr.GetField(), "rules[") {
				t.Fatalf("problem field %q names no field of the policy", pr.GetField())
			}
		}
		spec := &ap.Spec
		enforced := len(spec.TargetRefs) == 0 && (spec.Action == v1beta1.AuthorizationPolicy_ALLOW || spec.Action == v1beta1.AuthorizationPolicy_DENY)
		if !enforced {
			if got.Proto != nil || len(got.Problems) != 1 {
				t.Fatalf("action %v, targetRefs %v: want no L4 form and one problem, got %v, %v", spec.Action, spec.TargetRefs, got.Proto, got.Problems)
			}
			return
		}
		checkConverted(t, ap, got)
	})
}

// checkConverted checks an enforced policy's conversion rule by rule.
func checkConverted(t *testing.T, ap *securityclient.AuthorizationPolicy, got *policy.Policy) {
	spec, p := &ap.Spec, got.Proto
	deny := spec.Action == v1beta1.AuthorizationPolicy_DENY
	wantScope := securityv1.Scope_NAMESPACE
	if len(spec.GetSelector().GetMatchLabels()) > 0 {
		wantScope = securityv1.Scope_SELECTOR
	} else if ap.Namespace == root {
		wantScope = securityv1.Scope_MESH
	}
	if p == nil || p.GetScope() != wantScope || p.GetNamespace() != ap.Namespace {
		t.Fatalf("want an L4 form of scope %v in %s, got %v", wantScope, ap.Namespace, p)
	}
	reported := func(prefix string) bool {
		return slices.ContainsFunc(got.Problems, func(pr *securityv1.Problem) bool { return strings.HasPrefix(pr.GetField(), prefix) })
	}
	out := p.GetRules()
	for i, r := range spec.Rules {
		if !deny && reported(fmt.Sprintf("rules[%d].", i)) {
			continue // dropped: it matches nothing
		}
		if len(out) == 0 {
			t.Fatalf("rule %d (%v) is missing from the output, with no problem reported", i, r)
		}
		checkRule(t, fmt.Sprintf("rules[%d]", i), r, out[0], reported)
		out = out[1:]
	}
	if len(out) > 0 {
		t.Fatalf("%d rules more than the policy's kept rules", len(out))
	}
}

// checkRule checks that rule out holds every value of r that no problem
// names.
func checkRule(t *testing.T, path string, r *v1beta1.Rule, out *securityv1.Rule, reported func(string) bool) {
	clauses := out.GetClauses()
	next := func(what string) *securityv1.Clause {
		if len(clauses) == 0 {
			t.Fatalf("%s: the clause of %s is missing", path, what)
		}
		c := clauses[0]
		clauses = clauses[1:]
		return c
	}
	if len(r.From) > 0 {
		c := next("from")
		for j, f := range r.From {
			checkSource(t, fmt.Sprintf("%s.from[%d].source", path, j), f.GetSource(), c.GetMatches()[j], reported)
		}
	}
	if len(r.To) > 0 {
		c := next("to")
		for j, to := range r.To {
			at, o, m := fmt.Sprintf("%s.to[%d].operation", path, j), to.GetOperation(), c.GetMatches()[j]
			checkCount(t, at+".ports", len(o.Ports), len(m.GetDestinationPorts()), reported)
			checkCount(t, at+".notPorts", len(o.NotPorts), len(m.GetNotDestinationPorts()), reported)
			checkPorts(t, at, append(m.GetDestinationPorts(), m.GetNotDestinationPorts()...))
		}
	}
	for k, w := range r.When {
		if reported(fmt.Sprintf("%s.when[%d] ", path, k)) {
			continue
		}
		m := next(fmt.Sprintf("when[%d]", k)).GetMatches()[0]
		n := len(m.GetSourceIps()) + len(m.GetDestinationIps()) + len(m.GetDestinationPorts()) + len(m.GetNamespaces()) + len(m.GetPrincipals())
		notN := len(m.GetNotSourceIps()) + len(m.GetNotDestinationIps()) + len(m.GetNotDestinationPorts()) + len(m.GetNotNamespaces()) + len(m.GetNotPrincipals())
		if n < len(w.Values) || notN < len(w.NotValues) {
			t.Fatalf("%s.when[%d] (%s): %d values and %d not-values became %d and %d", path, k, w.Key, len(w.Values), len(w.NotValues), n, notN)
		}
		checkPorts(t, path, append(m.GetDestinationPorts(), m.GetNotDestinationPorts()...))
	}
	if len(clauses) > 0 {
		t.Fatalf("%s: %d clauses more than the rule has", path, len(clauses))
	}
}

func checkSource(t *testing.T, at string, s *v1beta1.Source, m *securityv1.Match, reported func(string) bool) {
	checkCount(t, at+".ipBlocks", len(s.IpBlocks), len(m.GetSourceIps()), reported)
	checkCount(t, at+".notIpBlocks", len(s.NotIpBlocks), len(m.GetNotSourceIps()), reported)
	if reported(at + ".serviceAccounts") {
		return
	}
	// Principals may expand to trust-domain aliases; service accounts are
	// principals when set alone.
	if len(m.GetPrincipals()) < len(s.Principals)+len(s.ServiceAccounts) || len(m.GetNotPrincipals()) < len(s.NotPrincipals)+len(s.NotServiceAccounts) ||
		len(m.GetNamespaces()) != len(s.Namespaces) || len(m.GetNotNamespaces()) != len(s.NotNamespaces) {
		t.Fatalf("%s: %v converted to %v", at, s, m)
	}
}

// checkCount checks that the n values of field became out values, unless
// a problem names the field.
func checkCount(t *testing.T, field string, n, out int, reported func(string) bool) {
	if reported(field) {
		if out != 0 {
			t.Fatalf("%s is reported, yet %d values of it are kept", field, out)
		}
		return
	}
	if out != n {
		t.Fatalf("%s: %d values became %d, with no problem reported", field, n, out)
	}
}

func checkPorts(t *testing.T, at string, ports []uint32) {
	for _, port := range ports {
		if port == 0 || port > 65535 {
			t.Fatalf("%s: port %d", at, port)
		}
	}
}
