package ca

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"
)

// Identity is a workload identity: a ServiceAccount in a namespace of the mesh's trust domain.
type Identity struct {
	// TrustDomain is the SPIFFE trust domain (the URI's host).
	TrustDomain string
	// Namespace is the Kubernetes namespace of the ServiceAccount.
	Namespace string
	// ServiceAccount is the ServiceAccount's name.
	ServiceAccount string
}

// SPIFFEID returns spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>.
func (id Identity) SPIFFEID() string {
	return (&url.URL{Scheme: "spiffe", Host: id.TrustDomain, Path: "/ns/" + id.Namespace + "/sa/" + id.ServiceAccount}).String()
}

// ParseIdentity parses a SPIFFE ID of the form spiffe://<td>/ns/<ns>/sa/<sa>, with namespace and
// ServiceAccount valid Kubernetes names.
func ParseIdentity(s string) (Identity, error) {
	u, err := url.Parse(s)
	if err != nil {
		return Identity{}, fmt.Errorf("parse SPIFFE ID: %w", err)
	}
	if u.Scheme != "spiffe" || u.Host == "" || u.User != nil || u.Port() != "" || u.RawQuery != "" || u.Fragment != "" || u.Opaque != "" {
		return Identity{}, fmt.Errorf("%q is not a SPIFFE ID", s)
	}
	parts := strings.Split(u.Path, "/")
	if len(parts) != 5 || parts[0] != "" || parts[1] != "ns" || parts[3] != "sa" {
		return Identity{}, fmt.Errorf("%q is not of the form spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>", s)
	}
	if errs := validation.IsDNS1123Label(parts[2]); len(errs) > 0 {
		return Identity{}, fmt.Errorf("namespace %q: %s", parts[2], strings.Join(errs, "; "))
	}
	if errs := validation.IsDNS1123Subdomain(parts[4]); len(errs) > 0 {
		return Identity{}, fmt.Errorf("service account %q: %s", parts[4], strings.Join(errs, "; "))
	}
	return Identity{TrustDomain: u.Host, Namespace: parts[2], ServiceAccount: parts[4]}, nil
}

// validTrustDomain accepts the SPIFFE trust-domain alphabet: lower-case letters, digits, '.',
// '-' and '_'.
func validTrustDomain(td string) error {
	if td == "" {
		return errors.New("trust domain is empty")
	}
	for _, r := range td {
		if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '.' || r == '-' || r == '_') {
			return fmt.Errorf("trust domain %q: character %q not allowed", td, r)
		}
	}
	return nil
}

// splitAccount splits "namespace/serviceaccount".
func splitAccount(s string) (namespace, name string, err error) {
	ns, sa, ok := strings.Cut(s, "/")
	if !ok || ns == "" || sa == "" || strings.Contains(sa, "/") {
		return "", "", fmt.Errorf("trusted node account %q is not namespace/serviceaccount", s)
	}
	return ns, sa, nil
}

// parseIP returns the IP of an IP literal, or nil for a DNS name.
func parseIP(s string) net.IP { return net.ParseIP(s) }
