package caclient

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/isthmus-mesh/isthmus/internal/spiffe"
)

// TokenSource returns the bearer token sent to the CA. It is called for
// every request, so a rotated token is picked up at once. Implementations
// must be safe for concurrent use and must not log the token.
type TokenSource func(ctx context.Context) (string, error)

// TokenFile reads the token from path on every call (a projected
// ServiceAccount token that the kubelet rotates in place).
func TokenFile(path string) TokenSource {
	return func(context.Context) (string, error) {
		b, err := os.ReadFile(path)
		if err != nil {
			return "", fmt.Errorf("read token file: %w", err)
		}
		tok := strings.TrimSpace(string(b))
		if tok == "" {
			return "", fmt.Errorf("token file %s is empty", path)
		}
		return tok, nil
	}
}

// StaticToken always returns tok.
func StaticToken(tok string) TokenSource {
	return func(context.Context) (string, error) {
		if tok == "" {
			return "", errors.New("empty token")
		}
		return tok, nil
	}
}

// RootsFromPEM returns a pool of every CERTIFICATE in pemBytes (the mesh
// root bundle, several roots during a rotation).
func RootsFromPEM(pemBytes []byte) (*x509.CertPool, error) {
	certs, err := spiffe.ParseCertificatesPEM(pemBytes)
	if err != nil {
		return nil, err
	}
	if len(certs) == 0 {
		return nil, errors.New("no CERTIFICATE in root bundle")
	}
	pool := x509.NewCertPool()
	for _, c := range certs {
		pool.AddCert(c)
	}
	return pool, nil
}
