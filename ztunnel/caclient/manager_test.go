package caclient_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/tls"
	"crypto/x509"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/isthmus-mesh/isthmus/internal/spiffe"
	"github.com/isthmus-mesh/isthmus/ztunnel/caclient"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/internal/catest"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("k8s.io/klog/v2.(*flushDaemon).run.func1"))
}

const (
	td      = "cluster.local"
	cluster = "c1"
	node    = "node-a"
	token   = "token-node-a"
)

var (
	nodeID = identity.Identity{TrustDomain: td, Namespace: catest.ControlPlaneNamespace, ServiceAccount: catest.NodeServiceAccount}
	echoID = identity.Identity{TrustDomain: td, Namespace: "default", ServiceAccount: "echo"}
)

type env struct {
	ca    *catest.Server
	m     *caclient.Manager
	store *state.Store
}

// newEnv starts the real CA with node-a's ztunnel registered and a manager
// for node-a; tweak adjusts the config and deps before New.
func newEnv(t *testing.T, tweak func(*caclient.Config, *caclient.Deps)) *env {
	t.Helper()
	srv := catest.Start(t, catest.Options{ConfigCluster: cluster})
	srv.AddNode(t, token, cluster, node)
	roots, err := caclient.NewStaticRoots(td, srv.RootsPEM, nil)
	require.NoError(t, err)
	store := state.NewStore()
	cfg := caclient.Config{Address: srv.Addr, ClusterID: cluster, Node: node, NodeIdentity: nodeID, RetryInitial: 50 * time.Millisecond}
	deps := caclient.Deps{
		Token: caclient.StaticToken(token), Roots: roots, Store: store,
		Log: slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug})),
	}
	if tweak != nil {
		tweak(&cfg, &deps)
	}
	m, err := caclient.New(cfg, deps)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, m.Close()) })
	return &env{ca: srv, m: m, store: store}
}

func (e *env) run(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.m.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
}

func workload(uid, sa, nodeName string, ip string) *state.Workload {
	return &state.Workload{
		UID: uid, Name: uid, Namespace: "default", Addresses: []netip.Addr{netip.MustParseAddr(ip)},
		Node: nodeName, TrustDomain: td, ServiceAccount: sa, Protocol: state.TunnelHBONE,
	}
}

// TestOwnAndImpersonatedCertificates proves the manager gets from the real
// CA a certificate for the node's own identity (no ImpersonatedIdentity)
// and one for a workload identity (ImpersonatedIdentity set to it), each
// with the requested SPIFFE SAN as the only one, holding the generated
// P-256 key, chaining to the mesh roots; that the token and clusterid
// metadata reach the CA; and that a second call is served from the cache.
func TestOwnAndImpersonatedCertificates(t *testing.T) {
	e := newEnv(t, nil)
	e.ca.Place(cluster, node, "default", "echo", true)
	ctx := context.Background()

	own, err := e.m.Certificate(ctx, nodeID)
	require.NoError(t, err)
	imp, err := e.m.Certificate(ctx, echoID)
	require.NoError(t, err)

	roots, err := caclient.RootsFromPEM(e.ca.RootsPEM)
	require.NoError(t, err)
	for _, tc := range []struct {
		cert *tls.Certificate
		id   identity.Identity
	}{{own, nodeID}, {imp, echoID}} {
		require.Len(t, tc.cert.Leaf.URIs, 1)
		require.Equal(t, tc.id.String(), tc.cert.Leaf.URIs[0].String())
		got, err := identity.FromCertificate(tc.cert.Leaf)
		require.NoError(t, err)
		require.Equal(t, tc.id, got)
		key, ok := tc.cert.PrivateKey.(*ecdsa.PrivateKey)
		require.True(t, ok)
		require.Equal(t, "P-256", key.Curve.Params().Name)
		require.True(t, key.PublicKey.Equal(tc.cert.Leaf.PublicKey))
		inter := x509.NewCertPool()
		for _, der := range tc.cert.Certificate[1:] {
			c, err := x509.ParseCertificate(der)
			require.NoError(t, err)
			inter.AddCert(c)
		}
		_, err = tc.cert.Leaf.Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}})
		require.NoError(t, err)
	}

	reqs := e.ca.Requests()
	require.Len(t, reqs, 2)
	require.Empty(t, reqs[0].Impersonated, "own identity is not impersonated")
	require.Equal(t, echoID.String(), reqs[1].Impersonated)
	for _, r := range reqs {
		require.Equal(t, token, r.Token)
		require.Equal(t, cluster, r.ClusterID)
		require.NoError(t, r.Err)
	}

	again, err := e.m.Certificate(ctx, echoID)
	require.NoError(t, err)
	require.Same(t, imp, again)
	require.Len(t, e.ca.Requests(), 2, "served from the cache")
	require.Equal(t, []identity.Identity{echoID, nodeID}, e.m.Identities(), "sorted by SPIFFE ID")
	dump := e.m.Dump()
	require.Len(t, dump, 2)
	for _, d := range dump {
		require.NotContains(t, d.ChainPEM, "PRIVATE KEY")
	}
}

// TestRefusalIsReturnedAndBackedOff proves a CA refusal (impersonating an
// identity with no pod on the node) reaches the caller as an error without
// the token, and that callers within the retry delay get it without a new
// request.
func TestRefusalIsReturnedAndBackedOff(t *testing.T) {
	e := newEnv(t, func(c *caclient.Config, _ *caclient.Deps) { c.RetryInitial = time.Minute })
	_, err := e.m.Certificate(context.Background(), echoID)
	require.ErrorContains(t, err, "PermissionDenied")
	require.NotContains(t, err.Error(), token)
	_, err2 := e.m.Certificate(context.Background(), echoID)
	require.Equal(t, err, err2)
	require.Len(t, e.ca.Requests(), 1)
}

// TestTokenFileReRead proves a token file is read again for each request,
// so a rotated projected token is used at once.
func TestTokenFileReRead(t *testing.T) {
	path := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(path, []byte(token+"\n"), 0o600))
	e := newEnv(t, func(_ *caclient.Config, d *caclient.Deps) { d.Token = caclient.TokenFile(path) })
	e.ca.Place(cluster, node, "default", "echo", true)
	_, err := e.m.Certificate(context.Background(), nodeID)
	require.NoError(t, err)

	e.ca.AddToken("rotated", cluster, node)
	require.NoError(t, os.WriteFile(path, []byte("rotated"), 0o600))
	_, err = e.m.Certificate(context.Background(), echoID)
	require.NoError(t, err)
	reqs := e.ca.Requests()
	require.Len(t, reqs, 2)
	require.Equal(t, token, reqs[0].Token)
	require.Equal(t, "rotated", reqs[1].Token)
}

// TestRenewAtHalfLife proves a kept certificate is renewed at half of its
// life as the CA defines it (ca.RenewAt), not before, that the renewed one
// replaces it, and that callers keep getting a valid certificate meanwhile.
func TestRenewAtHalfLife(t *testing.T) {
	// The CA backdates NotBefore by a minute: a 64 s TTL puts half-life 2 s
	// after issuance.
	e := newEnv(t, func(c *caclient.Config, _ *caclient.Deps) { c.TTL = 64 * time.Second })
	e.run(t)
	var first *tls.Certificate
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		cert, err := e.m.Certificate(context.Background(), nodeID)
		require.NoError(c, err)
		first = cert
	}, 5*time.Second, 10*time.Millisecond)
	renewAt := spiffe.RenewAt(first.Leaf)
	require.WithinDuration(t, time.Now().Add(2*time.Second), renewAt, 2*time.Second)

	require.EventuallyWithT(t, func(c *assert.CollectT) {
		cert, err := e.m.Certificate(context.Background(), nodeID)
		require.NoError(c, err)
		require.NotEqual(c, first.Leaf.SerialNumber, cert.Leaf.SerialNumber)
	}, 10*time.Second, 20*time.Millisecond)
	reqs := e.ca.Requests()
	require.GreaterOrEqual(t, len(reqs), 2)
	require.False(t, reqs[1].At.Before(renewAt), "renewed at %s, half-life is %s", reqs[1].At, renewAt)
	require.True(t, reqs[1].At.Before(first.Leaf.NotAfter))
}

// TestFollowsLocalWorkloads proves that, driven by the store, the manager
// fetches certificates for the identities of this node's workloads (and its
// own) ahead of use, never for workloads of other nodes, keeps an identity
// while one of its workloads remains, and drops it when the last leaves.
func TestFollowsLocalWorkloads(t *testing.T) {
	e := newEnv(t, nil)
	e.ca.Place(cluster, node, "default", "echo", true)
	e.ca.Place(cluster, node, "default", "client", true)
	otherID := identity.Identity{TrustDomain: td, Namespace: "default", ServiceAccount: "client"}
	e.store.Update(func(tx *state.Tx) {
		tx.UpsertWorkload(workload("echo-1", "echo", node, "127.0.0.2"))
		tx.UpsertWorkload(workload("echo-2", "echo", node, "127.0.0.3"))
		tx.UpsertWorkload(workload("client-1", "client", node, "127.0.0.4"))
		tx.UpsertWorkload(workload("remote-1", "remote", "node-b", "127.0.0.5"))
	})
	e.run(t)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.Equal(c, []identity.Identity{otherID, echoID, nodeID}, e.m.Identities())
	}, 10*time.Second, 10*time.Millisecond)
	for _, r := range e.ca.Requests() {
		require.NotContains(t, r.Impersonated, "/sa/remote")
	}

	e.store.Update(func(tx *state.Tx) { tx.RemoveWorkload("echo-1") })
	require.Never(t, func() bool { return len(e.m.Identities()) != 3 }, 300*time.Millisecond, 10*time.Millisecond)

	e.store.Update(func(tx *state.Tx) { tx.RemoveWorkload("echo-2") })
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.Equal(c, []identity.Identity{otherID, nodeID}, e.m.Identities())
	}, 10*time.Second, 10*time.Millisecond)
	for _, d := range e.m.Dump() {
		require.False(t, strings.HasSuffix(d.Identity, "/sa/echo"))
	}
}

// TestOwnOnlyFetchesNoWorkloadCertificate: a gateway (OwnOnly) on a node
// with workloads asks for its own certificate only, never one of theirs
// (it speaks for none of them; the CA refuses it as impersonation).
func TestOwnOnlyFetchesNoWorkloadCertificate(t *testing.T) {
	e := newEnv(t, func(c *caclient.Config, _ *caclient.Deps) { c.OwnOnly = true })
	e.ca.Place(cluster, node, "default", "echo", true)
	e.store.Update(func(tx *state.Tx) {
		tx.UpsertWorkload(workload("echo-1", "echo", node, "127.0.0.2"))
	})
	e.run(t)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.Equal(c, []identity.Identity{nodeID}, e.m.Identities())
	}, 10*time.Second, 10*time.Millisecond)
	e.store.Update(func(tx *state.Tx) { tx.UpsertWorkload(workload("echo-2", "echo", node, "127.0.0.3")) })
	require.Never(t, func() bool { return len(e.m.Identities()) != 1 }, 300*time.Millisecond, 10*time.Millisecond)
	for _, r := range e.ca.Requests() {
		require.Empty(t, r.Impersonated, "no request speaks for a workload")
	}
}
