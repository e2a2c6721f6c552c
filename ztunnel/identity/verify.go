package identity

import (
	"crypto/x509"
	"errors"
	"fmt"
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
// If Expected is set the peer must be exactly that identity; otherwise, if
// TrustDomain is set, the peer must belong to it.
type PeerPolicy struct {
	Roots       *x509.CertPool
	TrustDomain string
	Expected    Identity
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
	if !p.Expected.IsZero() {
		if id != p.Expected {
			return id, fmt.Errorf("%w: got %s, want %s", ErrUnexpectedIdentity, id, p.Expected)
		}
		return id, nil
	}
	if p.TrustDomain != "" && id.TrustDomain != p.TrustDomain {
		return id, fmt.Errorf("%w: %s not in %s", ErrWrongTrustDomain, id, p.TrustDomain)
	}
	return id, nil
}
