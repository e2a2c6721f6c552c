package identity

import (
	"crypto/x509"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/isthmus-mesh/isthmus/internal/spiffe"
)

// Sentinel errors returned by VerifyPeer; callers use errors.Is to count
// refusals by reason. They are internal/spiffe's verification errors, so
// a chain refused there is refused here for the same reason.
var (
	// ErrNoPeerCertificate means the peer presented no certificate.
	ErrNoPeerCertificate = spiffe.ErrNoCertificate
	// ErrUntrustedPeer means the peer chain does not verify against the
	// roots of the trust domain it names.
	ErrUntrustedPeer = spiffe.ErrUntrusted
	// ErrWrongTrustDomain means the peer's trust domain is not trusted: it
	// has no roots in the trust bundle (it is not federated).
	ErrWrongTrustDomain = spiffe.ErrUnknownTrustDomain
	// ErrNoIdentity means the peer certificate carries no usable SPIFFE identity.
	ErrNoIdentity = spiffe.ErrNotSVID
	// ErrUnexpectedIdentity means the peer is not the identity the caller expected.
	ErrUnexpectedIdentity = errors.New("peer identity is not the expected one")
)

// PeerPolicy says which peer certificates are acceptable. Bundle is
// required: the peer's chain must verify against the roots of the trust
// domain its identity names (any domain of the bundle). If Allowed is not
// empty the peer must also be one of those identities.
type PeerPolicy struct {
	Bundle  *spiffe.TrustBundle
	Allowed []Identity
}

// VerifyPeer verifies a peer chain (leaf first) against p at time now and
// returns the peer identity. Errors wrap one of the sentinel errors above.
func VerifyPeer(chain []*x509.Certificate, p PeerPolicy, now time.Time) (Identity, error) {
	id, err := p.Bundle.Verify(chain, now)
	if err != nil {
		return id, err
	}
	if len(p.Allowed) > 0 && !slices.Contains(p.Allowed, id) {
		return id, fmt.Errorf("%w: got %s, want %s", ErrUnexpectedIdentity, id, describe(p.Allowed))
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
