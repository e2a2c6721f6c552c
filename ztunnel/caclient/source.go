package caclient

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"strings"
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
	certs, err := parseCerts(pemBytes)
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

// parseCerts decodes every CERTIFICATE block of data, skipping other blocks.
func parseCerts(data []byte) ([]*x509.Certificate, error) {
	var out []*x509.Certificate
	for {
		var block *pem.Block
		block, data = pem.Decode(data)
		if block == nil {
			return out, nil
		}
		if block.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("parse certificate: %w", err)
		}
		out = append(out, c)
	}
}
