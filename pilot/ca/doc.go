// Package ca is the mesh certificate authority of the Isthmus control plane: it keeps a root of
// trust in the config cluster, signs SPIFFE workload certificates over Istio's CSR API
// (istio.v1.auth.IstioCertificateService/CreateCertificate) for callers of any federated cluster,
// lets trusted node proxies (ztunnel) ask for the identities of pods on their own node, and
// publishes the root bundle to every cluster.
//
// # Root of trust
//
// At Init the CA reads the operator's plug-in Secret "cacerts" (keys ca-cert.pem, ca-key.pem,
// cert-chain.pem, root-cert.pem, as Istio's plug-in CA) in the control-plane namespace of the config
// cluster. Without it, it reads the self-signed Secret "isthmus-ca-secret" and, when that is absent
// too, creates an ECDSA P-256 root and an issuing intermediate and stores them there with a create
// that fails on conflict: of two replicas racing, the loser re-reads the winner's Secret, so every
// replica and every restart signs under the same root. The root's private key of a self-signed CA is
// never stored: only the intermediate signs.
//
// # Certificates
//
// A caller authenticates with a Kubernetes ServiceAccount token in the "authorization: Bearer"
// gRPC metadata, reviewed with TokenReview (audiences Config.Audiences) in the cluster named by the
// "clusterid" metadata (the config cluster when absent). The leaf's only SAN is the caller's
// spiffe://<trust-domain>/ns/<ns>/sa/<sa>; a CSR naming any other identity is refused. A caller whose
// ServiceAccount is in Config.TrustedNodeAccounts may set the request metadata field
// "ImpersonatedIdentity" to the SPIFFE ID of a ServiceAccount that has a pod on the caller's own node
// in the caller's cluster. The response chain is [leaf, intermediates..., root].
//
// Before any TokenReview a token is prefiltered (form, algorithm, expiry, ServiceAccount subject,
// audience, the cluster's issuer, and its signature against the cluster's own keys from its OIDC
// discovery), and a review is rate-limited per source address, per claimed ServiceAccount and per
// cluster, so that floods of bad tokens cannot starve valid ones (docs/security.md, "The CA").
//
// A node account's own certificate (no impersonation) requires a token bound to its pod and is
// bound to that pod's cluster and node by a non-critical extension (internal/nodebind), which
// pilot's xDS server holds the node account's NODE_NAME to.
//
// # Trust domains
//
// Config.TrustDomain is the mesh's domain, whose material is the Secret above. A cluster may be in
// a domain of its own (AssignTrustDomain, from its remote Secret's annotation
// security.isthmus.io/trust-domain): its callers are issued identities there, signed by that
// domain's CA, which a trust-domain Secret (label security.isthmus.io/trust-domain-ca=true,
// annotation security.isthmus.io/trust-domain, Istio's plug-in keys) gives; a trust-domain Secret
// with root-cert.pem only makes its domain trusted without issuing in it. TrustBundle is every
// trusted domain with its own roots; the publishers write it as a SPIFFE trust bundle map (key
// trust-bundle.json) and ServerTLSConfig verifies client certificates against it, each against
// its own domain's roots. See docs/trust-domains.md.
//
// # Rotation
//
// Leaves live Config.DefaultTTL (24 h) unless the request asks otherwise, capped by Config.MaxTTL;
// clients renew at half of their life (RenewAt). The serving certificate made by ServingCertificate
// follows the same rule through ServerTLSConfig.
//
// Root rotation keeps both roots trusted while they overlap, because the published bundle
// (ConfigMap "isthmus-ca-root-cert", key root-cert.pem) may hold several roots:
//
//  1. Put the new root next to the old one in root-cert.pem of "cacerts" (old root first, the
//     signing material unchanged). Replicas that Run reload it by themselves; others need a
//     restart or Reload.
//     The publishers write both roots to every cluster; wait until every proxy has picked up the new
//     bundle (at most one leaf lifetime).
//  2. Replace ca-cert.pem, ca-key.pem and cert-chain.pem by an intermediate issued by the new root,
//     keeping both roots in root-cert.pem (one Secret update, so no replica sees a half-done
//     change). New leaves chain to the new root; old leaves still verify against the old one.
//  3. After Config.MaxTTL (every old leaf has expired or been renewed), remove the old root from
//     root-cert.pem.
//
// A self-signed CA rotates the same way once its material is copied into "cacerts".
//
// # Permissions
//
// In the config cluster: get, list, watch and create Secrets in the control-plane namespace (the
// CA Secrets and the trust-domain Secrets). In every
// federated cluster (the remote reader account): create TokenReviews, get Pods (impersonation and
// node binding), get the OIDC discovery URLs /.well-known/openid-configuration and
// /openid/v1/jwks (granted to every ServiceAccount by Kubernetes' default
// system:service-account-issuer-discovery binding), and get, list, watch, create and update
// ConfigMaps in the control-plane namespace (publisher).
//
// # Concurrency
//
// A CA is safe for concurrent use once Init has returned: signing material is swapped atomically by
// Reload (which Run calls on every change of a CA Secret) and every request reads one consistent
// snapshot. A CA loaded from the plug-in Secret never falls back to a self-signed root.
package ca
