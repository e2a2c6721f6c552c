package spiffe

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"math/big"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// testCA is a root and an intermediate issued by it.
type testCA struct {
	root, inter       *x509.Certificate
	rootKey, interKey *ecdsa.PrivateKey
}

var t0 = time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)

func newTestCA(t testing.TB, name string) *testCA {
	t.Helper()
	ca := &testCA{}
	ca.root, ca.rootKey = makeCert(t, &x509.Certificate{
		Subject: pkix.Name{CommonName: name + " root"}, IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}, nil, nil)
	ca.inter, ca.interKey = makeCert(t, &x509.Certificate{
		Subject: pkix.Name{CommonName: name + " intermediate"}, IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}, ca.root, ca.rootKey)
	return ca
}

// leaf issues, from the intermediate, a certificate with uri as its SAN
// (none when empty); the chain is [leaf, intermediate].
func (ca *testCA) leaf(t testing.TB, uri string) []*x509.Certificate {
	t.Helper()
	tmpl := &x509.Certificate{KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}}
	if uri != "" {
		u, err := url.Parse(uri)
		require.NoError(t, err)
		tmpl.URIs = []*url.URL{u}
	}
	leaf, _ := makeCert(t, tmpl, ca.inter, ca.interKey)
	return []*x509.Certificate{leaf, ca.inter}
}

var serialN int64

func makeCert(t testing.TB, tmpl, parent *x509.Certificate, parentKey *ecdsa.PrivateKey) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	serialN++
	tmpl.SerialNumber = big.NewInt(serialN)
	if tmpl.NotBefore.IsZero() {
		tmpl.NotBefore, tmpl.NotAfter = t0.Add(-time.Hour), t0.Add(time.Hour)
	}
	if parent == nil {
		parent, parentKey = tmpl, key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, key.Public(), parentKey)
	require.NoError(t, err)
	c, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	return c, key
}

func pemOf(certs ...*x509.Certificate) []byte {
	var out []byte
	for _, c := range certs {
		out = append(out, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})...)
	}
	return out
}

func TestTrustBundleRoundTrip(t *testing.T) {
	a, a2, b := newTestCA(t, "a"), newTestCA(t, "a-next"), newTestCA(t, "b")
	tb, err := NewTrustBundle(map[string][]*x509.Certificate{
		"a.example": {a.root, a2.root, a.root}, // a rotation: two roots (a repeat is dropped)
		"b.example": {b.root},
	})
	require.NoError(t, err)
	require.Equal(t, []string{"a.example", "b.example"}, tb.Domains())
	require.Len(t, tb.Roots("a.example"), 2)
	require.Equal(t, "a.example(2) b.example(1)", tb.String())

	data, err := tb.Marshal()
	require.NoError(t, err)
	// The SPIFFE trust bundle map: one JWK set per domain, X.509 authorities
	// as x509-svid keys carrying the root in x5c.
	var doc struct {
		TrustDomains map[string]struct {
			Keys []struct {
				Use string   `json:"use"`
				Kty string   `json:"kty"`
				X5c []string `json:"x5c"`
			} `json:"keys"`
		} `json:"trust_domains"`
	}
	require.NoError(t, json.Unmarshal(data, &doc))
	require.Len(t, doc.TrustDomains, 2)
	keys := doc.TrustDomains["a.example"].Keys
	require.Len(t, keys, 2)
	require.Equal(t, "x509-svid", keys[0].Use)
	require.Equal(t, "EC", keys[0].Kty)
	require.Len(t, keys[0].X5c, 1)

	back, err := ParseTrustBundle(data)
	require.NoError(t, err)
	require.True(t, back.Equal(tb))
	again, err := back.Marshal()
	require.NoError(t, err)
	require.Equal(t, string(data), string(again), "equal bundles marshal to equal bytes")

	fromPEM, err := TrustBundleFromPEM("a.example", append(pemOf(a.root, a2.root), "junk"...))
	require.NoError(t, err)
	require.Equal(t, []string{"a.example"}, fromPEM.Domains())
	require.Len(t, fromPEM.Roots("a.example"), 2)
	require.False(t, fromPEM.Equal(tb))
	pool := tb.Pool()
	for _, ca := range []*testCA{a, a2, b} {
		_, err := ca.inter.Verify(x509.VerifyOptions{Roots: pool, CurrentTime: t0})
		require.NoError(t, err, "Pool holds every domain's roots")
	}
}

func TestTrustBundleRefusals(t *testing.T) {
	a := newTestCA(t, "a")
	good, err := NewTrustBundle(map[string][]*x509.Certificate{"a.example": {a.root}})
	require.NoError(t, err)
	data, err := good.Marshal()
	require.NoError(t, err)
	var doc map[string]map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(data, &doc))
	entry := string(doc["trust_domains"]["a.example"])

	for name, in := range map[string]string{
		"not JSON":                  "-----BEGIN CERTIFICATE-----",
		"no trust_domains":          `{"keys": []}`,
		"invalid trust domain name": `{"trust_domains": {"A.Example": ` + entry + `}}`,
		"a URI, not a name":         `{"trust_domains": {"spiffe://a.example": ` + entry + `}}`,
		"keys missing":              `{"trust_domains": {"a.example": {}}}`,
		"no X.509 authority":        `{"trust_domains": {"a.example": {"keys": []}}}`,
		"x5c not a certificate":     `{"trust_domains": {"a.example": {"keys": [{"use": "x509-svid", "kty": "EC", "x5c": ["AAAA"]}]}}}`,
		"bad entry among good":      `{"trust_domains": {"a.example": ` + entry + `, "b.example": {"keys": []}}}`,
		"trailing data":             string(data) + `{}`,
		"too large":                 `{"trust_domains": {}, "pad": "` + strings.Repeat("x", maxTrustBundleBytes) + `"}`,
	} {
		t.Run(name, func(t *testing.T) {
			_, err := ParseTrustBundle([]byte(in))
			require.Error(t, err)
		})
	}
	_, err = NewTrustBundle(map[string][]*x509.Certificate{"a.example": nil})
	require.ErrorContains(t, err, "no roots")
	leaf := a.leaf(t, "spiffe://a.example/ns/x/sa/y")[0]
	_, err = NewTrustBundle(map[string][]*x509.Certificate{"a.example": {leaf}})
	require.ErrorContains(t, err, "not a CA")
	_, err = TrustBundleFromPEM("a.example", []byte("no pem here"))
	require.Error(t, err)

	empty, err := ParseTrustBundle([]byte(`{"trust_domains": {}}`))
	require.NoError(t, err, "an empty map is a valid bundle that trusts nothing")
	require.Empty(t, empty.Domains())
}

func TestTrustBundleVerify(t *testing.T) {
	a, b, c := newTestCA(t, "a"), newTestCA(t, "b"), newTestCA(t, "c")
	tb, err := NewTrustBundle(map[string][]*x509.Certificate{"a.example": {a.root}, "b.example": {b.root}})
	require.NoError(t, err)

	id, err := tb.Verify(a.leaf(t, "spiffe://a.example/ns/front/sa/web"), t0)
	require.NoError(t, err)
	require.Equal(t, Identity{"a.example", "front", "web"}, id)
	id, err = tb.Verify(b.leaf(t, "spiffe://b.example/ns/back/sa/db"), t0)
	require.NoError(t, err)
	require.Equal(t, Identity{"b.example", "back", "db"}, id)

	for name, tc := range map[string]struct {
		chain []*x509.Certificate
		at    time.Time
		want  error
	}{
		// The heart of federation: a's root vouches only for a's identities.
		"a's CA claiming b's identity": {a.leaf(t, "spiffe://b.example/ns/back/sa/db"), t0, ErrUntrusted},
		"b's CA claiming a's identity": {b.leaf(t, "spiffe://a.example/ns/front/sa/web"), t0, ErrUntrusted},
		"an unfederated domain":        {c.leaf(t, "spiffe://c.example/ns/x/sa/y"), t0, ErrUnknownTrustDomain},
		"c's CA claiming a's identity": {c.leaf(t, "spiffe://a.example/ns/front/sa/web"), t0, ErrUntrusted},
		"expired":                      {a.leaf(t, "spiffe://a.example/ns/front/sa/web"), t0.Add(2 * time.Hour), ErrUntrusted},
		"no URI SAN":                   {a.leaf(t, ""), t0, ErrNotSVID},
		"not a workload ID":            {a.leaf(t, "spiffe://a.example/agent/x"), t0, ErrNotSVID},
		"missing intermediate":         {a.leaf(t, "spiffe://a.example/ns/front/sa/web")[:1], t0, ErrUntrusted},
		"empty chain":                  {nil, t0, ErrNoCertificate},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := tb.Verify(tc.chain, tc.at)
			require.ErrorIs(t, err, tc.want)
		})
	}
	var none *TrustBundle
	_, err = none.Verify(a.leaf(t, "spiffe://a.example/ns/front/sa/web"), t0)
	require.ErrorIs(t, err, ErrUnknownTrustDomain, "a nil bundle trusts nothing")
}

// BenchmarkVerify measures TrustBundle.Verify (once per TLS handshake of
// every hop) against the verification it replaced in the same run: one
// x509 Verify against a pool of every root.
func BenchmarkVerify(b *testing.B) {
	a, other := newTestCA(b, "a"), newTestCA(b, "b")
	tb, err := NewTrustBundle(map[string][]*x509.Certificate{"a.example": {a.root}, "b.example": {other.root}})
	require.NoError(b, err)
	chain := a.leaf(b, "spiffe://a.example/ns/front/sa/web")
	b.Run("bundle", func(b *testing.B) {
		for b.Loop() {
			if _, err := tb.Verify(chain, t0); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("pooled-baseline", func(b *testing.B) {
		pool := tb.Pool()
		for b.Loop() {
			inter := x509.NewCertPool()
			inter.AddCert(chain[1])
			if _, err := chain[0].Verify(x509.VerifyOptions{Roots: pool, Intermediates: inter, CurrentTime: t0,
				KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
				b.Fatal(err)
			}
			if _, err := FromCertificate(chain[0]); err != nil {
				b.Fatal(err)
			}
		}
	})
}
