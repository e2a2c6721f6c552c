package caclient

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// RootSource provides the current mesh root bundle. Roots may change
// between calls (a CA root rotation); callers read it for every
// verification. Implementations must be safe for concurrent use.
type RootSource interface {
	Roots() *x509.CertPool
}

// StaticRoots is a RootSource that never changes.
type StaticRoots struct{ Pool *x509.CertPool }

// Roots returns the pool.
func (s StaticRoots) Roots() *x509.CertPool { return s.Pool }

// RootsFile is a RootSource read from a PEM bundle file and re-read when
// the file's content changes: Kubernetes updates a mounted ConfigMap (the
// root bundle pilot publishes) in place, and during a root rotation the
// bundle holds the old and the new root. A change that does not parse is
// refused and the previous roots stay in use.
type RootsFile struct {
	path     string
	interval time.Duration
	log      *slog.Logger

	cur atomic.Pointer[x509.CertPool]

	mu  sync.Mutex // serialises Reload
	sum [sha256.Size]byte
}

// NewRootsFile reads the bundle at path; Run re-reads it every interval
// (10 s if interval <= 0). log may be nil.
func NewRootsFile(path string, interval time.Duration, log *slog.Logger) (*RootsFile, error) {
	if interval <= 0 {
		interval = 10 * time.Second
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	r := &RootsFile{path: path, interval: interval, log: log}
	if _, err := r.Reload(); err != nil {
		return nil, err
	}
	return r, nil
}

// Roots returns the roots last read.
func (r *RootsFile) Roots() *x509.CertPool { return r.cur.Load() }

// Reload reads the file and, if its content changed and parses, makes it
// the current bundle. It reports whether the roots changed; on error the
// previous roots are kept.
func (r *RootsFile) Reload() (bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	b, err := os.ReadFile(r.path)
	if err != nil {
		return false, fmt.Errorf("read roots: %w", err)
	}
	sum := sha256.Sum256(b)
	if r.cur.Load() != nil && sum == r.sum {
		return false, nil
	}
	pool, err := RootsFromPEM(b)
	if err != nil {
		return false, fmt.Errorf("roots %s: %w", r.path, err)
	}
	r.cur.Store(pool)
	r.sum = sum
	return true, nil
}

// Run re-reads the file every interval until ctx ends; it returns nil.
// Failures are logged and retried; the previous roots stay in use.
func (r *RootsFile) Run(ctx context.Context) error {
	t := time.NewTicker(r.interval)
	defer t.Stop()
	var failing bool
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		changed, err := r.Reload()
		switch {
		case err != nil && !failing:
			r.log.Warn("root bundle not reloaded; keeping the previous roots", "path", r.path, "err", err)
			failing = true
		case err == nil && changed:
			r.log.Info("root bundle reloaded", "path", r.path)
			failing = false
		case err == nil:
			failing = false
		}
	}
}

// verifyServer returns a tls.Config.VerifyConnection that checks the
// server's chain against the current roots of src and its name against
// serverName (a DNS name or an IP literal), as crypto/tls would with a
// fixed RootCAs.
func verifyServer(src RootSource, serverName string) func(tls.ConnectionState) error {
	return func(cs tls.ConnectionState) error {
		if len(cs.PeerCertificates) == 0 {
			return errors.New("server presented no certificate")
		}
		inter := x509.NewCertPool()
		for _, c := range cs.PeerCertificates[1:] {
			inter.AddCert(c)
		}
		name := serverName
		if name == "" {
			name = cs.ServerName
		}
		_, err := cs.PeerCertificates[0].Verify(x509.VerifyOptions{Roots: src.Roots(), Intermediates: inter, DNSName: name})
		return err
	}
}

// serverTLS is the client configuration for reaching pilot: chain and name
// verified against the roots current at each handshake.
func serverTLS(src RootSource, serverName string) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS12,
		ServerName: serverName,
		// Verified in VerifyConnection against the roots of the moment, so
		// that a rotated bundle applies to new connections at once.
		InsecureSkipVerify: true, //nolint:gosec // verified in VerifyConnection
		VerifyConnection:   verifyServer(src, serverName),
	}
}
