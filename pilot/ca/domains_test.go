package ca_test

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	pb "istio.io/api/security/v1alpha1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/internal/spiffe"
	"github.com/isthmus-mesh/isthmus/pilot/ca"
)

// trustDomainSecret creates a trust-domain Secret in ns of the config
// cluster.
func trustDomainSecret(t *testing.T, ns, name, td string, data map[string][]byte) {
	t.Helper()
	cfgC, _ := clusters(t)
	s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns,
		Labels: map[string]string{ca.TrustDomainSecretLabel: "true"}}, Data: data}
	if td != "" {
		s.Annotations = map[string]string{ca.TrustDomainAnnotation: td}
	}
	_, err := cfgC.Client.CoreV1().Secrets(ns).Create(context.Background(), s, metav1.CreateOptions{})
	require.NoError(t, err)
}

// chainOf parses a CSR answer.
func chainOf(t *testing.T, resp *pb.IstioCertificateResponse) []*x509.Certificate {
	t.Helper()
	var out []*x509.Certificate
	for _, p := range resp.GetCertChain() {
		block, _ := pem.Decode([]byte(p))
		require.NotNil(t, block)
		c, err := x509.ParseCertificate(block.Bytes)
		require.NoError(t, err)
		out = append(out, c)
	}
	return out
}

// TestTrustDomainsIssueAndPublish, on real clusters: a trust-domain Secret
// with signing material lets the CA issue a cluster's identities in that
// domain (the remote Secret's annotation, AssignTrustDomain), signed by the
// domain's own root; one with roots only makes its domain trusted without
// issuing; a Secret that does not parse is left out and the others apply.
// The published ConfigMap carries the trust bundle, which verifies each
// leaf against its own domain's roots only, and follows a domain leaving.
func TestTrustDomainsIssueAndPublish(t *testing.T) {
	ns := uniqueNamespace("ca-domains")
	cfgC, _ := clusters(t)
	ensureNamespace(t, cfgC.Client, ns)
	net2 := selfSignedMaterial(t, uniqueNamespace("ca-dom-net2"))
	partner := selfSignedMaterial(t, uniqueNamespace("ca-dom-partner"))
	trustDomainSecret(t, ns, "network-2", "network-2.example", net2)
	trustDomainSecret(t, ns, "partner", "partner.example", map[string][]byte{ca.RootCertKey: partner[ca.RootCertKey]})
	trustDomainSecret(t, ns, "unnamed", "", map[string][]byte{ca.RootCertKey: partner[ca.RootCertKey]})
	trustDomainSecret(t, ns, "mesh-again", "cluster.local", map[string][]byte{ca.RootCertKey: partner[ca.RootCertKey]})

	c, reg, fed := testCA(t, ns)
	require.Equal(t, []string{"cluster.local", "network-2.example", "partner.example"}, c.TrustBundle().Domains(),
		"the Secrets without a name or naming the mesh's own domain are left out")
	require.Equal(t, []string{"cluster.local", "network-2.example"}, c.TrustDomains(), "partner.example is trusted, not issued")

	roots := publishedRoots(t, c, remoteCluster, fed[remoteCluster], ns)
	cm, err := fed[remoteCluster].CoreV1().ConfigMaps(ns).Get(context.Background(), ca.DefaultRootConfigMap, metav1.GetOptions{})
	require.NoError(t, err)
	published, err := spiffe.ParseTrustBundle([]byte(cm.Data[ca.TrustBundleKey]))
	require.NoError(t, err)
	require.True(t, published.Equal(c.TrustBundle()), "the published trust bundle is the CA's")

	client := pb.NewIstioCertificateServiceClient(serve(t, c, roots))
	tok := token(t, fed[remoteCluster], "shop", "web", []string{"istio-ca"}, nil)

	// The remote in network-2.example: its identities are issued there.
	assign, err := c.AssignTrustDomain(remoteCluster, 1, "network-2.example")
	require.NoError(t, err)
	require.Equal(t, "network-2.example", c.TrustDomainOf(remoteCluster))
	resp, err := call(context.Background(), client, remoteCluster, tok, csrFor(t, ""), "")
	require.NoError(t, err)
	chain := chainOf(t, resp)
	onlySAN(t, chain[0], "spiffe://network-2.example/ns/shop/sa/web")
	id, err := published.Verify(chain[:len(chain)-1], time.Now())
	require.NoError(t, err)
	require.Equal(t, "network-2.example", id.TrustDomain)
	require.Equal(t, string(net2[ca.RootCertKey]), string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: chain[len(chain)-1].Raw})),
		"signed by network-2's own root")
	meshOnly, err := spiffe.TrustBundleFromPEM("cluster.local", roots)
	require.NoError(t, err)
	_, err = meshOnly.Verify(chain[:len(chain)-1], time.Now())
	require.ErrorIs(t, err, spiffe.ErrUnknownTrustDomain)

	// A CSR naming the mesh's domain instead is refused: the identity is
	// the cluster's domain's.
	_, err = call(context.Background(), client, remoteCluster, tok, csrFor(t, "spiffe://cluster.local/ns/shop/sa/web"), "")
	require.Equal(t, codes.PermissionDenied, status.Code(err), "%v", err)

	// A domain trusted by its roots only cannot be issued in.
	before := counter(t, reg, refusedTotal, string(ca.ReasonTrustDomainUnavailable))
	later, err := c.AssignTrustDomain(remoteCluster, 2, "partner.example")
	require.NoError(t, err)
	_, err = call(context.Background(), client, remoteCluster, tok, csrFor(t, ""), "")
	require.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
	require.Contains(t, status.Convert(err).Message(), string(ca.ReasonTrustDomainUnavailable))
	require.Equal(t, before+1, counter(t, reg, refusedTotal, string(ca.ReasonTrustDomainUnavailable)))

	// Closing an older generation's assignment keeps the newer one; closing
	// the newer returns the cluster to the mesh's domain.
	assign.Close()
	require.Equal(t, "partner.example", c.TrustDomainOf(remoteCluster))
	later.Close()
	require.Equal(t, "cluster.local", c.TrustDomainOf(remoteCluster))
	resp, err = call(context.Background(), client, remoteCluster, tok, csrFor(t, ""), "")
	require.NoError(t, err)
	onlySAN(t, leafOf(t, resp, roots), "spiffe://cluster.local/ns/shop/sa/web")

	// Run follows the trust-domain Secrets: network-2 leaves, another
	// domain joins; the bundle and the published ConfigMap follow.
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- c.Run(ctx) }()
	defer func() {
		cancel()
		require.NoError(t, <-ran)
	}()
	require.NoError(t, cfgC.Client.CoreV1().Secrets(ns).Delete(context.Background(), "network-2", metav1.DeleteOptions{}))
	require.Eventually(t, func() bool { return !c.TrustBundle().Has("network-2.example") }, 30*time.Second, 20*time.Millisecond)
	trustDomainSecret(t, ns, "late", "late.example", map[string][]byte{ca.RootCertKey: net2[ca.RootCertKey]})
	require.Eventually(t, func() bool { return c.TrustBundle().Has("late.example") }, 30*time.Second, 20*time.Millisecond)
	require.Equal(t, []string{"cluster.local", "late.example", "partner.example"}, c.TrustBundle().Domains())
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		cm, err := fed[remoteCluster].CoreV1().ConfigMaps(ns).Get(context.Background(), ca.DefaultRootConfigMap, metav1.GetOptions{})
		require.NoError(ct, err)
		b, err := spiffe.ParseTrustBundle([]byte(cm.Data[ca.TrustBundleKey]))
		require.NoError(ct, err)
		assert.Equal(ct, []string{"cluster.local", "late.example", "partner.example"}, b.Domains())
	}, 30*time.Second, 50*time.Millisecond)
}
