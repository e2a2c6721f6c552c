// Package ztunnel is the Isthmus node proxy and east-west gateway. Its
// subpackages, from the outside in:
//
//   - node wires one process (node or gateway mode) from a Config;
//   - xdsclient follows pilot's delta xDS (workloads, services, policies)
//     into state, the local snapshot of the mesh;
//   - caclient obtains and renews workload certificates from pilot's CA,
//     identity holds SPIFFE identities and peer verification;
//   - inpod receives enrolled pods' network namespaces from the CNI node
//     agent, podproxy serves each pod from inside its namespace, netns
//     opens sockets there;
//   - proxy holds the outbound, inbound, gateway and SOCKS5 paths, hbone
//     the HBONE transport (HTTP/2 CONNECT over mTLS), authz the L4 policy
//     enforcement, dns the DNS proxy;
//   - metrics and admin are its Prometheus metrics and admin endpoints.
//
// ztunnel imports pilot/api (the wire types) and internal/ packages; of the
// rest of pilot only its test helpers import pilot/ca.
package ztunnel
