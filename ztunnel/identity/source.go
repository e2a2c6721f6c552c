package identity

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/isthmus-mesh/isthmus/internal/spiffe"
)

// CertSource issues workload certificates. The CA client implements it; tests
// use an in-process CA. Implementations must be safe for concurrent use.
type CertSource interface {
	// Certificate returns a certificate chain and key for id. The leaf must
	// carry id as its only SPIFFE URI SAN; Leaf should be populated.
	Certificate(ctx context.Context, id Identity) (*tls.Certificate, error)
	// TrustBundle returns the trust domains whose identities are
	// accepted, each with its own roots: a peer is verified against the
	// roots of the domain it names. It may change between calls (a root
	// rotation, a newly federated domain); callers read it for every
	// verification.
	TrustBundle() *spiffe.TrustBundle
}

// Cache is a CertSource that keeps one certificate per identity and asks the
// underlying source again once half of the certificate lifetime has passed.
// It is safe for concurrent use.
type Cache struct {
	src   CertSource
	now   func() time.Time
	mu    sync.Mutex
	certs map[Identity]*tls.Certificate
}

// NewCache returns a caching CertSource in front of src.
func NewCache(src CertSource) *Cache {
	return &Cache{src: src, now: time.Now, certs: map[Identity]*tls.Certificate{}}
}

// Certificate returns the cached certificate for id or fetches a new one.
func (c *Cache) Certificate(ctx context.Context, id Identity) (*tls.Certificate, error) {
	c.mu.Lock()
	cert, ok := c.certs[id]
	c.mu.Unlock()
	if ok && c.fresh(cert) {
		return cert, nil
	}
	cert, err := c.src.Certificate(ctx, id)
	if err != nil {
		return nil, fmt.Errorf("certificate for %s: %w", id, err)
	}
	if cert.Leaf == nil && len(cert.Certificate) > 0 {
		leaf, err := x509.ParseCertificate(cert.Certificate[0])
		if err != nil {
			return nil, fmt.Errorf("certificate for %s: %w", id, err)
		}
		cert.Leaf = leaf
	}
	c.mu.Lock()
	c.certs[id] = cert
	c.mu.Unlock()
	return cert, nil
}

func (c *Cache) fresh(cert *tls.Certificate) bool {
	if cert.Leaf == nil {
		return false
	}
	half := cert.Leaf.NotBefore.Add(cert.Leaf.NotAfter.Sub(cert.Leaf.NotBefore) / 2)
	return c.now().Before(half)
}

// TrustBundle returns the trust bundle of the underlying source.
func (c *Cache) TrustBundle() *spiffe.TrustBundle { return c.src.TrustBundle() }

// CertInfo describes a cached certificate without its private key.
type CertInfo struct {
	Identity  string    `json:"identity"`
	Serial    string    `json:"serial"`
	NotBefore time.Time `json:"notBefore"`
	NotAfter  time.Time `json:"notAfter"`
	ChainPEM  string    `json:"chainPem"`
}

// Dump returns the cached certificates (public parts only), sorted by identity.
func (c *Cache) Dump() []CertInfo {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]CertInfo, 0, len(c.certs))
	for id, cert := range c.certs {
		var b strings.Builder
		for _, der := range cert.Certificate {
			_ = pem.Encode(&b, &pem.Block{Type: "CERTIFICATE", Bytes: der})
		}
		info := CertInfo{Identity: id.String(), ChainPEM: b.String()}
		if cert.Leaf != nil {
			info.Serial = cert.Leaf.SerialNumber.Text(16)
			info.NotBefore = cert.Leaf.NotBefore
			info.NotAfter = cert.Leaf.NotAfter
		}
		out = append(out, info)
	}
	slices.SortFunc(out, func(a, b CertInfo) int { return strings.Compare(a.Identity, b.Identity) })
	return out
}
