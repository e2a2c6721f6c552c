package ca_test

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
	pb "istio.io/api/security/v1alpha1"
	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/isthmus-mesh/isthmus/internal/nodebind"
	"github.com/isthmus-mesh/isthmus/pilot/ca"
)

const (
	issuedTotal  = "isthmus_ca_certificates_issued_total"
	refusedTotal = "isthmus_ca_certificate_refusals_total"
	latencyHist  = "isthmus_ca_signing_duration_seconds"
)

// publishedRoots starts a root publisher on cluster, waits for it to sync, and reads the
// ConfigMap back from the API server.
func publishedRoots(t *testing.T, c *ca.CA, id string, client kubernetes.Interface, ns string) []byte {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ensureNamespace(t, client, ns)
	comp, err := c.PublishRoots(ctx, id, client)
	require.NoError(t, err)
	t.Cleanup(comp.Close)
	require.Eventually(t, comp.HasSynced, 30*time.Second, 20*time.Millisecond)
	cm, err := client.CoreV1().ConfigMaps(ns).Get(ctx, ca.DefaultRootConfigMap, metav1.GetOptions{})
	require.NoError(t, err)
	require.NotEmpty(t, cm.Data[ca.RootCertKey])
	return []byte(cm.Data[ca.RootCertKey])
}

func call(ctx context.Context, client pb.IstioCertificateServiceClient, clusterID, tok, csr string, impersonate string) (*pb.IstioCertificateResponse, error) {
	md := metadata.MD{}
	if clusterID != "" {
		md.Set("clusterid", clusterID)
	}
	if tok != "" {
		md.Set("authorization", "Bearer "+tok)
	}
	req := &pb.IstioCertificateRequest{Csr: csr, ValidityDuration: 3600}
	if impersonate != "" {
		req.Metadata = &structpb.Struct{Fields: map[string]*structpb.Value{
			ca.ImpersonatedIdentityMetadata: structpb.NewStringValue(impersonate),
		}}
	}
	return client.CreateCertificate(metadata.NewOutgoingContext(ctx, md), req)
}

// leafOf verifies the response chain against the published roots and returns the leaf.
func leafOf(t *testing.T, resp *pb.IstioCertificateResponse, roots []byte) *x509.Certificate {
	t.Helper()
	require.GreaterOrEqual(t, len(resp.GetCertChain()), 3, "[leaf, intermediate..., root]")
	var certs []*x509.Certificate
	for _, p := range resp.GetCertChain() {
		block, rest := pem.Decode([]byte(p))
		require.NotNil(t, block)
		require.Empty(t, rest, "one certificate per element")
		c, err := x509.ParseCertificate(block.Bytes)
		require.NoError(t, err)
		certs = append(certs, c)
	}
	pool := x509.NewCertPool()
	require.True(t, pool.AppendCertsFromPEM(roots))
	inter := x509.NewCertPool()
	for _, c := range certs[1 : len(certs)-1] {
		inter.AddCert(c)
	}
	_, err := certs[0].Verify(x509.VerifyOptions{Roots: pool, Intermediates: inter,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	require.NoError(t, err, "leaf verifies against the published root")
	root := certs[len(certs)-1]
	require.True(t, pool.AppendCertsFromPEM(roots) && root.IsCA && root.CheckSignatureFrom(root) == nil, "last element is the root")
	return certs[0]
}

func onlySAN(t *testing.T, leaf *x509.Certificate, want string) {
	t.Helper()
	require.Len(t, leaf.URIs, 1)
	require.Equal(t, want, leaf.URIs[0].String())
	require.Empty(t, leaf.DNSNames)
	require.Empty(t, leaf.IPAddresses)
	require.Empty(t, leaf.EmailAddresses)
}

// A ServiceAccount of the remote cluster gets a certificate over gRPC+TLS whose chain verifies
// against the root published to (and read back from) the remote cluster, and whose only SAN is
// its SPIFFE ID; the issue is counted and timed.
func TestRemoteServiceAccountGetsCertificateTrustedByPublishedRoot(t *testing.T) {
	const ns = "isthmus-system"
	c, reg, fed := testCA(t, ns)
	roots := publishedRoots(t, c, remoteCluster, fed[remoteCluster], ns)
	client := pb.NewIstioCertificateServiceClient(serve(t, c, roots))
	tok := token(t, fed[remoteCluster], "shop", "web", []string{"istio-ca"}, nil)

	before := counter(t, reg, issuedTotal, "")
	resp, err := call(context.Background(), client, remoteCluster, tok, csrFor(t, ""), "")
	require.NoError(t, err)
	leaf := leafOf(t, resp, roots)
	onlySAN(t, leaf, "spiffe://cluster.local/ns/shop/sa/web")
	require.WithinDuration(t, time.Now().Add(time.Hour), leaf.NotAfter, time.Minute, "validity_duration honoured")
	require.Equal(t, before+1, counter(t, reg, issuedTotal, ""))
	require.Equal(t, before+1, counter(t, reg, latencyHist, ""))

	// A CSR that names the caller's own identity is accepted too.
	resp, err = call(context.Background(), client, remoteCluster, tok, csrFor(t, "spiffe://cluster.local/ns/shop/sa/web"), "")
	require.NoError(t, err)
	onlySAN(t, leafOf(t, resp, roots), "spiffe://cluster.local/ns/shop/sa/web")
}

// Every refusal carries a clear gRPC status and is counted under its reason.
func TestRefusals(t *testing.T) {
	const ns = "isthmus-system"
	c, reg, fed := testCA(t, ns)
	_, remote := clusters(t)
	roots := publishedRoots(t, c, configCluster, fed[configCluster], ns)
	client := pb.NewIstioCertificateServiceClient(serve(t, c, roots))

	good := token(t, remote.Client, "shop", "web", []string{"istio-ca"}, nil)
	ztunnelPod := createPod(t, remote.Client, ns, "ztunnel-a", "ztunnel", "node-a")
	ztunnel := token(t, remote.Client, ns, "ztunnel", []string{"istio-ca"}, ztunnelPod)
	webPod := createPod(t, remote.Client, "shop", "web-a", "web", "node-a")
	createPod(t, remote.Client, "shop", "db-b", "db", "node-b")
	gonePod := createPod(t, remote.Client, "shop", "gone", "cart", "node-a")
	boundToGone := token(t, remote.Client, "shop", "cart", []string{"istio-ca"}, gonePod)
	deletePodAndWaitTokenRefused(t, remote.Client, gonePod, boundToGone)
	// a pod-bound token of a non-node account, to show that a pod binding alone grants nothing
	webBound := token(t, remote.Client, "shop", "web", []string{"istio-ca"}, webPod)

	tests := []struct {
		name                     string
		cluster, token, csr, imp string
		code                     codes.Code
		reason                   ca.Reason
	}{
		{name: "no token", cluster: remoteCluster, csr: csrFor(t, ""), code: codes.Unauthenticated, reason: ca.ReasonNoToken},
		{name: "expired token", cluster: remoteCluster, token: expiredToken(t, remote, "shop", "web"), csr: csrFor(t, ""),
			code: codes.Unauthenticated, reason: ca.ReasonTokenExpired},
		{name: "token bound to a deleted pod", cluster: remoteCluster, token: boundToGone, csr: csrFor(t, ""),
			code: codes.Unauthenticated, reason: ca.ReasonTokenInvalid},
		{name: "cluster not federated", cluster: "cluster-9", token: good, csr: csrFor(t, ""),
			code: codes.Unauthenticated, reason: ca.ReasonUnknownCluster},
		{name: "token of another cluster presented as the config cluster's", cluster: configCluster, token: good, csr: csrFor(t, ""),
			code: codes.Unauthenticated, reason: ca.ReasonForeignIssuer},
		{name: "garbage token", cluster: remoteCluster, token: "made-up", csr: csrFor(t, ""),
			code: codes.Unauthenticated, reason: ca.ReasonTokenMalformed},
		{name: "unsigned token", cluster: remoteCluster, token: forgeAlg(t, good, "none"), csr: csrFor(t, ""),
			code: codes.Unauthenticated, reason: ca.ReasonTokenAlgorithm},
		{name: "token with forged claims", cluster: remoteCluster, csr: csrFor(t, ""),
			token: forgeClaims(t, good, func(m map[string]any) { m["sub"] = "system:serviceaccount:kube-system:admin" }),
			code:  codes.Unauthenticated, reason: ca.ReasonTokenSignature},
		{name: "node account's own certificate with a token bound to no pod", cluster: remoteCluster,
			token: token(t, remote.Client, ns, "ztunnel", []string{"istio-ca"}, nil), csr: csrFor(t, ""),
			code: codes.PermissionDenied, reason: ca.ReasonNodeAccountPod},
		{name: "wrong audience", cluster: remoteCluster, token: token(t, remote.Client, "shop", "web", []string{"some-api"}, nil), csr: csrFor(t, ""),
			code: codes.Unauthenticated, reason: ca.ReasonWrongAudience},
		{name: "CSR asks for another identity", cluster: remoteCluster, token: good, csr: csrFor(t, "spiffe://cluster.local/ns/kube-system/sa/admin"),
			code: codes.PermissionDenied, reason: ca.ReasonIdentityMismatch},
		{name: "impersonation by a non-node account", cluster: remoteCluster, token: webBound, csr: csrFor(t, ""),
			imp: "spiffe://cluster.local/ns/shop/sa/db", code: codes.PermissionDenied, reason: ca.ReasonImpersonationNotTrusted},
		{name: "impersonation of a ServiceAccount with no pod on the node", cluster: remoteCluster, token: ztunnel, csr: csrFor(t, ""),
			imp: "spiffe://cluster.local/ns/shop/sa/db", code: codes.PermissionDenied, reason: ca.ReasonImpersonationNotOnNode},
		{name: "impersonation by a node account whose token has no pod", cluster: remoteCluster,
			token: token(t, remote.Client, ns, "ztunnel", []string{"istio-ca"}, nil), csr: csrFor(t, ""),
			imp: "spiffe://cluster.local/ns/shop/sa/web", code: codes.PermissionDenied, reason: ca.ReasonImpersonationCallerPod},
		{name: "impersonation of another trust domain", cluster: remoteCluster, token: ztunnel, csr: csrFor(t, ""),
			imp: "spiffe://evil.example/ns/shop/sa/web", code: codes.InvalidArgument, reason: ca.ReasonImpersonationInvalid},
		{name: "malformed CSR", cluster: remoteCluster, token: good, csr: "-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n",
			code: codes.InvalidArgument, reason: ca.ReasonMalformedCSR},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			before := counter(t, reg, refusedTotal, string(tc.reason))
			issued := counter(t, reg, issuedTotal, "")
			_, err := call(context.Background(), client, tc.cluster, tc.token, tc.csr, tc.imp)
			st, ok := status.FromError(err)
			require.True(t, ok, "a gRPC status: %v", err)
			assert.Equal(t, tc.code, st.Code(), st.Message())
			assert.Contains(t, st.Message(), string(tc.reason))
			assert.Equal(t, before+1, counter(t, reg, refusedTotal, string(tc.reason)))
			assert.Equal(t, issued, counter(t, reg, issuedTotal, ""))
		})
	}
}

// deletePodAndWaitTokenRefused deletes pod at once (a pod with a node is otherwise only marked
// for deletion, waiting for a kubelet that never comes) and waits until the API server itself no
// longer authenticates tok, so the CA is asked only once the binding is really gone.
func deletePodAndWaitTokenRefused(t *testing.T, client kubernetes.Interface, pod *corev1.Pod, tok string) {
	t.Helper()
	zero := int64(0)
	require.NoError(t, client.CoreV1().Pods(pod.Namespace).Delete(context.Background(), pod.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero}))
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		r, err := client.AuthenticationV1().TokenReviews().Create(context.Background(), &authnv1.TokenReview{
			Spec: authnv1.TokenReviewSpec{Token: tok, Audiences: []string{"istio-ca"}}}, metav1.CreateOptions{})
		require.NoError(ct, err)
		assert.False(ct, r.Status.Authenticated)
	}, 30*time.Second, 50*time.Millisecond)
}

// A trusted node account (ztunnel, token bound to its pod on node-imp of the remote cluster)
// gets the identity of a ServiceAccount that has a pod on that node of that cluster, and not of
// one that has a pod on a node of the same name in another cluster.
func TestNodeImpersonationOfPodOnOwnNode(t *testing.T) {
	const ns = "isthmus-system"
	c, _, fed := testCA(t, ns)
	_, remote := clusters(t)
	roots := publishedRoots(t, c, configCluster, fed[configCluster], ns)
	client := pb.NewIstioCertificateServiceClient(serve(t, c, roots))
	zpod := createPod(t, remote.Client, ns, "ztunnel-imp", "ztunnel", "node-imp")
	createPod(t, remote.Client, "books", "reviews-1", "reviews", "node-imp")
	ztunnel := token(t, remote.Client, ns, "ztunnel", []string{"istio-ca"}, zpod)

	resp, err := call(context.Background(), client, remoteCluster, ztunnel, csrFor(t, ""), "spiffe://cluster.local/ns/books/sa/reviews")
	require.NoError(t, err)
	leaf := leafOf(t, resp, roots)
	onlySAN(t, leaf, "spiffe://cluster.local/ns/books/sa/reviews")
	_, err = nodebind.FromCertificate(leaf)
	require.ErrorIs(t, err, nodebind.ErrAbsent, "a workload's certificate is bound to no node")

	// Its own certificate is bound to its pod's node in its cluster.
	resp, err = call(context.Background(), client, remoteCluster, ztunnel, csrFor(t, ""), "")
	require.NoError(t, err)
	leaf = leafOf(t, resp, roots)
	onlySAN(t, leaf, "spiffe://cluster.local/ns/"+ns+"/sa/ztunnel")
	require.Equal(t, nodebind.Binding{Cluster: remoteCluster, Node: "node-imp"}, leafNode(t, leaf))

	// A node of the same name in another cluster does not count: "ratings" runs on node-imp of
	// the config cluster only, so the remote cluster's ztunnel on node-imp may not have it.
	cfgC, _ := clusters(t)
	createPod(t, cfgC.Client, "books", "ratings-1", "ratings", "node-imp")
	_, err = call(context.Background(), client, remoteCluster, ztunnel, csrFor(t, ""), "spiffe://cluster.local/ns/books/sa/ratings")
	require.Equal(t, codes.PermissionDenied, status.Code(err))
	require.Contains(t, status.Convert(err).Message(), string(ca.ReasonImpersonationNotOnNode))
}

// Two replicas racing on a fresh namespace end up with one root; a restarted instance loads the
// same root; a certificate signed by one replica verifies with the other's bundle; and an
// operator "cacerts" Secret wins over the self-signed one.
func TestRootIsSharedAcrossReplicasRestartsAndPlugin(t *testing.T) {
	ns := uniqueNamespace("ca-race")
	cfgC, remote := clusters(t)
	fed := federation{configCluster: cfgC.Client, remoteCluster: remote.Client}
	ensureNamespace(t, cfgC.Client, ns)
	newCA := func(namespace string) *ca.CA {
		c, err := ca.New(ca.Config{ClusterID: configCluster, Namespace: namespace, ServingSANs: []string{servingName}}, ca.Deps{ConfigClient: cfgC.Client, Clusters: fed})
		require.NoError(t, err)
		return c
	}
	replicas := []*ca.CA{newCA(ns), newCA(ns), newCA(ns)}
	var wg sync.WaitGroup
	errs := make([]error, len(replicas))
	for i, r := range replicas {
		wg.Go(func() { errs[i] = r.Init(context.Background()) })
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	for _, r := range replicas[1:] {
		require.Equal(t, string(replicas[0].Roots()), string(r.Roots()), "racing replicas share one root")
	}

	restarted := newCA(ns)
	require.NoError(t, restarted.Init(context.Background()))
	require.Equal(t, string(replicas[0].Roots()), string(restarted.Roots()), "a restart keeps the root")

	// A leaf from the restarted instance, served over gRPC, verifies with replica 0's bundle.
	client := pb.NewIstioCertificateServiceClient(serve(t, restarted, replicas[0].Roots()))
	tok := token(t, cfgC.Client, "default", "app", []string{"istio-ca"}, nil)
	resp, err := call(context.Background(), client, "", tok, csrFor(t, ""), "")
	require.NoError(t, err)
	onlySAN(t, leafOf(t, resp, replicas[0].Roots()), "spiffe://cluster.local/ns/default/sa/app")

	// Operator plug-in: copy the material into "cacerts" of another namespace.
	pluginNS := uniqueNamespace("ca-plugin")
	ensureNamespace(t, cfgC.Client, pluginNS)
	sec, err := cfgC.Client.CoreV1().Secrets(ns).Get(context.Background(), ca.DefaultSelfSignedSecret, metav1.GetOptions{})
	require.NoError(t, err)
	sec.ObjectMeta = metav1.ObjectMeta{Name: ca.DefaultPluginSecret, Namespace: pluginNS}
	_, err = cfgC.Client.CoreV1().Secrets(pluginNS).Create(context.Background(), sec, metav1.CreateOptions{})
	require.NoError(t, err)
	plugin := newCA(pluginNS)
	require.NoError(t, plugin.Init(context.Background()))
	require.Equal(t, string(replicas[0].Roots()), string(plugin.Roots()))
	_, err = cfgC.Client.CoreV1().Secrets(pluginNS).Get(context.Background(), ca.DefaultSelfSignedSecret, metav1.GetOptions{})
	require.True(t, err != nil, "with cacerts present no self-signed secret is made")
}

// The publisher repairs its ConfigMap when it is edited or deleted, and Close stops it.
func TestRootPublisherRepairsDrift(t *testing.T) {
	const ns = "isthmus-system"
	c, _, fed := testCA(t, ns)
	client := fed[remoteCluster]
	want := publishedRoots(t, c, remoteCluster, client, ns)
	cms := client.CoreV1().ConfigMaps(ns)

	cm, err := cms.Get(context.Background(), ca.DefaultRootConfigMap, metav1.GetOptions{})
	require.NoError(t, err)
	cm.Data[ca.RootCertKey] = "tampered"
	_, err = cms.Update(context.Background(), cm, metav1.UpdateOptions{})
	require.NoError(t, err)
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		cm, err := cms.Get(context.Background(), ca.DefaultRootConfigMap, metav1.GetOptions{})
		require.NoError(ct, err)
		assert.Equal(ct, string(want), cm.Data[ca.RootCertKey])
	}, 30*time.Second, 50*time.Millisecond, "edited bundle restored")

	require.NoError(t, cms.Delete(context.Background(), ca.DefaultRootConfigMap, metav1.DeleteOptions{}))
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		cm, err := cms.Get(context.Background(), ca.DefaultRootConfigMap, metav1.GetOptions{})
		require.NoError(ct, err)
		assert.Equal(ct, string(want), cm.Data[ca.RootCertKey])
	}, 30*time.Second, 50*time.Millisecond, "deleted bundle recreated")
}

// The publisher's watch survives its API server's restart: after it, the
// ConfigMap is repaired once the publisher watches again, and a second edit
// (which only the watch reports: the publisher has nothing left to retry)
// is repaired too.
func TestRootPublisherWatchesAgainAfterRestart(t *testing.T) {
	const ns = "isthmus-rewatch"
	c, _, fed := testCA(t, ns)
	_, remote := clusters(t)
	client := fed[remoteCluster]
	want := publishedRoots(t, c, remoteCluster, client, ns)
	require.NoError(t, remote.StopAPIServer())
	require.NoError(t, remote.RestartAPIServer())
	cms := client.CoreV1().ConfigMaps(ns)
	for i := range 2 {
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			cm, err := cms.Get(context.Background(), ca.DefaultRootConfigMap, metav1.GetOptions{})
			require.NoError(ct, err)
			cm.Data[ca.RootCertKey] = fmt.Sprintf("tampered-%d", i)
			_, err = cms.Update(context.Background(), cm, metav1.UpdateOptions{})
			require.NoError(ct, err)
		}, time.Minute, 100*time.Millisecond, "edit %d", i)
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			cm, err := cms.Get(context.Background(), ca.DefaultRootConfigMap, metav1.GetOptions{})
			require.NoError(ct, err)
			assert.Equal(ct, string(want), cm.Data[ca.RootCertKey])
		}, time.Minute, 50*time.Millisecond, "edit %d repaired", i)
	}
}
