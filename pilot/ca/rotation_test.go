package ca_test

import (
	"context"
	"crypto/x509"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/metadata"
	pb "istio.io/api/security/v1alpha1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/pilot/ca"
)

// selfSignedMaterial lets a CA generate a root in namespace ns and returns its Secret data.
func selfSignedMaterial(t *testing.T, ns string) map[string][]byte {
	t.Helper()
	cfgC, _ := clusters(t)
	ensureNamespace(t, cfgC.Client, ns)
	c, err := ca.New(ca.Config{ClusterID: configCluster, Namespace: ns}, ca.Deps{ConfigClient: cfgC.Client, Clusters: federation{}})
	require.NoError(t, err)
	require.NoError(t, c.Init(context.Background()))
	s, err := cfgC.Client.CoreV1().Secrets(ns).Get(context.Background(), ca.DefaultSelfSignedSecret, metav1.GetOptions{})
	require.NoError(t, err)
	return s.Data
}

// The documented root rotation, step by step, against real clusters, with Run following the
// plug-in Secret: the published bundle holds both roots during the overlap, leaves of the old and
// the new root both verify against it, dropping the old root ends trust in the old leaves, and
// deleting the plug-in Secret keeps the current root.
func TestRootRotationKeepsBothRootsTrustedDuringOverlap(t *testing.T) {
	ns := uniqueNamespace("ca-rotate")
	cfgC, remote := clusters(t)
	a, b := selfSignedMaterial(t, uniqueNamespace("ca-rot-a")), selfSignedMaterial(t, uniqueNamespace("ca-rot-b"))
	join := func(parts ...[]byte) []byte {
		var out []byte
		for _, p := range parts {
			out = append(out, p...)
		}
		return out
	}
	ensureNamespace(t, cfgC.Client, ns)
	secrets := cfgC.Client.CoreV1().Secrets(ns)
	_, err := secrets.Create(context.Background(), &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: ca.DefaultPluginSecret}, Data: a}, metav1.CreateOptions{})
	require.NoError(t, err)
	setPlugin := func(signing map[string][]byte, roots []byte) {
		s, err := secrets.Get(context.Background(), ca.DefaultPluginSecret, metav1.GetOptions{})
		require.NoError(t, err)
		s.Data = map[string][]byte{}
		for _, k := range []string{"ca-cert.pem", "ca-key.pem", "cert-chain.pem"} {
			s.Data[k] = signing[k]
		}
		s.Data[ca.RootCertKey] = roots
		_, err = secrets.Update(context.Background(), s, metav1.UpdateOptions{})
		require.NoError(t, err)
	}

	fed := federation{configCluster: cfgC.Client, remoteCluster: remote.Client}
	c, err := ca.New(ca.Config{ClusterID: configCluster, Namespace: ns}, ca.Deps{ConfigClient: cfgC.Client, Clusters: fed})
	require.NoError(t, err)
	require.NoError(t, c.Init(context.Background()))
	runCtx, stop := context.WithCancel(context.Background())
	runDone := make(chan error, 1)
	go func() { runDone <- c.Run(runCtx) }()
	t.Cleanup(func() {
		stop()
		require.NoError(t, <-runDone)
	})
	require.Equal(t, string(a[ca.RootCertKey]), string(publishedRoots(t, c, remoteCluster, remote.Client, ns)))
	published := func(want []byte, msg string) {
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			cm, err := remote.Client.CoreV1().ConfigMaps(ns).Get(context.Background(), ca.DefaultRootConfigMap, metav1.GetOptions{})
			require.NoError(ct, err)
			assert.Equal(ct, string(want), cm.Data[ca.RootCertKey])
		}, 30*time.Second, 50*time.Millisecond, msg)
	}
	tok := token(t, remote.Client, "shop", "web", []string{"istio-ca"}, nil)
	issue := func() *pb.IstioCertificateResponse {
		ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs("authorization", "Bearer "+tok, "clusterid", remoteCluster))
		resp, err := c.CreateCertificate(ctx, &pb.IstioCertificateRequest{Csr: csrFor(t, "")})
		require.NoError(t, err)
		return resp
	}
	oldLeaf := issue()

	// 1. Add the new root next to the old one; signing unchanged. Run picks the change up.
	setPlugin(a, join(a[ca.RootCertKey], b[ca.RootCertKey]))
	published(join(a[ca.RootCertKey], b[ca.RootCertKey]), "both roots published")

	// 2. Sign with an intermediate of the new root, both roots still trusted.
	setPlugin(b, join(a[ca.RootCertKey], b[ca.RootCertKey]))
	var newLeaf *pb.IstioCertificateResponse
	require.Eventually(t, func() bool {
		newLeaf = issue()
		return newLeaf.CertChain[len(newLeaf.CertChain)-1] == string(b[ca.RootCertKey])
	}, 30*time.Second, 50*time.Millisecond, "new leaves end in the new root")
	bundle := join(a[ca.RootCertKey], b[ca.RootCertKey])
	leafOf(t, oldLeaf, bundle)
	leafOf(t, newLeaf, bundle)

	// 3. Drop the old root: old leaves stop verifying, new ones still do.
	setPlugin(b, b[ca.RootCertKey])
	published(b[ca.RootCertKey], "only the new root published")
	leafOf(t, newLeaf, b[ca.RootCertKey])
	require.Error(t, verifyAgainst(oldLeaf, b[ca.RootCertKey]), "old leaves are no longer trusted")

	// Losing the plug-in Secret never switches the mesh to a new self-signed root.
	require.NoError(t, secrets.Delete(context.Background(), ca.DefaultPluginSecret, metav1.DeleteOptions{}))
	require.ErrorContains(t, c.Reload(context.Background()), "keeping its material")
	require.Equal(t, string(b[ca.RootCertKey]), string(c.Roots()))
	_, err = secrets.Get(context.Background(), ca.DefaultSelfSignedSecret, metav1.GetOptions{})
	require.True(t, err != nil, "no self-signed root was made")
}

func verifyAgainst(resp *pb.IstioCertificateResponse, roots []byte) error {
	var certs []*x509.Certificate
	for _, p := range resp.GetCertChain() {
		cs, err := parsePEMCerts([]byte(p))
		if err != nil {
			return err
		}
		certs = append(certs, cs...)
	}
	pool, inter := x509.NewCertPool(), x509.NewCertPool()
	pool.AppendCertsFromPEM(roots)
	for _, c := range certs[1 : len(certs)-1] {
		inter.AddCert(c)
	}
	_, err := certs[0].Verify(x509.VerifyOptions{Roots: pool, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}})
	return err
}
