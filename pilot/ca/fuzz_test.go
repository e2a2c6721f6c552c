package ca

import (
	"context"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rsa"
	"crypto/x509"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/structpb"
	pb "istio.io/api/security/v1alpha1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"

	"github.com/isthmus-mesh/isthmus/internal/spiffe"
)

// fixedCaller is an Authenticator that vouches for one caller.
type fixedCaller struct{ c *Caller }

func (f fixedCaller) Authenticate(context.Context) (*Caller, error) { return f.c, nil }

// fuzzCA returns a CA with self-signed material at t0 whose authenticator
// vouches for caller. It has no cluster clients: an impersonation that
// passes every local check ends at the caller's pod lookup.
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
		Deps{ConfigClient: &kubernetes.Clientset{}, Authenticator: fixedCaller{caller}, Now: func() time.Time { return t0 }})
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
		checkLeaf(t, c, resp, csr, own)
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
	case ReasonUnknownCluster:
		// Every local check passed: the identity must be a valid one of
		// the trust domain that prints back as itself.
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
func checkLeaf(t *testing.T, c *CA, resp *pb.IstioCertificateResponse, csrPEM, want string) {
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
