package hbone

import (
	"context"
	"crypto/tls"
	"errors"
	"net/netip"
	"time"

	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
)

// ALPN is the protocol negotiated on every HBONE connection.
const ALPN = "h2"

// CertSelector returns the certificate a server presents for a connection
// that arrived at local address local.
type CertSelector func(ctx context.Context, local netip.Addr) (*tls.Certificate, error)

// ErrNoCertificate means the server has no certificate for the local address
// a connection arrived at.
var ErrNoCertificate = errors.New("no certificate for local address")

// serverTLS returns the TLS 1.3 configuration of an HBONE server: the
// certificate is chosen by the connection's local address, and the client
// must present an X509-SVID of a trust domain of src's trust bundle,
// chaining to that domain's roots.
func serverTLS(sel CertSelector, src identity.CertSource) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		NextProtos: []string{ALPN},
		// Verification happens in VerifyConnection, which also sees the
		// no-certificate case so it can be reported precisely.
		ClientAuth: tls.RequestClientCert,
		// Tunnels carry bulk data: always use full-size records.
		DynamicRecordSizingDisabled: true,
		GetCertificate: func(hello *tls.ClientHelloInfo) (*tls.Certificate, error) {
			local, ok := addrOf(hello.Conn.LocalAddr())
			if !ok {
				return nil, ErrNoCertificate
			}
			return sel(hello.Context(), local.Addr())
		},
		VerifyConnection: func(cs tls.ConnectionState) error {
			_, err := identity.VerifyPeer(cs.PeerCertificates, identity.PeerPolicy{Bundle: src.TrustBundle()}, time.Now())
			return err
		},
	}
}

// clientTLS returns the TLS 1.3 configuration of an HBONE client presenting
// cert and accepting only a peer of the identities peers, verified against
// the roots of the peer's own trust domain.
func clientTLS(cert *tls.Certificate, src identity.CertSource, peers []identity.Identity) *tls.Config {
	return &tls.Config{
		MinVersion:                  tls.VersionTLS13,
		NextProtos:                  []string{ALPN},
		DynamicRecordSizingDisabled: true,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			return cert, nil
		},
		// SPIFFE identities are URIs, not DNS names: the default
		// hostname verification cannot apply. VerifyConnection checks the
		// chain and the identity instead.
		InsecureSkipVerify: true, //nolint:gosec // verified in VerifyConnection
		VerifyConnection: func(cs tls.ConnectionState) error {
			_, err := identity.VerifyPeer(cs.PeerCertificates, identity.PeerPolicy{Bundle: src.TrustBundle(), Allowed: peers}, time.Now())
			return err
		},
	}
}
