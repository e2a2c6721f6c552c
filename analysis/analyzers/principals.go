package analyzers

import (
	"strings"

	"github.com/isthmus-mesh/isthmus/analysis"
	"github.com/isthmus-mesh/isthmus/analysis/msg"
	"github.com/isthmus-mesh/isthmus/internal/spiffe"
)

// Principals reports AuthorizationPolicy principals of the mesh's trust
// domain (<trust-domain>/ns/<ns>/sa/<sa>, in rules[].from[].source
// principals and notPrincipals) that no cluster has: no ServiceAccount of
// that name where ServiceAccounts could be read, and no pod running under
// it anywhere (ISM0015). Principals with a `*`, of another trust domain, or
// not of that form are left alone: Istio allows them.
type Principals struct{}

// Name implements analysis.Analyzer.
func (Principals) Name() string { return "authorization-principals" }

// Analyze implements analysis.Analyzer.
func (Principals) Analyze(s *analysis.Snapshot) []msg.Message {
	known := knownAccounts(s)
	var out []msg.Message
	for _, c := range s.Clusters {
		for _, ap := range c.AuthorizationPolicies {
			res := objectResource(string(c.ID), "AuthorizationPolicy", ap.Namespace, ap.Name)
			seen := map[string]bool{}
			for _, rule := range ap.Spec.GetRules() {
				for _, from := range rule.GetFrom() {
					src := from.GetSource()
					for _, p := range append(src.GetPrincipals(), src.GetNotPrincipals()...) {
						id, ok := meshPrincipal(p, s.Mesh.TrustDomain)
						if !ok || seen[p] || known[id.Namespace+"/"+id.ServiceAccount] {
							continue
						}
						seen[p] = true
						out = append(out, msg.NewUnknownPrincipal(res, p, id.Namespace, id.ServiceAccount))
					}
				}
			}
		}
	}
	return out
}

// meshPrincipal parses an Istio principal of trust domain td.
func meshPrincipal(p, td string) (spiffe.Identity, bool) {
	if strings.Contains(p, "*") {
		return spiffe.Identity{}, false
	}
	id, err := spiffe.Parse("spiffe://" + strings.TrimPrefix(p, "spiffe://"))
	if err != nil || id.TrustDomain != td {
		return spiffe.Identity{}, false
	}
	return id, true
}

// knownAccounts is every namespace/name of a ServiceAccount or of a pod's
// service account in any cluster.
func knownAccounts(s *analysis.Snapshot) map[string]bool {
	known := map[string]bool{}
	for _, c := range s.Clusters {
		for _, sa := range c.ServiceAccounts {
			known[sa.Namespace+"/"+sa.Name] = true
		}
		for _, p := range c.Pods {
			known[p.Namespace+"/"+serviceAccount(p)] = true
		}
	}
	return known
}
