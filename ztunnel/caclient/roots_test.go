package caclient_test

import (
	"context"
	"crypto/x509"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/internal/spiffe"
	"github.com/isthmus-mesh/isthmus/ztunnel/caclient"
	"github.com/isthmus-mesh/isthmus/ztunnel/internal/catest"
)

// TestRootRotationFollowsTheFile proves a ztunnel follows a CA root
// rotation through its root bundle file. The manager trusts CA A's root
// only and is pointed at CA B: the TLS handshake fails. Once the file holds
// A's and B's roots (the bundle pilot publishes during a rotation) and is
// reloaded, the same manager gets a certificate from B, verified against
// B's root. A broken file is refused and the previous roots stay.
func TestRootRotationFollowsTheFile(t *testing.T) {
	a := catest.Start(t, catest.Options{ConfigCluster: cluster})
	b := catest.Start(t, catest.Options{ConfigCluster: cluster})
	b.AddNode(t, token, cluster, node)
	path := filepath.Join(t.TempDir(), "root-cert.pem")
	require.NoError(t, os.WriteFile(path, a.RootsPEM, 0o644))
	roots, err := caclient.NewRootsFile(caclient.RootsFileConfig{Path: path, TrustDomain: td, Interval: time.Hour}, nil)
	require.NoError(t, err)

	m, err := caclient.New(caclient.Config{Address: b.Addr, ClusterID: cluster, Node: node, NodeIdentity: nodeID, RetryInitial: time.Millisecond, RetryMax: time.Millisecond},
		caclient.Deps{Token: caclient.StaticToken(token), Roots: roots})
	require.NoError(t, err)
	defer m.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = m.Certificate(ctx, nodeID)
	require.ErrorContains(t, err, "certificate signed by unknown authority")

	// The rotation bundle: both roots.
	require.NoError(t, os.WriteFile(path, append(append([]byte{}, a.RootsPEM...), b.RootsPEM...), 0o644))
	changed, err := roots.Reload()
	require.NoError(t, err)
	require.True(t, changed)
	changed, err = roots.Reload()
	require.NoError(t, err)
	require.False(t, changed, "same content: no change")
	require.Eventually(t, func() bool {
		cert, err := m.Certificate(ctx, nodeID)
		return err == nil && cert.Leaf != nil
	}, 10*time.Second, 10*time.Millisecond)
	require.Len(t, b.Requests(), 1)

	// A broken bundle is refused; the roots stay A+B.
	before := roots.Roots()
	require.NoError(t, os.WriteFile(path, []byte("not a certificate"), 0o644))
	_, err = roots.Reload()
	require.ErrorContains(t, err, "no CERTIFICATE")
	require.Same(t, before, roots.Roots())
	require.NoError(t, os.Remove(path))
	_, err = roots.Reload()
	require.Error(t, err)
	require.Same(t, before, roots.Roots())
}

// TestRootsFileRun proves Run picks up a changed file by itself.
func TestRootsFileRun(t *testing.T) {
	a := catest.Start(t, catest.Options{ConfigCluster: cluster})
	b := catest.Start(t, catest.Options{ConfigCluster: cluster})
	path := filepath.Join(t.TempDir(), "root-cert.pem")
	require.NoError(t, os.WriteFile(path, a.RootsPEM, 0o644))
	roots, err := caclient.NewRootsFile(caclient.RootsFileConfig{Path: path, TrustDomain: td, Interval: 5 * time.Millisecond}, nil)
	require.NoError(t, err)
	first := roots.Roots()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- roots.Run(ctx) }()
	defer func() {
		cancel()
		require.NoError(t, <-done)
	}()
	require.NoError(t, os.WriteFile(path, b.RootsPEM, 0o644))
	require.Eventually(t, func() bool { return roots.Roots() != first }, 10*time.Second, 5*time.Millisecond)
	_, err = caclient.NewRootsFile(caclient.RootsFileConfig{Path: filepath.Join(t.TempDir(), "missing.pem")}, nil)
	require.ErrorContains(t, err, "read roots")
}

// TestTrustBundleFile proves issued certificates are verified against the
// trust bundle's roots of their own trust domain, not against the control
// plane's PEM roots: with a bundle that trusts the CA's root only for
// another domain, the CA's cluster.local certificate is refused, although
// the handshake with the CA (PEM roots) succeeds. Once the bundle names
// cluster.local with that root, the certificate is accepted. A broken
// bundle is refused and the previous one stays; a bundle file that goes
// away leaves the PEM roots as the one domain's (a pilot that publishes no
// bundle).
func TestTrustBundleFile(t *testing.T) {
	a := catest.Start(t, catest.Options{ConfigCluster: cluster})
	a.AddNode(t, token, cluster, node)
	dir := t.TempDir()
	pemPath, bundlePath := filepath.Join(dir, "root-cert.pem"), filepath.Join(dir, "trust-bundle.json")
	require.NoError(t, os.WriteFile(pemPath, a.RootsPEM, 0o644))
	aRoots, err := spiffe.ParseCertificatesPEM(a.RootsPEM)
	require.NoError(t, err)
	wrong, err := spiffe.NewTrustBundle(map[string][]*x509.Certificate{"elsewhere.example": aRoots})
	require.NoError(t, err)
	writeBundle(t, bundlePath, wrong)
	roots, err := caclient.NewRootsFile(caclient.RootsFileConfig{Path: pemPath, TrustBundlePath: bundlePath, TrustDomain: td, Interval: time.Hour}, nil)
	require.NoError(t, err)
	require.Equal(t, []string{"elsewhere.example"}, roots.TrustBundle().Domains())

	m, err := caclient.New(caclient.Config{Address: a.Addr, ClusterID: cluster, Node: node, NodeIdentity: nodeID, RetryInitial: time.Millisecond, RetryMax: time.Millisecond},
		caclient.Deps{Token: caclient.StaticToken(token), Roots: roots})
	require.NoError(t, err)
	defer m.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = m.Certificate(ctx, nodeID)
	require.ErrorIs(t, err, spiffe.ErrUnknownTrustDomain)
	require.ErrorContains(t, err, "does not chain to the roots of its trust domain")

	right, err := spiffe.NewTrustBundle(map[string][]*x509.Certificate{td: aRoots, "elsewhere.example": aRoots})
	require.NoError(t, err)
	writeBundle(t, bundlePath, right)
	changed, err := roots.Reload()
	require.NoError(t, err)
	require.True(t, changed)
	require.Eventually(t, func() bool {
		cert, err := m.Certificate(ctx, nodeID)
		return err == nil && cert.Leaf != nil
	}, 10*time.Second, 10*time.Millisecond)

	require.NoError(t, os.WriteFile(bundlePath, []byte(`{"trust_domains": {"Bad": {}}}`), 0o644))
	_, err = roots.Reload()
	require.ErrorContains(t, err, "trust bundle")
	require.True(t, roots.TrustBundle().Equal(right), "a broken bundle leaves the previous one")

	require.NoError(t, os.Remove(bundlePath))
	changed, err = roots.Reload()
	require.NoError(t, err)
	require.True(t, changed)
	require.Equal(t, []string{td}, roots.TrustBundle().Domains(), "no bundle file: the PEM roots are the own domain's")
}

func writeBundle(t *testing.T, path string, b *spiffe.TrustBundle) {
	t.Helper()
	data, err := b.Marshal()
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(path, data, 0o644))
}
