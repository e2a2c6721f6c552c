package ca

import (
	"fmt"
	"net"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/isthmus-mesh/isthmus/internal/spiffe"
)

// Identity is a workload identity: a ServiceAccount in a namespace of the
// mesh's trust domain (the mesh's one SPIFFE type).
type Identity = spiffe.Identity

// ParseIdentity parses a SPIFFE ID of the form spiffe://<td>/ns/<ns>/sa/<sa>
// (internal/spiffe, the mesh's one parser) and, as the CA's own policy,
// requires the namespace and ServiceAccount to be valid Kubernetes names.
func ParseIdentity(s string) (Identity, error) {
	id, err := spiffe.Parse(s)
	if err != nil {
		return Identity{}, err
	}
	if errs := validation.IsDNS1123Label(id.Namespace); len(errs) > 0 {
		return Identity{}, fmt.Errorf("namespace %q: %s", id.Namespace, strings.Join(errs, "; "))
	}
	if errs := validation.IsDNS1123Subdomain(id.ServiceAccount); len(errs) > 0 {
		return Identity{}, fmt.Errorf("service account %q: %s", id.ServiceAccount, strings.Join(errs, "; "))
	}
	return id, nil
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
