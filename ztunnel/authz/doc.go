// Package authz enforces, on a node ztunnel's inbound paths, the L4
// authorization pilot converts from Istio's security.istio.io/v1
// AuthorizationPolicy and PeerAuthentication (pilot/api/security/v1).
//
// A Store holds what pilot sent this node (the policies that may apply to
// its workloads and one binding per local workload) and publishes it as
// immutable Snapshots. Snapshot.Evaluate is the pure check:
//
//  1. a plaintext connection (the inbound plaintext port, 15006) is refused
//     when the destination's effective PeerAuthentication for the port is
//     STRICT (the default);
//  2. a connection matching any DENY policy that applies is refused;
//  3. if any ALLOW policy applies, the connection must match one;
//     otherwise it is allowed.
//
// The policies that apply to a workload are the mesh-wide ones, those of
// its namespace and the selector policies its binding names; a check walks
// only those (indexed when the snapshot is built). A workload without a
// binding, or whose binding names a policy not held, has unknown policies:
// its connections are refused (fail closed). Pilot sends a binding and the
// policies it needs in one response.
//
// # Attributes
//
// The source principal and namespace come from the verified peer
// certificate; a plaintext connection has none (positive principal and
// namespace fields never match it, negative ones always do). The
// destination address and port are the workload's. The source address is
// the source workload's, when it can be established (the caller decides,
// see ztunnel/proxy): an HBONE peer's address or the Forwarded header's
// claim count only when the state says that address belongs to a workload
// running as the verified peer identity; across networks it is unknown. An
// unknown source address never satisfies an IP field of an ALLOW policy and
// always satisfies one of a DENY policy, so neither lets through more than
// it would with the address known.
//
// # Enforcement
//
// An Enforcer admits connections (Admit), waiting a bounded time for the
// policies of a workload that has just appeared, counts refusals by
// deciding policy and reason (isthmus_authz_denied_total), and tracks the
// admitted connections: on every policy change Run checks them again and
// closes those now refused (isthmus_authz_revoked_total), as Istio's
// ztunnel does.
package authz
