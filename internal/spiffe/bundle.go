package spiffe

import (
	"bytes"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/spiffebundle"
	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

// Errors of TrustBundle.Verify, one per reason a chain is refused; callers
// count refusals with errors.Is.
var (
	// ErrNoCertificate: the chain is empty.
	ErrNoCertificate = errors.New("no certificate")
	// ErrNotSVID: the leaf is not an X509-SVID of a workload (no single
	// SPIFFE URI SAN of the form /ns/<ns>/sa/<sa>, or a CA certificate).
	ErrNotSVID = errors.New("not a workload X509-SVID")
	// ErrUnknownTrustDomain: the leaf names a trust domain that has no
	// roots in the bundle (it is not federated).
	ErrUnknownTrustDomain = errors.New("trust domain not in the trust bundle")
	// ErrUntrusted: the chain does not verify against the roots of the
	// trust domain the leaf names (another domain's root, expired, ...).
	ErrUntrusted = errors.New("not signed by a root of its trust domain")
)

// TrustBundle maps each trusted SPIFFE trust domain to its own X.509 roots
// (the domain's "bundle"). A certificate is verified against the roots of
// the trust domain it names and no other, so one domain's CA cannot mint
// identities of another. A TrustBundle is immutable and safe for concurrent
// use; it implements go-spiffe's x509bundle.Source.
//
// Its serialized form is the SPIFFE trust bundle map (the SPIFFE bundle
// format per trust domain, as gRPC's and Envoy's SPIFFE validators read it):
//
//	{"trust_domains": {"<trust domain>": {"keys": [{"use": "x509-svid", "kty": ..., "x5c": [...]}, ...]}, ...}}
type TrustBundle struct {
	domains map[string][]*x509.Certificate // never empty slices
}

// trustBundleDoc is the JSON document of a trust bundle map.
type trustBundleDoc struct {
	TrustDomains map[string]json.RawMessage `json:"trust_domains"`
}

// maxTrustBundleBytes bounds a serialized trust bundle (a Kubernetes
// ConfigMap holds at most 1 MiB).
const maxTrustBundleBytes = 4 << 20

// NewTrustBundle returns the bundle trusting, for each trust domain, the
// given roots. Every domain must be a valid trust domain name and have at
// least one root; roots must be CA certificates.
func NewTrustBundle(roots map[string][]*x509.Certificate) (*TrustBundle, error) {
	b := &TrustBundle{domains: make(map[string][]*x509.Certificate, len(roots))}
	for _, td := range slices.Sorted(maps.Keys(roots)) {
		if err := ValidateTrustDomain(td); err != nil {
			return nil, err
		}
		certs := roots[td]
		if len(certs) == 0 {
			return nil, fmt.Errorf("trust domain %q: no roots", td)
		}
		for i, c := range certs {
			if c == nil || !c.IsCA {
				return nil, fmt.Errorf("trust domain %q: root %d is not a CA certificate", td, i)
			}
		}
		b.domains[td] = dedupe(certs)
	}
	return b, nil
}

// TrustBundleFromPEM returns a bundle of one trust domain trusting every
// CERTIFICATE in pemRoots: a PEM root file, as meshes of one trust domain
// distribute their roots.
func TrustBundleFromPEM(trustDomain string, pemRoots []byte) (*TrustBundle, error) {
	certs, err := ParseCertificatesPEM(pemRoots)
	if err != nil {
		return nil, err
	}
	if len(certs) == 0 {
		return nil, errors.New("no CERTIFICATE in the PEM roots")
	}
	return NewTrustBundle(map[string][]*x509.Certificate{trustDomain: certs})
}

// ParseTrustBundle reads a SPIFFE trust bundle map. Every entry must be a
// valid trust domain with a bundle holding at least one X.509 authority;
// a document with any bad entry is refused whole, so that a reader keeps
// its previous bundle rather than silently losing a domain. JWT
// authorities are ignored (ztunnel verifies X509-SVIDs only).
func ParseTrustBundle(data []byte) (*TrustBundle, error) {
	if len(data) > maxTrustBundleBytes {
		return nil, fmt.Errorf("trust bundle of %d bytes exceeds %d", len(data), maxTrustBundleBytes)
	}
	var doc trustBundleDoc
	dec := json.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&doc); err != nil {
		return nil, fmt.Errorf("trust bundle: %w", err)
	}
	if dec.More() {
		return nil, errors.New("trust bundle: trailing data after the JSON document")
	}
	if doc.TrustDomains == nil {
		return nil, errors.New(`trust bundle: no "trust_domains" object`)
	}
	roots := make(map[string][]*x509.Certificate, len(doc.TrustDomains))
	for name, raw := range doc.TrustDomains {
		if err := ValidateTrustDomain(name); err != nil {
			return nil, fmt.Errorf("trust bundle: %w", err)
		}
		td, _ := spiffeid.TrustDomainFromString(name)
		sb, err := spiffebundle.Parse(td, raw)
		if err != nil {
			return nil, fmt.Errorf("trust bundle: trust domain %q: %w", name, err)
		}
		if len(sb.X509Authorities()) == 0 {
			return nil, fmt.Errorf("trust bundle: trust domain %q has no X.509 authority", name)
		}
		roots[name] = sb.X509Authorities()
	}
	b, err := NewTrustBundle(roots)
	if err != nil {
		return nil, fmt.Errorf("trust bundle: %w", err)
	}
	return b, nil
}

// Marshal writes the bundle as a SPIFFE trust bundle map: trust domains
// sorted, each domain's roots in their order, so that equal bundles marshal
// to equal bytes.
func (b *TrustBundle) Marshal() ([]byte, error) {
	doc := map[string]map[string]json.RawMessage{"trust_domains": {}}
	for _, name := range b.Domains() {
		td, err := spiffeid.TrustDomainFromString(name)
		if err != nil {
			return nil, err
		}
		raw, err := spiffebundle.FromX509Authorities(td, b.domains[name]).Marshal()
		if err != nil {
			return nil, fmt.Errorf("trust domain %q: %w", name, err)
		}
		doc["trust_domains"][name] = raw
	}
	return json.Marshal(doc)
}

// Domains returns the trusted trust domains, sorted.
func (b *TrustBundle) Domains() []string {
	if b == nil {
		return nil
	}
	return slices.Sorted(maps.Keys(b.domains))
}

// Has reports whether trustDomain is trusted.
func (b *TrustBundle) Has(trustDomain string) bool {
	if b == nil {
		return false
	}
	_, ok := b.domains[trustDomain]
	return ok
}

// Roots returns the roots of trustDomain (nil when it is not trusted). The
// slice is shared: do not modify it.
func (b *TrustBundle) Roots(trustDomain string) []*x509.Certificate {
	if b == nil {
		return nil
	}
	return b.domains[trustDomain]
}

// Pool returns one pool of the roots of every trusted domain, for TLS
// stacks that take a single pool; Verify must still check each chain
// against its own domain.
func (b *TrustBundle) Pool() *x509.CertPool {
	pool := x509.NewCertPool()
	if b == nil {
		return pool
	}
	for _, td := range b.Domains() {
		for _, c := range b.domains[td] {
			pool.AddCert(c)
		}
	}
	return pool
}

// Equal reports whether a and b trust the same roots for the same domains.
func (b *TrustBundle) Equal(o *TrustBundle) bool {
	if b == nil || o == nil {
		return b == o
	}
	return maps.EqualFunc(b.domains, o.domains, func(x, y []*x509.Certificate) bool {
		return slices.EqualFunc(x, y, func(p, q *x509.Certificate) bool { return p.Equal(q) })
	})
}

// String lists the trusted domains and how many roots each has.
func (b *TrustBundle) String() string {
	parts := make([]string, 0, len(b.Domains()))
	for _, td := range b.Domains() {
		parts = append(parts, fmt.Sprintf("%s(%d)", td, len(b.domains[td])))
	}
	return strings.Join(parts, " ")
}

// GetX509BundleForTrustDomain implements x509bundle.Source.
func (b *TrustBundle) GetX509BundleForTrustDomain(td spiffeid.TrustDomain) (*x509bundle.Bundle, error) {
	roots := b.Roots(td.Name())
	if roots == nil {
		return nil, fmt.Errorf("%w: %q", ErrUnknownTrustDomain, td.Name())
	}
	return x509bundle.FromX509Authorities(td, roots), nil
}

// Verify checks that chain (leaf first) is a workload X509-SVID that chains,
// at time now, to a root of the trust domain its identity names (go-spiffe's
// x509svid.Verify), and returns that identity. Errors wrap ErrNoCertificate,
// ErrNotSVID, ErrUnknownTrustDomain or ErrUntrusted.
func (b *TrustBundle) Verify(chain []*x509.Certificate, now time.Time) (Identity, error) {
	if len(chain) == 0 {
		return Identity{}, ErrNoCertificate
	}
	id, err := FromCertificate(chain[0])
	if err != nil {
		return Identity{}, fmt.Errorf("%w: %w", ErrNotSVID, err)
	}
	if !b.Has(id.TrustDomain) {
		return id, fmt.Errorf("%w: %s", ErrUnknownTrustDomain, id)
	}
	if _, _, err := x509svid.Verify(chain, b, x509svid.WithTime(now)); err != nil {
		if chain[0].IsCA || chain[0].KeyUsage&(x509.KeyUsageCertSign|x509.KeyUsageCRLSign) != 0 {
			return id, fmt.Errorf("%w: %w", ErrNotSVID, err)
		}
		return id, fmt.Errorf("%w: %s: %w", ErrUntrusted, id, err)
	}
	return id, nil
}

// ParseCertificatesPEM decodes every CERTIFICATE block of data, skipping
// other blocks.
func ParseCertificatesPEM(data []byte) ([]*x509.Certificate, error) {
	var out []*x509.Certificate
	for {
		var block *pem.Block
		block, data = pem.Decode(data)
		if block == nil {
			return out, nil
		}
		if block.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("parse certificate: %w", err)
		}
		out = append(out, c)
	}
}

// dedupe returns certs without repeats, in their first order.
func dedupe(certs []*x509.Certificate) []*x509.Certificate {
	out := make([]*x509.Certificate, 0, len(certs))
	for _, c := range certs {
		if !slices.ContainsFunc(out, c.Equal) {
			out = append(out, c)
		}
	}
	return out
}
