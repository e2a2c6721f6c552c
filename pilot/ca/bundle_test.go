package ca

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"net"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/isthmus-mesh/isthmus/internal/spiffe"
	"github.com/stretchr/testify/require"
)

var t0 = time.Date(2026, 11, 29, 10, 0, 0, 0, time.UTC)

func newBundle(t *testing.T, ttl time.Duration) (*bundle, map[string][]byte) {
	t.Helper()
	data, err := generateSelfSigned("cluster.local", ttl, t0)
	require.NoError(t, err)
	b, err := parseBundle(data[caCertKey], data[caKeyKey], data[certChainKey], data[RootCertKey], t0)
	require.NoError(t, err)
	return b, data
}

// makeCSR returns a PEM CSR for a fresh key of the given kind, with the given SANs.
func makeCSR(t *testing.T, key crypto.Signer, uris []string, dns []string) string {
	t.Helper()
	if key == nil {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		require.NoError(t, err)
		key = k
	}
	tmpl := &x509.CertificateRequest{Subject: pkix.Name{Organization: []string{"test"}}, DNSNames: dns}
	for _, u := range uris {
		pu, err := url.Parse(u)
		require.NoError(t, err)
		tmpl.URIs = append(tmpl.URIs, pu)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, tmpl, key)
	require.NoError(t, err)
	return string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der}))
}

// verifyChain parses a response chain and verifies the leaf against roots, returning the leaf.
func verifyChain(t *testing.T, chain []string, roots []byte, at time.Time) *x509.Certificate {
	t.Helper()
	require.GreaterOrEqual(t, len(chain), 2)
	var certs []*x509.Certificate
	for _, p := range chain {
		cs, err := spiffe.ParseCertificatesPEM([]byte(p))
		require.NoError(t, err)
		require.Len(t, cs, 1, "one certificate per chain element")
		certs = append(certs, cs[0])
	}
	pool := x509.NewCertPool()
	require.True(t, pool.AppendCertsFromPEM(roots))
	inter := x509.NewCertPool()
	for _, c := range certs[1 : len(certs)-1] {
		inter.AddCert(c)
	}
	_, err := certs[0].Verify(x509.VerifyOptions{Roots: pool, Intermediates: inter, CurrentTime: at,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth}})
	require.NoError(t, err)
	last := certs[len(certs)-1]
	require.NoError(t, last.CheckSignatureFrom(last), "last element is a self-signed root")
	return certs[0]
}

func TestSelfSignedBundleIssuesLeafWithOnlySPIFFESAN(t *testing.T) {
	b, data := newBundle(t, 24*time.Hour*365)
	require.Len(t, b.chain, 1, "chain holds the intermediate only")
	require.NotEqual(t, b.root.Raw, b.issuer.Raw, "an intermediate, not the root, signs")
	require.Equal(t, elliptic.P256(), b.root.PublicKey.(*ecdsa.PublicKey).Curve)

	csr, err := parseCSR(makeCSR(t, nil, nil, nil))
	require.NoError(t, err)
	id, _ := url.Parse("spiffe://cluster.local/ns/app/sa/web")
	leaf, err := b.signLeaf(leafRequest{publicKey: csr.PublicKey, uris: []*url.URL{id}, ttl: time.Hour}, t0)
	require.NoError(t, err)
	chain := b.responseChain(leaf)
	require.Len(t, chain, 3, "[leaf, intermediate, root]")
	got := verifyChain(t, chain, data[RootCertKey], t0.Add(time.Minute))
	require.Equal(t, []string{"spiffe://cluster.local/ns/app/sa/web"}, []string{got.URIs[0].String()})
	require.Len(t, got.URIs, 1)
	require.Empty(t, got.DNSNames)
	require.Empty(t, got.IPAddresses)
	require.Empty(t, got.EmailAddresses)
	require.False(t, got.IsCA)
	require.Equal(t, t0.Add(time.Hour), got.NotAfter)
	require.Equal(t, chain[2], string(data[RootCertKey]))
}

func TestLeafNeverOutlivesChain(t *testing.T) {
	b, _ := newBundle(t, 2*time.Hour)
	leaf, err := b.signLeaf(leafRequest{publicKey: b.signer.Public(), ttl: 24 * time.Hour}, t0)
	require.NoError(t, err)
	require.Equal(t, b.notAfter, leaf.NotAfter)
	require.Equal(t, t0.Add(2*time.Hour), leaf.NotAfter)
}

func TestPluginBundleWithTwoRootsChainsToIssuingRoot(t *testing.T) {
	_, oldData := newBundle(t, time.Hour*24*365)
	_, newData := newBundle(t, time.Hour*24*365)
	bothRoots := append(append([]byte{}, oldData[RootCertKey]...), newData[RootCertKey]...)
	b, err := parseBundle(newData[caCertKey], newData[caKeyKey], newData[certChainKey], bothRoots, t0)
	require.NoError(t, err)
	require.Len(t, b.roots, 2)
	require.Equal(t, string(bothRoots), string(b.rootsPEM))
	require.Equal(t, string(newData[RootCertKey]), b.rootPEM, "the response ends in the root the issuer chains to")

	leaf, err := b.signLeaf(leafRequest{publicKey: b.signer.Public(), ttl: time.Hour}, t0)
	require.NoError(t, err)
	verifyChain(t, b.responseChain(leaf), bothRoots, t0)
}

func TestParseBundleRefusesBadMaterial(t *testing.T) {
	_, a := newBundle(t, time.Hour*24*365)
	_, other := newBundle(t, time.Hour*24*365)
	tests := []struct {
		name                string
		cert, key, ch, root []byte
		want                string
	}{
		{"key of another CA", a[caCertKey], other[caKeyKey], a[certChainKey], a[RootCertKey], "does not match"},
		{"issuer under another root", a[caCertKey], a[caKeyKey], a[certChainKey], other[RootCertKey], "does not chain"},
		{"no root", a[caCertKey], a[caKeyKey], a[certChainKey], nil, "root-cert.pem: no certificate"},
		{"no issuer", nil, a[caKeyKey], a[certChainKey], a[RootCertKey], "ca-cert.pem: no certificate"},
		{"garbage key", a[caCertKey], []byte("not a key"), a[certChainKey], a[RootCertKey], "ca-key.pem"},
		{"expired", a[caCertKey], a[caKeyKey], a[certChainKey], a[RootCertKey], "does not chain"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			at := t0
			if tc.name == "expired" {
				at = t0.Add(2 * 24 * time.Hour * 365)
			}
			_, err := parseBundle(tc.cert, tc.key, tc.ch, tc.root, at)
			require.ErrorContains(t, err, tc.want)
		})
	}
}

func TestParseBundleRefusesLeafAsIssuer(t *testing.T) {
	b, data := newBundle(t, time.Hour*24*365)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	leaf, err := b.signLeaf(leafRequest{publicKey: key.Public(), ttl: time.Hour}, t0)
	require.NoError(t, err)
	der, err := x509.MarshalPKCS8PrivateKey(key)
	require.NoError(t, err)
	_, err = parseBundle([]byte(encodeCert(leaf.Raw)), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}),
		data[certChainKey], data[RootCertKey], t0)
	require.ErrorContains(t, err, "not a CA")
}

func TestParseCSR(t *testing.T) {
	rsaSmall, err := rsa.GenerateKey(rand.Reader, 1024)
	require.NoError(t, err)
	good := makeCSR(t, nil, nil, nil)
	block, _ := pem.Decode([]byte(good))
	tampered := append([]byte{}, block.Bytes...)
	tampered[len(tampered)-5] ^= 0xff // inside the signature
	tests := []struct {
		name, csr, wantErr string
	}{
		{"ecdsa p256", good, ""},
		{"empty", "", "no PEM block"},
		{"not pem", "hello", "no PEM block"},
		{"wrong type", strings.Replace(good, "CERTIFICATE REQUEST", "CERTIFICATE", 2), "not a CERTIFICATE REQUEST"},
		{"bad der", string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: []byte{1, 2, 3}})), "parse"},
		{"bad signature", string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: tampered})), "signature"},
		{"rsa 1024", makeCSR(t, rsaSmall, nil, nil), "below 2048"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			csr, err := parseCSR(tc.csr)
			if tc.wantErr == "" {
				require.NoError(t, err)
				require.NotNil(t, csr.PublicKey)
				return
			}
			require.ErrorContains(t, err, tc.wantErr)
		})
	}
}

func TestCheckCSRIdentity(t *testing.T) {
	const me = "spiffe://cluster.local/ns/app/sa/web"
	tests := []struct {
		name   string
		uris   []string
		dns    []string
		wantOK bool
	}{
		{"no SANs", nil, nil, true},
		{"own identity", []string{me}, nil, true},
		{"another identity", []string{"spiffe://cluster.local/ns/kube-system/sa/admin"}, nil, false},
		{"own and another", []string{me, "spiffe://cluster.local/ns/app/sa/db"}, nil, false},
		{"other trust domain", []string{"spiffe://evil.example/ns/app/sa/web"}, nil, false},
		{"dns name", nil, []string{"web.app.svc"}, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			csr, err := parseCSR(makeCSR(t, nil, tc.uris, tc.dns))
			require.NoError(t, err)
			err = checkCSRIdentity(csr, me)
			if tc.wantOK {
				require.NoError(t, err)
			} else {
				require.Error(t, err)
			}
		})
	}
}

func TestClampTTL(t *testing.T) {
	tests := []struct {
		name string
		req  int64
		want time.Duration
	}{
		{"unset gives default", 0, 24 * time.Hour},
		{"negative gives default", -5, 24 * time.Hour},
		{"within cap", 3600, time.Hour},
		{"at cap", 48 * 3600, 48 * time.Hour},
		{"above cap is capped", 1 << 40, 48 * time.Hour},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, clampTTL(tc.req, 24*time.Hour, 48*time.Hour))
		})
	}
}

func TestRenewAtIsHalfLife(t *testing.T) {
	c := &x509.Certificate{NotBefore: t0, NotAfter: t0.Add(24 * time.Hour)}
	require.Equal(t, t0.Add(12*time.Hour), spiffe.RenewAt(c))
}

func TestServingLeafSplitsDNSAndIP(t *testing.T) {
	b, data := newBundle(t, time.Hour*24*365)
	leaf, err := b.signLeaf(leafRequest{publicKey: b.signer.Public(), dnsNames: []string{"isthmusd.isthmus-system.svc", "127.0.0.1"}, ttl: time.Hour}, t0)
	require.NoError(t, err)
	require.Equal(t, []string{"isthmusd.isthmus-system.svc"}, leaf.DNSNames)
	require.True(t, leaf.IPAddresses[0].Equal(net.ParseIP("127.0.0.1")))
	verifyChain(t, b.responseChain(leaf), data[RootCertKey], t0)
}

// BenchmarkSignLeaf measures signing alone (P-256 issuer, P-256 CSR key), without gRPC or
// authentication.
func BenchmarkSignLeaf(b *testing.B) {
	data, err := generateSelfSigned("cluster.local", 24*time.Hour*365, time.Now())
	require.NoError(b, err)
	bd, err := parseBundle(data[caCertKey], data[caKeyKey], data[certChainKey], data[RootCertKey], time.Now())
	require.NoError(b, err)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(b, err)
	id, _ := url.Parse("spiffe://cluster.local/ns/app/sa/web")
	for b.Loop() {
		if _, err := bd.signLeaf(leafRequest{publicKey: key.Public(), uris: []*url.URL{id}, ttl: time.Hour}, time.Now()); err != nil {
			b.Fatal(err)
		}
	}
}
