package framework

import (
	"crypto/tls"
	"crypto/x509"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/cert"
)

// TestServingIPs starts a cluster whose serving certificate also names an
// advertise address: its admin client works with Cluster.CAData, the
// certificate verifies for that IP and the kubernetes Service's names
// (as a pod's client would check it), not for another IP, and the kubelet
// client certificate chains to the same CA for client auth.
func TestServingIPs(t *testing.T) {
	ip := net.ParseIP("10.9.9.9")
	set, err := Start(Options{Names: []string{"serving"}, ServingIPs: []net.IP{ip}})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, set.Stop()) })
	c := set.Clusters[0]
	_, err = c.Client.CoreV1().Namespaces().Get(t.Context(), "default", metav1.GetOptions{})
	require.NoError(t, err)

	roots := x509.NewCertPool()
	require.True(t, roots.AppendCertsFromPEM(c.CAData()))
	u, err := url.Parse(c.Host())
	require.NoError(t, err)
	dial := func(name string) error {
		conn, err := tls.Dial("tcp", u.Host, &tls.Config{RootCAs: roots, ServerName: name})
		if err == nil {
			conn.Close()
		}
		return err
	}
	for _, name := range []string{"10.9.9.9", "127.0.0.1", "kubernetes.default.svc.cluster.local"} {
		require.NoError(t, dial(name), name)
	}
	require.Error(t, dial("10.9.9.8"))

	certs, err := cert.CertsFromFile(filepath.Join(set.root, "serving", kubeletClientCertFile))
	require.NoError(t, err)
	_, err = certs[0].Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	require.NoError(t, err)
	require.Equal(t, []string{"system:masters"}, certs[0].Subject.Organization)
	_, err = os.Stat(filepath.Join(set.root, "serving", saKeyFile))
	require.NoError(t, err)
}
