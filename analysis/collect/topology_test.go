package collect_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/isthmus-mesh/isthmus/analysis"
	"github.com/isthmus-mesh/isthmus/analysis/analyzers"
	"github.com/isthmus-mesh/isthmus/analysis/collect"
	"github.com/isthmus-mesh/isthmus/analysis/msg"
	"github.com/isthmus-mesh/isthmus/internal/kubeyaml"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/pilot/ca"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// The clean topology, like the demo's: the config cluster "primary" on
// network-1 and "cluster-2" on network-2, registered by a remote Secret
// holding a reader kubeconfig; one trusted east-west gateway per network;
// namespace demo enrolled in ambient in both, with echo served from
// cluster-2 (service account echo) and called by sleep in primary; the
// same root certificate published in both.
const (
	cpNS       = "isthmus-system"
	demoNS     = "demo"
	mainSecret = "istio-remote-secret-cluster-2"
)

var (
	topologyOnce sync.Once
	topologyErr  error
	// rootA is the published root; rootB another one.
	rootA, rootB string
	// readerKubeconfig is cluster-2's reader kubeconfig.
	readerKubeconfig []byte
)

// topology builds the clean topology once per test binary.
func topology(t *testing.T) (primary, c2 *framework.Cluster) {
	t.Helper()
	primary, c2 = clusters.Cluster("primary"), clusters.Cluster("cluster-2")
	topologyOnce.Do(func() { topologyErr = buildTopology(primary, c2) })
	require.NoError(t, topologyErr)
	return primary, c2
}

func buildTopology(primary, c2 *framework.Cluster) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var err error
	if rootA, err = selfSignedPEM("root A"); err != nil {
		return err
	}
	if rootB, err = selfSignedPEM("root B"); err != nil {
		return err
	}
	ambient := map[string]string{"istio.io/dataplane-mode": "ambient"}
	gateways := []struct {
		c       *framework.Cluster
		network string
		ip      string
	}{{primary, "network-1", "192.0.2.1"}, {c2, "network-2", "192.0.2.2"}}
	for i, g := range gateways {
		for _, ns := range []string{cpNS, demoNS} {
			labels := ambient
			if ns == cpNS {
				labels = nil
			}
			if err := g.c.EnsureNamespace(ctx, ns, labels); err != nil {
				return err
			}
		}
		if err := createGateway(ctx, g.c, cpNS, "eastwest-gateway", g.network, g.ip); err != nil {
			return err
		}
		if _, err := g.c.CreatePod(ctx, framework.PodOptions{Namespace: cpNS, Name: "eastwest-gateway-0", ServiceAccount: "eastwest-gateway",
			Labels: map[string]string{"app": "eastwest-gateway"}, IP: netip.AddrFrom4([4]byte{10, byte(i + 1), 255, 1}), Ready: true}); err != nil {
			return err
		}
		if err := setRoots(ctx, g.c, rootA); err != nil {
			return err
		}
		if _, err := g.c.CreateService(ctx, demoNS, "echo", map[string]string{"app": "echo"}, framework.ServicePort{Name: "tcp-echo", Port: 80, TargetPort: 8080}); err != nil {
			return err
		}
	}
	if _, err := c2.CreatePod(ctx, framework.PodOptions{Namespace: demoNS, Name: "echo-0", ServiceAccount: "echo",
		Labels: map[string]string{"app": "echo"}, IP: netip.MustParseAddr("10.2.0.10"), Ready: true}); err != nil {
		return err
	}
	if _, err := primary.CreatePod(ctx, framework.PodOptions{Namespace: demoNS, Name: "sleep-0", ServiceAccount: "sleep",
		Labels: map[string]string{"app": "sleep"}, IP: netip.MustParseAddr("10.1.0.10"), Ready: true}); err != nil {
		return err
	}
	if readerKubeconfig, err = c2.ReaderKubeconfig(ctx, "cluster-2", remotesecret.ReaderOptions{}); err != nil {
		return err
	}
	return createSecret(ctx, primary, mainSecret, "network-2", map[string][]byte{"cluster-2": readerKubeconfig})
}

// createGateway creates an east-west gateway Service for network with an
// external IP, selecting app=<name>.
func createGateway(ctx context.Context, c *framework.Cluster, ns, name, network, ip string) error {
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{"topology.istio.io/network": network}},
		Spec: corev1.ServiceSpec{
			Selector:    map[string]string{"app": name},
			Ports:       []corev1.ServicePort{{Name: "tls-hbone", Port: 15008, Protocol: corev1.ProtocolTCP, TargetPort: intstr.FromInt32(15008)}},
			ExternalIPs: []string{ip},
		},
	}
	if ip == "" {
		svc.Spec.ExternalIPs = nil
	}
	_, err := c.Client.CoreV1().Services(ns).Create(ctx, svc, metav1.CreateOptions{})
	return err
}

// setRoots publishes a root bundle as pilot does.
func setRoots(ctx context.Context, c *framework.Cluster, bundle string) error {
	cms := c.Client.CoreV1().ConfigMaps(cpNS)
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: ca.DefaultRootConfigMap, Namespace: cpNS}, Data: map[string]string{ca.RootCertKey: bundle}}
	if _, err := cms.Update(ctx, cm, metav1.UpdateOptions{}); !apierrors.IsNotFound(err) {
		return err
	}
	_, err := cms.Create(ctx, cm, metav1.CreateOptions{})
	return err
}

// createSecret writes a remote Secret into primary's control-plane namespace.
func createSecret(ctx context.Context, primary *framework.Cluster, name, network string, data map[string][]byte) error {
	s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: cpNS,
		Labels:      map[string]string{remotesecret.IstioLabel: "true"},
		Annotations: map[string]string{remotesecret.NetworkAnnotation: network}}, Data: data}
	_, err := primary.Client.CoreV1().Secrets(cpNS).Create(ctx, s, metav1.CreateOptions{})
	return err
}

func selfSignedPEM(cn string) (string, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", err
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: cn}, IsCA: true, BasicConstraintsValid: true,
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour), KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return "", err
	}
	return string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})), nil
}

// kubeconfig builds a remote kubeconfig for id with a bearer token.
func kubeconfig(t *testing.T, id, server string, caData []byte, token string) []byte {
	t.Helper()
	kc := clientcmdapi.NewConfig()
	kc.Clusters[id] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: caData}
	kc.AuthInfos[id] = &clientcmdapi.AuthInfo{Token: token}
	kc.Contexts[id] = &clientcmdapi.Context{Cluster: id, AuthInfo: id}
	kc.CurrentContext = id
	b, err := clientcmd.Write(*kc)
	require.NoError(t, err)
	return b
}

// addSecret creates a remote Secret for the test's life.
func addSecret(t *testing.T, name string, data map[string][]byte) {
	t.Helper()
	primary, _ := topology(t)
	ctx := context.Background()
	require.NoError(t, createSecret(ctx, primary, name, "network-2", data))
	t.Cleanup(func() {
		require.NoError(t, primary.Client.CoreV1().Secrets(cpNS).Delete(context.Background(), name, metav1.DeleteOptions{}))
	})
}

// cleanup deletes what create made, when the test ends.
func cleanup(t *testing.T, del func(ctx context.Context) error) {
	t.Cleanup(func() {
		if err := del(context.Background()); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("cleanup: %v", err)
		}
	})
}

// analyzeLive collects the live snapshot as `isthmusctl analyze` does for
// the topology and runs every analyzer.
func analyzeLive(t *testing.T, mesh analysis.Mesh) (*analysis.Snapshot, []msg.Message) {
	t.Helper()
	primary, _ := topology(t)
	mesh.Namespace = cpNS
	mesh.ConfigCluster = "primary"
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	snap, err := collect.Live(ctx, collect.LiveConfig{Mesh: mesh, ConfigNetwork: "network-1", Timeout: 20 * time.Second},
		collect.LiveDeps{ConfigCluster: primary.Config})
	require.NoError(t, err)
	msgs, err := analysis.Run(snap, analyzers.All(), nil)
	require.NoError(t, err)
	return snap, msgs
}

// findings renders messages as "CODE resource cluster" lines.
func findings(msgs []msg.Message) []string {
	var out []string
	for _, m := range msgs {
		out = append(out, m.Type.Code+" "+m.Resource.String()+" "+m.Resource.Cluster)
	}
	return out
}

// requireOnly asserts that the messages are exactly want (as findings
// lines) and returns them for closer checks.
func requireOnly(t *testing.T, msgs []msg.Message, want ...string) []msg.Message {
	t.Helper()
	got := findings(msgs)
	slices.Sort(got)
	slices.Sort(want)
	require.Equal(t, want, got, "messages:\n%s", texts(msgs))
	return msgs
}

func texts(msgs []msg.Message) string {
	var b strings.Builder
	for _, m := range msgs {
		b.WriteString(m.String() + "\n")
	}
	return b.String()
}

// authorizationPolicyCRD writes the AuthorizationPolicy CRD of the
// istio.io/api module (only that one: the module's file holds every Istio
// CRD) into a temporary folder and returns its path.
func authorizationPolicyCRD(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "istio.io/api").Output()
	require.NoError(t, err, "locate the istio.io/api module")
	objs, err := kubeyaml.LoadFile(filepath.Join(strings.TrimSpace(string(out)), "kubernetes", "customresourcedefinitions.gen.yaml"))
	require.NoError(t, err)
	for _, o := range objs {
		if o.GetKind() == "CustomResourceDefinition" && o.GetName() == "authorizationpolicies.security.istio.io" {
			raw, err := o.MarshalJSON()
			require.NoError(t, err)
			path := filepath.Join(t.TempDir(), "authorizationpolicies.json")
			require.NoError(t, os.WriteFile(path, raw, 0o644))
			return path
		}
	}
	t.Fatal("no AuthorizationPolicy CRD in istio.io/api")
	return ""
}

// waitNewerSecond waits until the wall clock is in a later second than
// when called, so that the next object created has a later
// creationTimestamp (whole seconds) than those created before.
func waitNewerSecond(t *testing.T) {
	t.Helper()
	start := time.Now().Truncate(time.Second)
	require.Eventually(t, func() bool { return time.Now().Truncate(time.Second).After(start) }, 5*time.Second, 20*time.Millisecond)
}
