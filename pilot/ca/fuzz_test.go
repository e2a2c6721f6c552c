package ca

import (
	"context"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"slices"
	"strings"
	"testing"
	"time"

	jose "github.com/go-jose/go-jose/v4"
	"google.golang.org/protobuf/types/known/structpb"
	pb "istio.io/api/security/v1alpha1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/isthmus-mesh/isthmus/internal/nodebind"
	"github.com/isthmus-mesh/isthmus/internal/spiffe"
)

// fixedCaller is an Authenticator that vouches for one caller.
type fixedCaller struct{ c *Caller }

func (f fixedCaller) Authenticate(context.Context) (*Caller, error) { return f.c, nil }

// fuzzClusters is the fuzz CA's one cluster, c1, whose API server (a fake
// clientset) holds the node account's pod ztunnel-1 (uid u1) on node n1.
type fuzzClusters struct{ c1 kubernetes.Interface }

func (f fuzzClusters) KubeClient(id string) (kubernetes.Interface, bool) { return f.c1, id == "c1" }

// fuzzCA returns a CA with self-signed material at t0 whose authenticator
// vouches for caller. Its one cluster, c1, has the node account's pod on
// n1 and no node index: an impersonation that passes every local check and
// the caller's pod lookup ends as not on the node.
func fuzzCA(t testing.TB, caller *Caller) *CA {
	// The chain outlives MaxTTL, so that the cap on a leaf's life is MaxTTL's.
	data, err := generateSelfSigned("cluster.local", 365*24*time.Hour, t0)
	if err != nil {
		t.Fatal(err)
	}
	b, err := parseBundle(data[caCertKey], data[caKeyKey], data[certChainKey], data[RootCertKey], t0)
	if err != nil {
		t.Fatal(err)
	}
	c, err := New(Config{ClusterID: "config", MaxTTL: 48 * time.Hour},
		Deps{ConfigClient: &kubernetes.Clientset{}, Authenticator: fixedCaller{caller}, Now: func() time.Time { return t0 },
			Clusters: fuzzClusters{fake.NewClientset(&corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Name: "ztunnel-1", Namespace: DefaultNamespace, UID: "u1"},
				Spec:       corev1.PodSpec{ServiceAccountName: "ztunnel", NodeName: "n1"},
			})}})
	if err != nil {
		t.Fatal(err)
	}
	c.current.Store(b)
	return c
}

// FuzzCreateCertificate fuzzes the CSR, the impersonated identity and the
// requested validity of a certificate request, from an ordinary workload
// and from a trusted node account. A request is refused with a reason of
// its own, or answered with a chain to the CA's root whose leaf carries
// exactly the caller's identity (as a URI SAN that parses back to it), the
// CSR's key, and no more than MaxTTL.
func FuzzCreateCertificate(f *testing.F) {
	cas := map[bool]*CA{
		false: fuzzCA(f, &Caller{Cluster: "c1", Namespace: "default", ServiceAccount: "app"}),
		true:  fuzzCA(f, &Caller{Cluster: "c1", Namespace: DefaultNamespace, ServiceAccount: "ztunnel", PodName: "ztunnel-1", PodUID: "u1"}),
	}
	f.Fuzz(func(t *testing.T, csr, impersonate string, validity int64, nodeAccount bool) {
		c := cas[nodeAccount]
		req := &pb.IstioCertificateRequest{Csr: csr, ValidityDuration: validity}
		if impersonate != "" {
			req.Metadata = &structpb.Struct{Fields: map[string]*structpb.Value{ImpersonatedIdentityMetadata: structpb.NewStringValue(impersonate)}}
		}
		resp, caller, id, err := c.createCertificate(t.Context(), req)
		own := Identity{TrustDomain: "cluster.local", Namespace: caller.Namespace, ServiceAccount: caller.ServiceAccount}.String()
		if err != nil {
			checkCertRefusal(t, err, impersonate, own, nodeAccount)
			return
		}
		if impersonate != "" && impersonate != own {
			t.Fatalf("issued for impersonated %q to %s", impersonate, own)
		}
		if id != own {
			t.Fatalf("issued %q to %s", id, own)
		}
		leaf := checkLeaf(t, c, resp, csr, own)
		// A node account's own certificate, and only it, is bound to its pod's node.
		b, err := nodebind.FromCertificate(leaf)
		switch {
		case nodeAccount && (err != nil || b != nodebind.Binding{Cluster: "c1", Node: "n1"}):
			t.Fatalf("node account's certificate bound to %+v (%v), want c1/n1", b, err)
		case !nodeAccount && !errors.Is(err, nodebind.ErrAbsent):
			t.Fatalf("workload certificate bound to %+v (%v)", b, err)
		}
	})
}

// checkCertRefusal requires a refusal with a reason the request can earn.
func checkCertRefusal(t *testing.T, err error, impersonate, own string, nodeAccount bool) {
	var re *RefusalError
	if !errors.As(err, &re) {
		t.Fatalf("refusal %v is not a RefusalError", err)
	}
	switch re.Reason {
	case ReasonMalformedCSR, ReasonIdentityMismatch:
	case ReasonImpersonationNotTrusted:
		if nodeAccount || impersonate == "" || impersonate == own {
			t.Fatalf("%s refused: %v", own, err)
		}
	case ReasonImpersonationInvalid:
		if !nodeAccount {
			t.Fatalf("impersonation by %s was parsed: %v", own, err)
		}
	case ReasonImpersonationNotOnNode:
		// Every local check and the pod lookup passed: the identity must
		// be a valid one of the trust domain that prints back as itself.
		want, perr := ParseIdentity(impersonate)
		if !nodeAccount || perr != nil || want.TrustDomain != "cluster.local" {
			t.Fatalf("impersonation of %q reached the pod lookup (%v)", impersonate, perr)
		}
		checkIdentityRoundTrip(t, impersonate, want)
	default:
		t.Fatalf("unexpected refusal: %v", err)
	}
}

// checkLeaf verifies an issued chain: it chains to the CA's root, names
// want and nothing else, for the CSR's own (strong enough) key, which asked
// for nothing else, within MaxTTL.
func checkLeaf(t *testing.T, c *CA, resp *pb.IstioCertificateResponse, csrPEM, want string) *x509.Certificate {
	var certs []*x509.Certificate
	for _, p := range resp.GetCertChain() {
		cs, err := spiffe.ParseCertificatesPEM([]byte(p))
		if err != nil || len(cs) != 1 {
			t.Fatalf("chain element %q: %v", p, err)
		}
		certs = append(certs, cs...)
	}
	leaf := certs[0]
	inter := x509.NewCertPool()
	for _, ic := range certs[1 : len(certs)-1] {
		inter.AddCert(ic)
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: c.RootPool(), Intermediates: inter, CurrentTime: t0,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Fatalf("leaf does not verify: %v", err)
	}
	if len(leaf.URIs) != 1 || leaf.URIs[0].String() != want || len(leaf.DNSNames)+len(leaf.IPAddresses)+len(leaf.EmailAddresses) > 0 {
		t.Fatalf("leaf SANs %v %v %v %v, want only %s", leaf.URIs, leaf.DNSNames, leaf.IPAddresses, leaf.EmailAddresses, want)
	}
	id, err := spiffe.FromCertificate(leaf)
	if err != nil || id.String() != want {
		t.Fatalf("leaf identity %v (%v), want %s", id, err, want)
	}
	csr, err := parseCSR(csrPEM)
	if err != nil || !publicKeysEqual(csr.PublicKey, leaf.PublicKey) {
		t.Fatalf("leaf key is not the CSR's (%v)", err)
	}
	for _, u := range csr.URIs {
		if u.String() != want {
			t.Fatalf("issued %s for a CSR asking for %s", want, u)
		}
	}
	if len(csr.DNSNames)+len(csr.IPAddresses)+len(csr.EmailAddresses) > 0 {
		t.Fatalf("issued %s for a CSR asking for DNS, IP or email SANs", want)
	}
	switch k := leaf.PublicKey.(type) {
	case *rsa.PublicKey:
		if k.N.BitLen() < 2048 {
			t.Fatalf("issued for an RSA key of %d bits", k.N.BitLen())
		}
	case *ecdsa.PublicKey:
		if k.Curve != elliptic.P256() && k.Curve != elliptic.P384() && k.Curve != elliptic.P521() {
			t.Fatalf("issued for an ECDSA key on %s", k.Curve.Params().Name)
		}
	case ed25519.PublicKey:
	default:
		t.Fatalf("issued for a %T key", k)
	}
	if life := leaf.NotAfter.Sub(leaf.NotBefore); life > c.cfg.MaxTTL+clockSkew {
		t.Fatalf("leaf lives %s, over MaxTTL %s", life, c.cfg.MaxTTL)
	}
	return leaf
}

// checkIdentityRoundTrip requires id, parsed from in, to print as in (the
// one spelling of an identity) and to parse back to id by the CA's parser
// and the mesh's.
func checkIdentityRoundTrip(t *testing.T, in string, id Identity) {
	s := id.String()
	if s != in {
		t.Fatalf("%q parsed as %+v, which prints as %q", in, id, s)
	}
	again, err := ParseIdentity(s)
	if err != nil || again != id {
		t.Fatalf("%+v prints as %q, which parses as %+v (%v)", id, s, again, err)
	}
	if mesh, err := spiffe.Parse(s); err != nil || mesh != id {
		t.Fatalf("%q: the mesh's parser reads %+v (%v)", s, mesh, err)
	}
	if id.URL().String() != s {
		t.Fatalf("%+v: URL %q, String %q", id, id.URL(), s)
	}
}

// FuzzParseIdentity: an identity the CA accepts has Kubernetes names for
// namespace and ServiceAccount, and is spelled exactly as it prints.
func FuzzParseIdentity(f *testing.F) {
	f.Fuzz(func(t *testing.T, s string) {
		id, err := ParseIdentity(s)
		if err != nil {
			return
		}
		if len(validation.IsDNS1123Label(id.Namespace))+len(validation.IsDNS1123Subdomain(id.ServiceAccount)) > 0 {
			t.Fatalf("%q accepted with namespace %q, service account %q", s, id.Namespace, id.ServiceAccount)
		}
		checkIdentityRoundTrip(t, s, id)
	})
}

// FuzzBearerToken fuzzes the authorization metadata: the token taken is
// what follows a "Bearer" scheme (any case), trimmed; the unverified claims
// of any string are read without panicking, and only from a three-part
// token.
func FuzzBearerToken(f *testing.F) {
	f.Fuzz(func(t *testing.T, first, second string) {
		tok := bearerToken([]string{first, second})
		if tok != "" {
			ok := slices.ContainsFunc([]string{first, second}, func(v string) bool {
				scheme, rest, found := strings.Cut(v, " ")
				return found && strings.EqualFold(scheme, "bearer") && strings.TrimSpace(rest) == tok
			})
			if !ok || strings.TrimSpace(tok) != tok {
				t.Fatalf("token %q from %q, %q", tok, first, second)
			}
		}
		for _, s := range []string{first, second, tok} {
			if c := unverifiedClaims(s); c != nil && strings.Count(s, ".") != 2 {
				t.Fatalf("claims %+v read from %q", c, s)
			}
		}
	})
}

// prefilterFixture is an authenticator whose cluster c1 has issuer
// fuzzIssuer and one P-256 key, fuzzKID, known as if read from discovery at
// t0 (and not read again: the clock stays at t0).
type prefilterFixture struct {
	a   *TokenReviewAuthenticator
	key *ecdsa.PrivateKey
}

const (
	fuzzIssuer = "https://c1.example/"
	fuzzKID    = "k1"
)

func newPrefilterFixture(t testing.TB) *prefilterFixture {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	a := &TokenReviewAuthenticator{Audiences: []string{"istio-ca"}, Now: func() time.Time { return t0 }}
	iss := a.issuers.of("c1")
	iss.name, iss.fetched = fuzzIssuer, t0
	iss.keys = &jose.JSONWebKeySet{Keys: []jose.JSONWebKey{{Key: &key.PublicKey, KeyID: fuzzKID, Algorithm: string(jose.ES256), Use: "sig"}}}
	return &prefilterFixture{a: a, key: key}
}

// token builds header.payload.signature; sign replaces sig by the fixture
// key's ES256 signature of the first two parts.
func (f *prefilterFixture) token(t testing.TB, header, payload string, sign bool, sig []byte) string {
	in := base64.RawURLEncoding.EncodeToString([]byte(header)) + "." + base64.RawURLEncoding.EncodeToString([]byte(payload))
	if sign {
		digest := sha256.Sum256([]byte(in))
		r, s, err := ecdsa.Sign(rand.Reader, f.key, digest[:])
		if err != nil {
			t.Fatal(err)
		}
		sig = make([]byte, 64)
		r.FillBytes(sig[:32])
		s.FillBytes(sig[32:])
	}
	return in + "." + base64.RawURLEncoding.EncodeToString(sig)
}

// accepted is the oracle of the prefilter, written apart from it: a
// base64url compact JWS with header alg ES256 (key ID k1 or none) whose signature verifies with
// the fixture key, an exp after t0, the cluster's issuer, a ServiceAccount
// subject and the istio-ca audience.
func (f *prefilterFixture) accepted(tok string) bool {
	for _, r := range tok {
		if !(r == '.' || r == '-' || r == '_' || r >= '0' && r <= '9' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z') {
			return false
		}
	}
	parts := strings.Split(tok, ".")
	if len(parts) != 3 {
		return false
	}
	var hdr struct {
		Alg string `json:"alg"`
		Kid string `json:"kid"`
	}
	h, err := base64.RawURLEncoding.DecodeString(parts[0])
	if err != nil || json.Unmarshal(h, &hdr) != nil || hdr.Alg != "ES256" || (hdr.Kid != "" && hdr.Kid != fuzzKID) {
		return false
	}
	sig, err := base64.RawURLEncoding.DecodeString(parts[2])
	if err != nil || len(sig) != 64 {
		return false
	}
	digest := sha256.Sum256([]byte(parts[0] + "." + parts[1]))
	if !ecdsa.Verify(&f.key.PublicKey, digest[:], new(big.Int).SetBytes(sig[:32]), new(big.Int).SetBytes(sig[32:])) {
		return false
	}
	payload, err := base64.RawURLEncoding.DecodeString(parts[1])
	if err != nil {
		return false
	}
	var c struct {
		Iss string          `json:"iss"`
		Sub string          `json:"sub"`
		Exp float64         `json:"exp"`
		Aud json.RawMessage `json:"aud"`
	}
	if json.Unmarshal(payload, &c) != nil {
		return false
	}
	var aud audience
	if json.Unmarshal(c.Aud, &aud) != nil || !slices.Contains(aud, "istio-ca") {
		return false
	}
	sub := strings.Split(c.Sub, ":")
	return c.Iss == fuzzIssuer && float64(t0.Unix()) < c.Exp &&
		len(sub) == 4 && sub[0] == "system" && sub[1] == "serviceaccount" && sub[2] != "" && sub[3] != ""
}

// FuzzTokenPrefilter fuzzes the token a CSR caller sends, as header and
// payload JSON with a real or a made-up signature, or as any string: the
// prefilter lets through exactly the tokens the oracle accepts (signed by
// the cluster's key with ES256, not expired, of the cluster's issuer, a
// ServiceAccount, for istio-ca), and refuses every other one with one of
// the prefilter's own reasons, never panicking.
func FuzzTokenPrefilter(f *testing.F) {
	fx := newPrefilterFixture(f)
	exp := t0.Add(time.Hour).Unix()
	good := fmt.Sprintf(`{"iss":%q,"sub":"system:serviceaccount:ns:sa","aud":["istio-ca"],"exp":%d}`, fuzzIssuer, exp)
	es := `{"alg":"ES256","kid":"k1"}`
	f.Add(es, good, true, []byte(nil), "")
	f.Add(`{"alg":"none"}`, good, false, []byte(nil), "")
	f.Add(`{"alg":"HS256","kid":"k1"}`, good, false, []byte("0123456789abcdef0123456789abcdef"), "")
	f.Add(`{"alg":"ES256","kid":"k2"}`, good, true, []byte(nil), "")
	f.Add(`{"alg":"RS256","kid":"k1"}`, good, false, make([]byte, 256), "")
	f.Add(es, good, false, make([]byte, 64), "")
	f.Add(es, fmt.Sprintf(`{"iss":"https://evil.example/","sub":"system:serviceaccount:ns:sa","aud":"istio-ca","exp":%d}`, exp), true, []byte(nil), "")
	f.Add(es, fmt.Sprintf(`{"iss":%q,"sub":"system:serviceaccount:ns:sa","aud":"istio-ca","exp":%d}`, fuzzIssuer, t0.Unix()), true, []byte(nil), "")
	f.Add(es, fmt.Sprintf(`{"iss":%q,"sub":"admin","aud":"istio-ca","exp":%d}`, fuzzIssuer, exp), true, []byte(nil), "")
	f.Add(es, fmt.Sprintf(`{"iss":%q,"sub":"system:serviceaccount:ns:sa","aud":"other","exp":%d}`, fuzzIssuer, exp), true, []byte(nil), "")
	f.Add(es, `{"iss":"x"`, true, []byte(nil), "")
	f.Add("", "", false, []byte(nil), "a.b")
	f.Add("", "", false, []byte(nil), "eyJhbGciOiJFUzI1NiJ9.e30 .AAAA")
	f.Add("", "", false, []byte(nil), "!!!.???.***")
	prefilterReasons := []Reason{ReasonTokenMalformed, ReasonTokenAlgorithm, ReasonTokenExpired, ReasonNotServiceAccount,
		ReasonWrongAudience, ReasonForeignIssuer, ReasonTokenSignature}
	f.Fuzz(func(t *testing.T, header, payload string, sign bool, sig []byte, raw string) {
		tok := raw
		if tok == "" {
			tok = fx.token(t, header, payload, sign, sig)
		}
		p, err := fx.a.prefilter(t.Context(), nil, "c1", tok)
		want := fx.accepted(tok)
		if err != nil {
			var re *RefusalError
			if !errors.As(err, &re) || !slices.Contains(prefilterReasons, re.Reason) {
				t.Fatalf("refusal %v is not one of the prefilter's", err)
			}
			if want {
				t.Fatalf("token the oracle accepts refused: %v", err)
			}
			if strings.Contains(err.Error(), tok) && len(tok) > 8 {
				t.Fatalf("refusal %q carries the token", err)
			}
			return
		}
		if !want {
			t.Fatalf("token %q let through as %+v", tok, p)
		}
		if !p.verified || p.namespace == "" || p.serviceAccount == "" {
			t.Fatalf("let through unverified or without an account: %+v", p)
		}
	})
}
