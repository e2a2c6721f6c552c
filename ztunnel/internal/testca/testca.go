// Package testca is a small in-process SPIFFE certificate authority
// (ECDSA P-256) for ztunnel tests and benchmarks. It implements
// identity.CertSource. It is not meant for production use.
package testca

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"math/big"
	"net/url"
	"sync/atomic"
	"time"

	"github.com/isthmus-mesh/isthmus/internal/spiffe"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
)

// CA signs workload certificates for one trust domain. Safe for concurrent use.
type CA struct {
	TrustDomain string
	root        *x509.Certificate
	key         *ecdsa.PrivateKey
	bundle      atomic.Pointer[spiffe.TrustBundle]
	serial      atomic.Int64
	issued      atomic.Int64
}

// New returns a CA with a fresh self-signed root for trustDomain.
func New(trustDomain string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{Organization: []string{trustDomain}, CommonName: "test root " + trustDomain},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	root, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	bundle, err := spiffe.NewTrustBundle(map[string][]*x509.Certificate{trustDomain: {root}})
	if err != nil {
		return nil, err
	}
	ca := &CA{TrustDomain: trustDomain, root: root, key: key}
	ca.bundle.Store(bundle)
	ca.serial.Store(1)
	return ca, nil
}

// Root returns the CA's root certificate.
func (ca *CA) Root() *x509.Certificate { return ca.root }

// TrustBundle returns the domains the CA's holders trust: its own, with its
// root, and those of the CAs it federates with.
func (ca *CA) TrustBundle() *spiffe.TrustBundle { return ca.bundle.Load() }

// Federate makes the holders of ca's certificates also trust the identities
// of others' trust domains, each verified against its own CA's root.
func (ca *CA) Federate(others ...*CA) error {
	roots := map[string][]*x509.Certificate{}
	cur := ca.bundle.Load()
	for _, td := range cur.Domains() {
		roots[td] = cur.Roots(td)
	}
	for _, o := range others {
		roots[o.TrustDomain] = append(roots[o.TrustDomain], o.root)
	}
	next, err := spiffe.NewTrustBundle(roots)
	if err != nil {
		return err
	}
	ca.bundle.Store(next)
	return nil
}

// Issued returns how many leaf certificates the CA has signed.
func (ca *CA) Issued() int64 { return ca.issued.Load() }

// Certificate signs a fresh leaf for id. It refuses identities outside its
// trust domain, as a real CA would.
func (ca *CA) Certificate(_ context.Context, id identity.Identity) (*tls.Certificate, error) {
	if id.TrustDomain != ca.TrustDomain {
		return nil, fmt.Errorf("testca: %s is not in trust domain %s", id, ca.TrustDomain)
	}
	return ca.Sign(id)
}

// Sign signs a leaf for any identity, even outside the trust domain, so tests
// can build deliberately wrong peers.
func (ca *CA) Sign(id identity.Identity) (*tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(ca.serial.Add(1)),
		NotBefore:    time.Now().Add(-time.Minute),
		NotAfter:     time.Now().Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		URIs:         []*url.URL{id.URL()},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.root, &key.PublicKey, ca.key)
	if err != nil {
		return nil, err
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	ca.issued.Add(1)
	return &tls.Certificate{Certificate: [][]byte{der, ca.root.Raw}, PrivateKey: key, Leaf: leaf}, nil
}
