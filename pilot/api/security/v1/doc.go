// Package securityv1 holds the generated Go types of the Isthmus
// authorization API (authorization.proto): the L4 form of Istio's
// AuthorizationPolicy and PeerAuthentication that pilot serves to node
// ztunnels over delta xDS. Regenerate with hack/gen-proto.sh.
package securityv1

// TypeURL is the xDS type URL of Authorization resources.
const TypeURL = "type.googleapis.com/isthmus.security.v1.Authorization"

// Resource name prefixes: "policy/<namespace>/<name>" names a Policy,
// "workload/<uid>" a WorkloadPolicies.
const (
	PolicyPrefix   = "policy/"
	WorkloadPrefix = "workload/"
)

// PolicyName returns the resource name of policy name in namespace ns.
func PolicyName(ns, name string) string { return PolicyPrefix + ns + "/" + name }

// WorkloadName returns the resource name of the WorkloadPolicies of uid.
func WorkloadName(uid string) string { return WorkloadPrefix + uid }
