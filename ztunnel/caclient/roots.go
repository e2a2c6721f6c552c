package caclient

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/isthmus-mesh/isthmus/internal/spiffe"
)

// RootSource provides the roots ztunnel trusts. Both may change between
// calls (a CA root rotation, a newly federated trust domain); callers read
// them for every verification. Implementations must be safe for
// concurrent use.
type RootSource interface {
	// Roots are the control plane's roots: pilot's serving certificate
	// (CA and xDS) must chain to one of them.
	Roots() *x509.CertPool
	// TrustBundle maps each trusted trust domain to its own roots:
	// workload certificates (peers', and those the CA issues) are verified
	// against the roots of the domain they name.
	TrustBundle() *spiffe.TrustBundle
}

// StaticRoots is a RootSource that never changes. Build it with
// NewStaticRoots: a nil Bundle trusts no workload certificate.
type StaticRoots struct {
	Pool   *x509.CertPool
	Bundle *spiffe.TrustBundle
}

// Roots returns the pool.
func (s StaticRoots) Roots() *x509.CertPool { return s.Pool }

// TrustBundle returns the bundle.
func (s StaticRoots) TrustBundle() *spiffe.TrustBundle { return s.Bundle }

// NewStaticRoots parses the control plane's PEM roots and the trust bundle
// (a SPIFFE trust bundle map); without a trust bundle (nil), the PEM roots
// are the only trust domain's, trustDomain: a mesh of one trust domain.
func NewStaticRoots(trustDomain string, rootsPEM, trustBundleJSON []byte) (StaticRoots, error) {
	t, err := parseTrust(trustDomain, rootsPEM, trustBundleJSON)
	if err != nil {
		return StaticRoots{}, err
	}
	return StaticRoots{Pool: t.pool, Bundle: t.bundle}, nil
}

// trust is one consistent reading of the roots.
type trust struct {
	pool   *x509.CertPool
	bundle *spiffe.TrustBundle
	// fromPEM is set when the bundle was made from the PEM roots (no trust
	// bundle file).
	fromPEM bool
}

func parseTrust(trustDomain string, rootsPEM, trustBundleJSON []byte) (*trust, error) {
	pool, err := RootsFromPEM(rootsPEM)
	if err != nil {
		return nil, err
	}
	if trustBundleJSON == nil {
		b, err := spiffe.TrustBundleFromPEM(trustDomain, rootsPEM)
		if err != nil {
			return nil, err
		}
		return &trust{pool: pool, bundle: b, fromPEM: true}, nil
	}
	b, err := spiffe.ParseTrustBundle(trustBundleJSON)
	if err != nil {
		return nil, err
	}
	return &trust{pool: pool, bundle: b}, nil
}

// RootsFileConfig says where the roots are.
type RootsFileConfig struct {
	// Path is the control plane's PEM root bundle (the root-cert.pem pilot
	// publishes). Required.
	Path string
	// TrustBundlePath is the SPIFFE trust bundle map (the
	// trust-bundle.json pilot publishes). Empty, or a file that does not
	// exist (a pilot that publishes none): the PEM roots are TrustDomain's
	// only, and no other domain is trusted, as in a mesh of one domain.
	TrustBundlePath string
	// TrustDomain is ztunnel's own trust domain (for the fallback above).
	TrustDomain string
	// Interval is how often Run re-reads the files (10 s if <= 0).
	Interval time.Duration
}

// RootsFile is a RootSource read from files and re-read when their content
// changes: Kubernetes updates a mounted ConfigMap (the roots pilot
// publishes) in place; during a root rotation it holds the old and the new
// root, and a newly federated trust domain appears in the trust bundle. A
// change that does not parse is refused and the previous roots stay in use.
type RootsFile struct {
	cfg RootsFileConfig
	log *slog.Logger

	cur atomic.Pointer[trust]

	mu  sync.Mutex // serialises Reload
	sum [sha256.Size]byte
}

// NewRootsFile reads the roots; Run re-reads them every cfg.Interval. log
// may be nil.
func NewRootsFile(cfg RootsFileConfig, log *slog.Logger) (*RootsFile, error) {
	if cfg.Interval <= 0 {
		cfg.Interval = 10 * time.Second
	}
	if cfg.Path == "" {
		return nil, errors.New("roots: Path is required")
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	r := &RootsFile{cfg: cfg, log: log}
	if _, err := r.Reload(); err != nil {
		return nil, err
	}
	return r, nil
}

// Roots returns the control plane's roots last read.
func (r *RootsFile) Roots() *x509.CertPool { return r.cur.Load().pool }

// TrustBundle returns the trust bundle last read.
func (r *RootsFile) TrustBundle() *spiffe.TrustBundle { return r.cur.Load().bundle }

// Reload reads the files and, if their content changed and parses, makes
// it current. It reports whether the roots changed; on error the previous
// roots are kept.
func (r *RootsFile) Reload() (bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	pemBytes, err := os.ReadFile(r.cfg.Path)
	if err != nil {
		return false, fmt.Errorf("read roots: %w", err)
	}
	var bundleBytes []byte
	if r.cfg.TrustBundlePath != "" {
		switch b, err := os.ReadFile(r.cfg.TrustBundlePath); {
		case errors.Is(err, fs.ErrNotExist):
		case err != nil:
			return false, fmt.Errorf("read trust bundle: %w", err)
		default:
			bundleBytes = b
		}
	}
	h := sha256.New()
	h.Write(pemBytes)
	h.Write([]byte{0})
	if bundleBytes != nil {
		h.Write([]byte{1})
		h.Write(bundleBytes)
	}
	var sum [sha256.Size]byte
	h.Sum(sum[:0])
	if r.cur.Load() != nil && sum == r.sum {
		return false, nil
	}
	t, err := parseTrust(r.cfg.TrustDomain, pemBytes, bundleBytes)
	if err != nil {
		return false, fmt.Errorf("roots %s, trust bundle %s: %w", r.cfg.Path, r.cfg.TrustBundlePath, err)
	}
	if prev := r.cur.Load(); prev == nil || prev.fromPEM != t.fromPEM || !prev.bundle.Equal(t.bundle) {
		from := r.cfg.TrustBundlePath
		if t.fromPEM {
			from = r.cfg.Path + " (no trust bundle: one trust domain)"
		}
		r.log.Info("trusted domains", "domains", t.bundle.String(), "from", from)
	}
	r.cur.Store(t)
	r.sum = sum
	return true, nil
}

// Run re-reads the files every interval until ctx ends; it returns nil.
// Failures are logged and retried; the previous roots stay in use.
func (r *RootsFile) Run(ctx context.Context) error {
	t := time.NewTicker(r.cfg.Interval)
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
			r.log.Warn("roots not reloaded; keeping the previous roots", "path", r.cfg.Path, "trust_bundle", r.cfg.TrustBundlePath, "err", err)
			failing = true
		case err == nil && changed:
			r.log.Info("roots reloaded", "path", r.cfg.Path, "trust_bundle", r.cfg.TrustBundlePath)
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
