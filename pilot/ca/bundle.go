package ca

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net/url"
	"time"

	"github.com/isthmus-mesh/isthmus/internal/spiffe"
)

// Keys of the CA Secrets (Istio's plug-in CA layout, used for the self-signed Secret too).
const (
	caCertKey    = "ca-cert.pem"
	caKeyKey     = "ca-key.pem"
	certChainKey = "cert-chain.pem"
)

// clockSkew backdates NotBefore so that a peer whose clock is slightly behind accepts a fresh
// certificate.
const clockSkew = time.Minute

// bundle is one immutable snapshot of signing material.
type bundle struct {
	signer   crypto.Signer
	issuer   *x509.Certificate   // signs leaves
	chain    []*x509.Certificate // issuer, then its issuers up to but excluding the root
	chainPEM []string            // PEM of chain, one certificate each
	root     *x509.Certificate   // the root the chain ends in
	rootPEM  string
	roots    []*x509.Certificate // the whole trusted bundle (several during rotation)
	rootsPEM []byte              // the published bundle
	notAfter time.Time           // no leaf may outlive the chain
	source   string              // the Secret it came from, "secret/<name>"
}

// parseBundle checks and assembles Istio plug-in CA material: the issuing certificate and key, the
// chain from the issuer upwards (roots and the issuer itself may appear in it and are dropped),
// and the trusted roots (one or more).
func parseBundle(caCertPEM, caKeyPEM, certChainPEM, rootCertPEM []byte, now time.Time) (*bundle, error) {
	issuers, err := spiffe.ParseCertificatesPEM(caCertPEM)
	if err != nil || len(issuers) == 0 {
		return nil, errors.Join(fmt.Errorf("%s: no certificate", caCertKey), err)
	}
	issuer := issuers[0]
	if !issuer.IsCA || issuer.KeyUsage&x509.KeyUsageCertSign == 0 {
		return nil, fmt.Errorf("%s: certificate is not a CA allowed to sign certificates", caCertKey)
	}
	signer, err := parsePrivateKey(caKeyPEM)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", caKeyKey, err)
	}
	if !publicKeysEqual(signer.Public(), issuer.PublicKey) {
		return nil, fmt.Errorf("%s does not match the key of %s", caKeyKey, caCertKey)
	}
	roots, err := spiffe.ParseCertificatesPEM(rootCertPEM)
	if err != nil || len(roots) == 0 {
		return nil, errors.Join(fmt.Errorf("%s: no certificate", RootCertKey), err)
	}
	chainCerts, err := spiffe.ParseCertificatesPEM(certChainPEM)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", certChainKey, err)
	}
	rootPool, interPool := x509.NewCertPool(), x509.NewCertPool()
	for _, r := range roots {
		rootPool.AddCert(r)
	}
	for _, c := range chainCerts {
		interPool.AddCert(c)
	}
	verified, err := issuer.Verify(x509.VerifyOptions{
		Roots: rootPool, Intermediates: interPool, CurrentTime: now,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny},
	})
	if err != nil {
		return nil, fmt.Errorf("%s does not chain to %s: %w", caCertKey, RootCertKey, err)
	}
	path := verified[0]
	b := &bundle{signer: signer, issuer: issuer, root: path[len(path)-1], roots: roots}
	b.chain = path[:len(path)-1]
	b.notAfter = b.root.NotAfter
	for _, c := range b.chain {
		b.chainPEM = append(b.chainPEM, encodeCert(c.Raw))
		if c.NotAfter.Before(b.notAfter) {
			b.notAfter = c.NotAfter
		}
	}
	b.rootPEM = encodeCert(b.root.Raw)
	for _, r := range roots {
		b.rootsPEM = append(b.rootsPEM, encodeCert(r.Raw)...)
	}
	return b, nil
}

// generateSelfSigned makes a new ECDSA P-256 root and an intermediate issued by it, and returns
// them in the plug-in layout. The root key is discarded.
func generateSelfSigned(trustDomain string, ttl time.Duration, now time.Time) (map[string][]byte, error) {
	rootKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate root key: %w", err)
	}
	interKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate intermediate key: %w", err)
	}
	notBefore, notAfter := now.Add(-clockSkew), now.Add(ttl)
	rootTmpl := &x509.Certificate{
		Subject:               pkix.Name{Organization: []string{trustDomain}, CommonName: "Isthmus Root CA"},
		NotBefore:             notBefore,
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLen:            1,
	}
	if rootTmpl.SerialNumber, err = serial(); err != nil {
		return nil, err
	}
	rootDER, err := x509.CreateCertificate(rand.Reader, rootTmpl, rootTmpl, rootKey.Public(), rootKey)
	if err != nil {
		return nil, fmt.Errorf("sign root: %w", err)
	}
	root, err := x509.ParseCertificate(rootDER)
	if err != nil {
		return nil, fmt.Errorf("parse root: %w", err)
	}
	interTmpl := &x509.Certificate{
		Subject:               pkix.Name{Organization: []string{trustDomain}, CommonName: "Isthmus Intermediate CA"},
		NotBefore:             notBefore,
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	if interTmpl.SerialNumber, err = serial(); err != nil {
		return nil, err
	}
	interDER, err := x509.CreateCertificate(rand.Reader, interTmpl, root, interKey.Public(), rootKey)
	if err != nil {
		return nil, fmt.Errorf("sign intermediate: %w", err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(interKey)
	if err != nil {
		return nil, fmt.Errorf("marshal intermediate key: %w", err)
	}
	interPEM, rootPEM := encodeCert(interDER), encodeCert(rootDER)
	return map[string][]byte{
		caCertKey:    []byte(interPEM),
		caKeyKey:     pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}),
		certChainKey: []byte(interPEM + rootPEM),
		RootCertKey:  []byte(rootPEM),
	}, nil
}

// leafRequest is what a leaf is made of once the caller has been authorized.
type leafRequest struct {
	publicKey  any
	uris       []*url.URL
	dnsNames   []string
	extensions []pkix.Extension // non-critical extensions of the CA's own (never from a CSR)
	ttl        time.Duration
}

// signLeaf issues an end-entity certificate for both TLS client and server use. The lifetime is
// cut to the chain's own end.
func (b *bundle) signLeaf(req leafRequest, now time.Time) (*x509.Certificate, error) {
	sn, err := serial()
	if err != nil {
		return nil, err
	}
	notAfter := now.Add(req.ttl)
	if notAfter.After(b.notAfter) {
		notAfter = b.notAfter
	}
	tmpl := &x509.Certificate{
		SerialNumber:          sn,
		NotBefore:             now.Add(-clockSkew),
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
		URIs:                  req.uris,
		ExtraExtensions:       req.extensions,
	}
	for _, n := range req.dnsNames {
		if ip := parseIP(n); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, n)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, b.issuer, req.publicKey, b.signer)
	if err != nil {
		return nil, fmt.Errorf("sign leaf: %w", err)
	}
	return x509.ParseCertificate(der)
}

// responseChain is Istio's response shape: [leaf, intermediates..., root], one PEM each.
func (b *bundle) responseChain(leaf *x509.Certificate) []string {
	out := make([]string, 0, len(b.chainPEM)+2)
	out = append(out, encodeCert(leaf.Raw))
	out = append(out, b.chainPEM...)
	return append(out, b.rootPEM)
}

// parseCSR decodes and checks a PEM certificate request: well formed, self-signature valid, and
// a public key a peer will accept.
func parseCSR(csrPEM string) (*x509.CertificateRequest, error) {
	block, _ := pem.Decode([]byte(csrPEM))
	if block == nil {
		return nil, errors.New("no PEM block")
	}
	if block.Type != "CERTIFICATE REQUEST" && block.Type != "NEW CERTIFICATE REQUEST" {
		return nil, fmt.Errorf("PEM block is %q, not a CERTIFICATE REQUEST", block.Type)
	}
	csr, err := x509.ParseCertificateRequest(block.Bytes)
	if err != nil {
		return nil, fmt.Errorf("parse: %w", err)
	}
	if err := csr.CheckSignature(); err != nil {
		return nil, fmt.Errorf("signature: %w", err)
	}
	if err := acceptableKey(csr.PublicKey); err != nil {
		return nil, err
	}
	return csr, nil
}

func acceptableKey(k any) error {
	switch k := k.(type) {
	case *ecdsa.PublicKey:
		switch k.Curve {
		case elliptic.P256(), elliptic.P384(), elliptic.P521():
			return nil
		}
		return errors.New("unsupported ECDSA curve")
	case *rsa.PublicKey:
		if k.N.BitLen() < 2048 {
			return fmt.Errorf("RSA key of %d bits is below 2048", k.N.BitLen())
		}
		return nil
	case ed25519.PublicKey:
		return nil
	default:
		return fmt.Errorf("unsupported public key type %T", k)
	}
}

// checkCSRIdentity refuses a CSR that names any identity but want: its SANs are never copied,
// but a request for another identity is a mistake or an attack and is reported as such.
func checkCSRIdentity(csr *x509.CertificateRequest, want string) error {
	for _, u := range csr.URIs {
		if u.String() != want {
			return fmt.Errorf("CSR asks for %q, caller may only have %q", u.String(), want)
		}
	}
	if len(csr.DNSNames)+len(csr.IPAddresses)+len(csr.EmailAddresses) > 0 {
		return fmt.Errorf("CSR asks for DNS, IP or email SANs; caller may only have %q", want)
	}
	return nil
}

func parsePrivateKey(data []byte) (crypto.Signer, error) {
	block, _ := pem.Decode(data)
	if block == nil {
		return nil, errors.New("no PEM block")
	}
	if k, err := x509.ParsePKCS8PrivateKey(block.Bytes); err == nil {
		s, ok := k.(crypto.Signer)
		if !ok {
			return nil, fmt.Errorf("key type %T cannot sign", k)
		}
		return s, nil
	}
	if k, err := x509.ParseECPrivateKey(block.Bytes); err == nil {
		return k, nil
	}
	if k, err := x509.ParsePKCS1PrivateKey(block.Bytes); err == nil {
		return k, nil
	}
	return nil, errors.New("not a PKCS#8, EC or PKCS#1 private key")
}

func publicKeysEqual(a, b crypto.PublicKey) bool {
	ae, ok := a.(interface{ Equal(crypto.PublicKey) bool })
	return ok && ae.Equal(b)
}

func encodeCert(der []byte) string {
	return string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
}

func serial() (*big.Int, error) {
	sn, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("serial number: %w", err)
	}
	return sn.Add(sn, big.NewInt(1)), nil
}
