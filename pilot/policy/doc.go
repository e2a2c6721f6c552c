// Package policy reads Istio's security.istio.io/v1 AuthorizationPolicy and
// PeerAuthentication from the config cluster (pilot's own, as Istio's
// primary does), converts their L4 part into Isthmus's authorization API
// (pilot/api/security/v1) and says which apply to which workload.
//
// Semantics (Istio's, for ztunnel):
//
//   - Scope: a policy in the root namespace (the control plane's) without a
//     selector is mesh-wide; one with a selector applies to the matching
//     workloads of every namespace. Elsewhere a policy applies to its
//     namespace's workloads, or to those its selector matches. By
//     namespace sameness a namespace means that namespace in every cluster.
//   - Principals are "<trust domain>/ns/<namespace>/sa/<service account>"
//     (the spiffe:// form is accepted too) and name identities of any
//     cluster; "*", "prefix*" and "*suffix" are Istio's forms. With
//     Config.TrustDomains, a principal of the mesh's domain, cluster.local
//     or an alias also matches the same account in every alias (Istio's
//     trustDomainAliases).
//   - Fail closed: an ALLOW rule holding anything ztunnel cannot check at L4
//     (methods, paths, hosts, request principals, headers, JWT claims...)
//     or a value that does not parse matches nothing; in a DENY rule such a
//     condition is left out, so the rule denies at L4 as if it held. CUSTOM
//     and AUDIT policies, and policies with targetRefs (waypoints,
//     gateways), are not enforced by ztunnel, as in Istio. Every such case
//     is a Problem of the policy: logged, counted in
//     isthmus_policy_problems{kind,reason} and listed by
//     /debug/authorizationz.
//   - PeerAuthentication: the oldest policy of each level (mesh: the root
//     namespace without a selector; namespace; workload: a selector outside
//     the root namespace) counts; a more specific level's mode replaces a
//     broader one's unless UNSET; port-level modes come from the workload
//     level; with none set the mode is STRICT. A root-namespace
//     PeerAuthentication with a selector applies to no workload (Istio's
//     code ignores it; see ConvertPeerAuthentication), which is reported.
//
// A Watcher keeps the current Snapshot; pilot/xds serves each node ztunnel
// the part of it that concerns the node (Snapshot.NodeResources).
package policy
