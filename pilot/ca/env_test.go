package ca_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"net"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"

	"github.com/isthmus-mesh/isthmus/pilot/ca"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// Cluster names of the test set: the config cluster holds the CA Secret; the remote is federated.
const (
	configCluster = "config"
	remoteCluster = "remote"
	servingName   = "isthmusd.isthmus-system.svc"
)

var (
	envOnce sync.Once
	envSet  *framework.ClusterSet
	envErr  error
)

// TestMain stops the clusters (started on first use, so pure-logic tests need no binaries) and
// then checks that no goroutine outlives the tests.
func TestMain(m *testing.M) {
	code := m.Run()
	if envSet != nil {
		if err := envSet.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "stop clusters:", err)
			code = 1
		}
	}
	if code == 0 {
		if err := goleak.Find(
			goleak.IgnoreTopFunction("k8s.io/klog/v2.(*flushDaemon).run.func1"),
		); err != nil {
			fmt.Fprintln(os.Stderr, "goroutine leak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// clusters starts (once) a config cluster and a remote cluster on real kube-apiservers.
func clusters(t testing.TB) (cfg, remote *framework.Cluster) {
	t.Helper()
	envOnce.Do(func() {
		opts := framework.Options{Names: []string{configCluster, remoteCluster}}
		if os.Getenv("ISTHMUS_TEST_CLUSTER_LOGS") != "" {
			opts.Output = os.Stderr
		}
		envSet, envErr = framework.Start(opts)
	})
	require.NoError(t, envErr, "real clusters are needed: build them with hack/build-testbin.sh and export KUBEBUILDER_ASSETS")
	return envSet.Cluster(configCluster), envSet.Cluster(remoteCluster)
}

// federation is the test's Clusters: the clients of the clusters it federates.
type federation map[string]kubernetes.Interface

func (f federation) KubeClient(id string) (kubernetes.Interface, bool) {
	c, ok := f[id]
	return c, ok
}

// podLister is the test's NodeIndex: it lists pods on the node in the real API server.
type podLister struct{ clusters federation }

func (p podLister) ServiceAccountOnNode(cluster, node, namespace, sa string) bool {
	c, ok := p.clusters[cluster]
	if !ok {
		return false
	}
	pods, err := c.CoreV1().Pods(namespace).List(context.Background(), metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("spec.nodeName", node).String(),
	})
	if err != nil {
		return false
	}
	for _, pod := range pods.Items {
		if pod.Spec.ServiceAccountName == sa {
			return true
		}
	}
	return false
}

// testCA builds and initializes a CA on the config cluster, federating both clusters.
func testCA(t testing.TB, namespace string) (*ca.CA, *prometheus.Registry, federation) {
	t.Helper()
	cfgC, remote := clusters(t)
	fed := federation{configCluster: cfgC.Client, remoteCluster: remote.Client}
	ensureNamespace(t, cfgC.Client, namespace)
	reg := prometheus.NewRegistry()
	c, err := ca.New(ca.Config{ClusterID: configCluster, Namespace: namespace, MaxTTL: 48 * time.Hour, ServingSANs: []string{servingName}},
		ca.Deps{ConfigClient: cfgC.Client, Clusters: fed, Nodes: podLister{fed}, Registerer: reg})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, c.Init(ctx))
	return c, reg, fed
}

func ensureNamespace(t testing.TB, c kubernetes.Interface, name string) {
	t.Helper()
	_, err := c.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if !apierrors.IsAlreadyExists(err) {
		require.NoError(t, err)
	}
}

func ensureServiceAccount(t testing.TB, c kubernetes.Interface, ns, name string) {
	t.Helper()
	ensureNamespace(t, c, ns)
	_, err := c.CoreV1().ServiceAccounts(ns).Create(context.Background(), &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if !apierrors.IsAlreadyExists(err) {
		require.NoError(t, err)
	}
}

// createPod makes a Pod object of sa on node (no kubelet runs it: the object is what counts),
// named name-<random> so that tests can run again in the same clusters.
func createPod(t testing.TB, c kubernetes.Interface, ns, name, sa, node string) *corev1.Pod {
	t.Helper()
	ensureServiceAccount(t, c, ns, sa)
	pod, err := c.CoreV1().Pods(ns).Create(context.Background(), &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{GenerateName: name + "-"},
		Spec: corev1.PodSpec{
			ServiceAccountName: sa, NodeName: node,
			Containers: []corev1.Container{{Name: "app", Image: "example.invalid/app"}},
		},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	return pod
}

// token asks the API server for a token of ns/sa (TokenRequest), bound to pod when given.
func token(t testing.TB, c kubernetes.Interface, ns, sa string, audiences []string, pod *corev1.Pod) string {
	t.Helper()
	ensureServiceAccount(t, c, ns, sa)
	req := &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{Audiences: audiences}}
	if pod != nil {
		req.Spec.BoundObjectRef = &authnv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID}
	}
	tr, err := c.CoreV1().ServiceAccounts(ns).CreateToken(context.Background(), sa, req, metav1.CreateOptions{})
	require.NoError(t, err)
	return tr.Status.Token
}

// expiredToken returns a token that differs from a real TokenRequest token of ns/sa only in
// its times (exp five minutes ago, beyond the API server's one-minute leeway), signed with the
// cluster's own service-account signing key, read from the running kube-apiserver's flags. The
// API server refuses TokenRequests shorter than ten minutes, so this is the way to get a token
// whose only fault is having expired.
func expiredToken(t testing.TB, cl *framework.Cluster, ns, sa string) string {
	t.Helper()
	real := token(t, cl.Client, ns, sa, []string{"istio-ca"}, nil)
	parts := strings.Split(real, ".")
	require.Len(t, parts, 3)
	payload, err := base64.RawURLEncoding.DecodeString(parts[1])
	require.NoError(t, err)
	var claims map[string]any
	require.NoError(t, json.Unmarshal(payload, &claims))
	now := time.Now()
	claims["iat"] = now.Add(-20 * time.Minute).Unix()
	claims["nbf"] = now.Add(-20 * time.Minute).Unix()
	claims["exp"] = now.Add(-5 * time.Minute).Unix()
	payload, err = json.Marshal(claims)
	require.NoError(t, err)
	signingInput := parts[0] + "." + base64.RawURLEncoding.EncodeToString(payload)

	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", cl.APIServerPID()))
	require.NoError(t, err)
	var keyFile string
	for _, arg := range strings.Split(string(cmdline), "\x00") {
		if v, ok := strings.CutPrefix(arg, "--service-account-signing-key-file="); ok {
			keyFile = v
		}
	}
	require.NotEmpty(t, keyFile, "kube-apiserver flags name the signing key")
	keyPEM, err := os.ReadFile(keyFile)
	require.NoError(t, err)
	block, _ := pem.Decode(keyPEM)
	require.NotNil(t, block)
	k, err := x509.ParsePKCS8PrivateKey(block.Bytes)
	if err != nil {
		k, err = x509.ParseECPrivateKey(block.Bytes)
	}
	require.NoError(t, err)
	key, ok := k.(*ecdsa.PrivateKey)
	require.True(t, ok, "envtest signs service-account tokens with ECDSA, got %T", k)
	digest := sha256.Sum256([]byte(signingInput))
	r, s, err := ecdsa.Sign(rand.Reader, key, digest[:])
	require.NoError(t, err)
	size := (key.Curve.Params().BitSize + 7) / 8
	sig := make([]byte, 2*size)
	r.FillBytes(sig[:size])
	s.FillBytes(sig[size:])
	return signingInput + "." + base64.RawURLEncoding.EncodeToString(sig)
}

var nsSeq atomic.Int64

// uniqueNamespace returns prefix-<n>-<time>, a namespace no earlier run of the test used.
func uniqueNamespace(prefix string) string {
	return fmt.Sprintf("%s-%d-%d", prefix, nsSeq.Add(1), time.Now().UnixNano()%1_000_000)
}

// csrFor makes a P-256 CSR, with uri as its only SAN when not empty.
func csrFor(t testing.TB, uri string) string {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.CertificateRequest{Subject: pkix.Name{Organization: []string{"test"}}}
	if uri != "" {
		u, err := url.Parse(uri)
		require.NoError(t, err)
		tmpl.URIs = append(tmpl.URIs, u)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, tmpl, key)
	require.NoError(t, err)
	return string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der}))
}

// serve runs c's CSR service on a real TLS listener at 127.0.0.1:0 and returns a client
// connection that trusts roots and expects servingName.
func serve(t testing.TB, c *ca.CA, roots []byte) *grpc.ClientConn {
	t.Helper()
	return dialFrom(t, serveOn(t, c), roots, "")
}

// serveOn runs c's CSR service on a real TLS listener at 127.0.0.1:0 until the test ends and
// returns its address.
func serveOn(t testing.TB, c *ca.CA) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer(grpc.Creds(credentials.NewTLS(c.ServerTLSConfig())))
	c.Register(srv)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-done
	})
	return lis.Addr().String()
}

// dialFrom connects to addr, trusting roots and expecting servingName, from the loopback
// source address src ("" for any).
func dialFrom(t testing.TB, addr string, roots []byte, src string) *grpc.ClientConn {
	t.Helper()
	pool := x509.NewCertPool()
	require.True(t, pool.AppendCertsFromPEM(roots))
	opts := []grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: pool, ServerName: servingName, MinVersion: tls.VersionTLS12}))}
	if src != "" {
		local := &net.TCPAddr{IP: net.ParseIP(src)}
		opts = append(opts, grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) {
			d := net.Dialer{LocalAddr: local}
			return d.DialContext(ctx, "tcp", a)
		}))
	}
	conn, err := grpc.NewClient(addr, opts...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// counter reads a counter of reg, with the given label value for "reason" when not empty.
func counter(t testing.TB, reg *prometheus.Registry, name, reason string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if reason == "" || labelIs(m, "reason", reason) {
				if m.GetCounter() != nil {
					return m.GetCounter().GetValue()
				}
				return float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return 0
}

func labelIs(m *dto.Metric, name, value string) bool {
	for _, l := range m.GetLabel() {
		if l.GetName() == name && l.GetValue() == value {
			return true
		}
	}
	return false
}

func parsePEMCerts(data []byte) ([]*x509.Certificate, error) {
	var out []*x509.Certificate
	for {
		var block *pem.Block
		block, data = pem.Decode(data)
		if block == nil {
			return out, nil
		}
		c, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return nil, err
		}
		out = append(out, c)
	}
}
