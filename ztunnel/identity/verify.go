package identity

import (
	"crypto/x509"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
)

// Sentinel errors returned by VerifyPeer; callers use errors.Is to count
// refusals by reason.
var (
	// ErrNoPeerCertificate means the peer presented no certificate.
	ErrNoPeerCertificate = errors.New("peer presented no certificate")
	// ErrUntrustedPeer means the peer chain does not verify against the roots.
	ErrUntrustedPeer = errors.New("peer certificate not signed by a trusted root")
	// ErrWrongTrustDomain means the peer identity is outside the trust domain.
	ErrWrongTrustDomain = errors.New("peer identity outside the trust domain")
	// ErrUnexpectedIdentity means the peer is not the identity the caller expected.
	ErrUnexpectedIdentity = errors.New("peer identity is not the expected one")
	// ErrNoIdentity means the peer certificate carries no usable SPIFFE identity.
	ErrNoIdentity = errors.New("peer certificate has no SPIFFE identity")
)

// PeerPolicy says which peer certificates are acceptable. Roots is required.
// If Allowed is not empty the peer must be one of those identities;
// otherwise, if TrustDomain is set, the peer must belong to it.
type PeerPolicy struct {
	Roots       *x509.CertPool
	TrustDomain string
	Allowed     []Identity
}

// VerifyPeer verifies a peer chain (leaf first) against p at time now and
// returns the peer identity. Errors wrap one of the sentinel errors above.
func VerifyPeer(chain []*x509.Certificate, p PeerPolicy, now time.Time) (Identity, error) {
	if len(chain) == 0 {
		return Identity{}, ErrNoPeerCertificate
	}
	inter := x509.NewCertPool()
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	_, err := chain[0].Verify(x509.VerifyOptions{
		Roots:         p.Roots,
		Intermediates: inter,
		CurrentTime:   now,
		KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageAny},
	})
	if err != nil {
		return Identity{}, fmt.Errorf("%w: %w", ErrUntrustedPeer, err)
	}
	id, err := FromCertificate(chain[0])
	if err != nil {
		return Identity{}, fmt.Errorf("%w: %w", ErrNoIdentity, err)
	}
	if len(p.Allowed) > 0 {
		if !slices.Contains(p.Allowed, id) {
			return id, fmt.Errorf("%w: got %s, want %s", ErrUnexpectedIdentity, id, describe(p.Allowed))
		}
		return id, nil
	}
	if p.TrustDomain != "" && id.TrustDomain != p.TrustDomain {
		return id, fmt.Errorf("%w: %s not in %s", ErrWrongTrustDomain, id, p.TrustDomain)
	}
	return id, nil
}

// describe renders an identity list for an error, naming at most three.
func describe(ids []Identity) string {
	var b strings.Builder
	for i, id := range ids[:min(len(ids), 3)] {
		if i > 0 {
			b.WriteString(" or ")
		}
		b.WriteString(id.String())
	}
	if len(ids) > 3 {
		fmt.Fprintf(&b, " (or %d more)", len(ids)-3)
	}
	return b.String()
}
