// Package nodebind is the one encoder and decoder of the node binding: the
// non-critical X.509 extension in which the mesh CA (pilot/ca) records, in a
// node proxy's (ztunnel's) own certificate, the cluster and the Kubernetes
// node of the pod its token was bound to, and from which pilot's xDS server
// (pilot/xds) reads the node that proxy may speak for.
//
// The extension's OID is OID; its value is the DER of
//
//	NodeBinding ::= SEQUENCE {
//	    cluster UTF8String,  -- the pilot cluster ID of the caller
//	    node    UTF8String   -- the pod's spec.nodeName
//	}
//
// It is never critical, so verifiers that do not know it (TLS stacks of
// peers) ignore it. The functions are pure and safe for concurrent use.
package nodebind

import (
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"errors"
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"
)

// OID identifies the node-binding extension: arc 1.3.6.1.4.1.59934.1
// (Isthmus), item 1. See docs/security.md.
var OID = asn1.ObjectIdentifier{1, 3, 6, 1, 4, 1, 59934, 1, 1}

// Binding is what a node proxy's certificate is bound to.
type Binding struct {
	// Cluster is the ID (a DNS-1123 label) of the cluster whose API server
	// vouched for the proxy.
	Cluster string
	// Node is the Kubernetes node name (a DNS-1123 subdomain) of the
	// proxy's pod.
	Node string
}

// ErrAbsent is returned by FromCertificate when the certificate carries no
// node binding.
var ErrAbsent = errors.New("certificate carries no node binding")

type wire struct {
	Cluster string `asn1:"utf8"`
	Node    string `asn1:"utf8"`
}

// validate holds b to the names Kubernetes and pilot allow.
func (b Binding) validate() error {
	if errs := validation.IsDNS1123Label(b.Cluster); len(errs) > 0 {
		return fmt.Errorf("node binding cluster %q: %s", b.Cluster, strings.Join(errs, "; "))
	}
	if errs := validation.IsDNS1123Subdomain(b.Node); len(errs) > 0 {
		return fmt.Errorf("node binding node %q: %s", b.Node, strings.Join(errs, "; "))
	}
	return nil
}

// Extension encodes b as the (non-critical) node-binding extension.
func (b Binding) Extension() (pkix.Extension, error) {
	if err := b.validate(); err != nil {
		return pkix.Extension{}, err
	}
	der, err := asn1.Marshal(wire(b))
	if err != nil {
		return pkix.Extension{}, fmt.Errorf("encode node binding: %w", err)
	}
	return pkix.Extension{Id: OID, Value: der}, nil
}

// Parse decodes the value of a node-binding extension: exactly one DER
// NodeBinding, nothing after it, with valid names.
func Parse(value []byte) (Binding, error) {
	var w wire
	rest, err := asn1.Unmarshal(value, &w)
	if err != nil {
		return Binding{}, fmt.Errorf("decode node binding: %w", err)
	}
	if len(rest) > 0 {
		return Binding{}, fmt.Errorf("decode node binding: %d trailing bytes", len(rest))
	}
	b := Binding(w)
	if err := b.validate(); err != nil {
		return Binding{}, err
	}
	// Only the one encoding counts: what Extension would write.
	if again, err := asn1.Marshal(w); err != nil || string(again) != string(value) {
		return Binding{}, errors.New("decode node binding: not in DER")
	}
	return b, nil
}

// FromCertificate returns the node binding of cert: ErrAbsent when it has
// none, an error when it has a malformed one, a critical one or more than
// one.
func FromCertificate(cert *x509.Certificate) (Binding, error) {
	var (
		found bool
		b     Binding
	)
	for _, ext := range cert.Extensions {
		if !ext.Id.Equal(OID) {
			continue
		}
		if found {
			return Binding{}, errors.New("certificate carries more than one node binding")
		}
		if ext.Critical {
			return Binding{}, errors.New("node binding extension is marked critical")
		}
		var err error
		if b, err = Parse(ext.Value); err != nil {
			return Binding{}, err
		}
		found = true
	}
	if !found {
		return Binding{}, ErrAbsent
	}
	return b, nil
}
