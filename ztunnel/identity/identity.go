// Package identity holds SPIFFE workload identities, the CertSource interface
// through which ztunnel obtains workload certificates and the trust bundle,
// a caching CertSource, and the peer-verification rules used by every HBONE
// hop: a peer is verified against the roots of its own trust domain
// (internal/spiffe's TrustBundle), then against the identities expected.
package identity

import (
	"crypto/x509"

	"github.com/isthmus-mesh/isthmus/internal/spiffe"
)

// Identity is a SPIFFE workload identity spiffe://<td>/ns/<ns>/sa/<sa> (the
// mesh's one identity type, internal/spiffe). The zero value means "no
// identity". Identity is a comparable value.
type Identity = spiffe.Identity

// Parse parses a SPIFFE URI of the form spiffe://<td>/ns/<ns>/sa/<sa>.
func Parse(s string) (Identity, error) { return spiffe.Parse(s) }

// FromCertificate returns the identity in the single URI SAN of cert.
func FromCertificate(cert *x509.Certificate) (Identity, error) { return spiffe.FromCertificate(cert) }
