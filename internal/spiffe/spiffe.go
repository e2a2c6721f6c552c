// Package spiffe is the mesh's one notion of a workload identity, the SPIFFE
// ID spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>, and its
// one parser, built on github.com/spiffe/go-spiffe/v2. Pilot (CA, xDS
// authorization, resources) and ztunnel (peer verification) share it, so an
// identity that one accepts the other reads the same way.
//
// It also holds the one trust bundle type (TrustBundle: each trusted trust
// domain with its own roots, serialized as a SPIFFE trust bundle map) and
// the one certificate verification against it (TrustBundle.Verify, on
// go-spiffe's x509svid.Verify): pilot publishes the bundle, ztunnel and
// pilot's xDS server verify peers with it.
package spiffe

import (
	"crypto/x509"
	"errors"
	"fmt"
	"net/url"
	"strings"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

// Identity is a workload identity. The zero value means "no identity";
// Identity is comparable.
type Identity struct {
	TrustDomain    string
	Namespace      string
	ServiceAccount string
}

// ErrNotWorkloadID means a SPIFFE ID is valid but not of the form
// /ns/<namespace>/sa/<service-account>.
var ErrNotWorkloadID = errors.New("not spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>")

// New returns the identity of service account sa in namespace ns of trust
// domain td, checking that it forms a valid SPIFFE ID.
func New(td, ns, sa string) (Identity, error) {
	id := Identity{TrustDomain: td, Namespace: ns, ServiceAccount: sa}
	if _, err := id.ID(); err != nil {
		return Identity{}, err
	}
	return id, nil
}

// ID returns the identity as a go-spiffe ID.
func (id Identity) ID() (spiffeid.ID, error) {
	td, err := spiffeid.TrustDomainFromString(id.TrustDomain)
	if err != nil {
		return spiffeid.ID{}, fmt.Errorf("trust domain %q: %w", id.TrustDomain, err)
	}
	sid, err := spiffeid.FromSegments(td, "ns", id.Namespace, "sa", id.ServiceAccount)
	if err != nil {
		return spiffeid.ID{}, fmt.Errorf("identity %s/%s: %w", id.Namespace, id.ServiceAccount, err)
	}
	return sid, nil
}

// ValidateTrustDomain checks that td is a valid SPIFFE trust domain name.
func ValidateTrustDomain(td string) error {
	if strings.Contains(td, ":") {
		return fmt.Errorf("trust domain %q: a name, not a URI", td)
	}
	if _, err := spiffeid.TrustDomainFromString(td); err != nil {
		return fmt.Errorf("trust domain %q: %w", td, err)
	}
	return nil
}

// IsZero reports whether id is the zero identity.
func (id Identity) IsZero() bool { return id == Identity{} }

// String returns the SPIFFE URI of id, or "" for the zero identity.
func (id Identity) String() string {
	if id.IsZero() {
		return ""
	}
	return "spiffe://" + id.TrustDomain + "/ns/" + id.Namespace + "/sa/" + id.ServiceAccount
}

// URL returns id as a URL for a certificate's URI SAN.
func (id Identity) URL() *url.URL {
	return &url.URL{Scheme: "spiffe", Host: id.TrustDomain, Path: "/ns/" + id.Namespace + "/sa/" + id.ServiceAccount}
}

// Parse parses a workload identity from its SPIFFE URI.
func Parse(s string) (Identity, error) {
	sid, err := spiffeid.FromString(s)
	if err != nil {
		return Identity{}, fmt.Errorf("identity %q: %w", s, err)
	}
	return fromID(sid)
}

// FromURI parses a workload identity from a URI SAN.
func FromURI(u *url.URL) (Identity, error) {
	sid, err := spiffeid.FromURI(u)
	if err != nil {
		return Identity{}, fmt.Errorf("identity %q: %w", u, err)
	}
	return fromID(sid)
}

// FromCertificate returns the workload identity of a certificate, which must
// carry exactly one URI SAN, a SPIFFE ID (the X509-SVID rule).
func FromCertificate(cert *x509.Certificate) (Identity, error) {
	sid, err := x509svid.IDFromCert(cert)
	if err != nil {
		return Identity{}, err
	}
	return fromID(sid)
}

func fromID(sid spiffeid.ID) (Identity, error) {
	parts := strings.Split(strings.TrimPrefix(sid.Path(), "/"), "/")
	if len(parts) != 4 || parts[0] != "ns" || parts[2] != "sa" {
		return Identity{}, fmt.Errorf("identity %q: %w", sid, ErrNotWorkloadID)
	}
	return Identity{TrustDomain: sid.TrustDomain().Name(), Namespace: parts[1], ServiceAccount: parts[3]}, nil
}
