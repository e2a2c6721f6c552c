// Package identity holds SPIFFE workload identities, the CertSource interface
// through which ztunnel obtains workload certificates, a caching CertSource,
// and the peer-verification rules used by every HBONE hop.
package identity

import (
	"crypto/x509"
	"errors"
	"fmt"
	"net/url"
	"strings"
)

// Identity is a SPIFFE workload identity spiffe://<td>/ns/<ns>/sa/<sa>.
// The zero value means "no identity". Identity is a comparable value.
type Identity struct {
	TrustDomain    string
	Namespace      string
	ServiceAccount string
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

// URL returns id as a URL suitable for a certificate URI SAN.
func (id Identity) URL() *url.URL {
	return &url.URL{Scheme: "spiffe", Host: id.TrustDomain, Path: "/ns/" + id.Namespace + "/sa/" + id.ServiceAccount}
}

// Parse parses a SPIFFE URI of the form spiffe://<td>/ns/<ns>/sa/<sa>.
func Parse(s string) (Identity, error) {
	rest, ok := strings.CutPrefix(s, "spiffe://")
	if !ok {
		return Identity{}, fmt.Errorf("identity %q: not a spiffe URI", s)
	}
	parts := strings.Split(rest, "/")
	if len(parts) != 5 || parts[1] != "ns" || parts[3] != "sa" || parts[0] == "" || parts[2] == "" || parts[4] == "" {
		return Identity{}, fmt.Errorf("identity %q: want spiffe://<td>/ns/<ns>/sa/<sa>", s)
	}
	return Identity{TrustDomain: parts[0], Namespace: parts[2], ServiceAccount: parts[4]}, nil
}

// FromCertificate returns the identity in the single SPIFFE URI SAN of cert.
func FromCertificate(cert *x509.Certificate) (Identity, error) {
	var found []Identity
	for _, u := range cert.URIs {
		if u.Scheme != "spiffe" {
			continue
		}
		id, err := Parse(u.String())
		if err != nil {
			return Identity{}, err
		}
		found = append(found, id)
	}
	switch len(found) {
	case 0:
		return Identity{}, errors.New("certificate has no SPIFFE URI SAN")
	case 1:
		return found[0], nil
	default:
		return Identity{}, errors.New("certificate has more than one SPIFFE URI SAN")
	}
}
