package framework

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"math"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"

	"k8s.io/client-go/util/cert"
	"k8s.io/client-go/util/keyutil"
)

// The files of a cluster's folder that envtest reads instead of making its
// own when they exist (apiserver.crt, apiserver.key, sa-signer.*), and the
// kubelet client pair made alongside.
const (
	servingCertFile       = "apiserver.crt"
	servingKeyFile        = "apiserver.key"
	saCertFile            = "sa-signer.crt"
	saKeyFile             = "sa-signer.key"
	kubeletClientCertFile = "kubelet-client.crt"
	kubeletClientKeyFile  = "kubelet-client.key"
)

// kubernetesServiceNames are the DNS names pods use for the API server.
var kubernetesServiceNames = []string{
	"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local",
}

// writeCerts makes a CA in dir and signs with it the API server's serving
// certificate (for 127.0.0.1, ips and kubernetesServiceNames) and a client
// certificate the API server presents to kubelets (system:masters); it
// writes the service account signing pair too, which envtest then also
// leaves alone. It returns the CA certificate (PEM).
func writeCerts(dir string, ips []net.IP) ([]byte, error) {
	caKey, err := newKey()
	if err != nil {
		return nil, err
	}
	ca, err := cert.NewSelfSignedCACert(cert.Config{CommonName: "isthmus-test-cluster-ca"}, caKey)
	if err != nil {
		return nil, err
	}
	serving := &x509.Certificate{
		Subject:     pkix.Name{CommonName: "kube-apiserver"},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses: append([]net.IP{net.IPv4(127, 0, 0, 1)}, ips...), DNSNames: kubernetesServiceNames,
	}
	client := &x509.Certificate{
		Subject:     pkix.Name{CommonName: "kube-apiserver-kubelet-client", Organization: []string{"system:masters"}},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	for _, leaf := range []struct {
		tmpl        *x509.Certificate
		certF, keyF string
	}{{serving, servingCertFile, servingKeyFile}, {client, kubeletClientCertFile, kubeletClientKeyFile}} {
		if err := signLeaf(dir, leaf.tmpl, ca, caKey, leaf.certF, leaf.keyF); err != nil {
			return nil, err
		}
	}
	saKey, err := newKey()
	if err != nil {
		return nil, err
	}
	sa, err := cert.NewSelfSignedCACert(cert.Config{CommonName: "isthmus-test-service-accounts"}, saKey)
	if err != nil {
		return nil, err
	}
	if err := writePair(dir, saCertFile, saKeyFile, sa.Raw, saKey); err != nil {
		return nil, err
	}
	return cert.EncodeCertificates(ca)
}

// signLeaf fills in tmpl's serial, validity and key usage, signs it with
// the CA and writes the pair.
func signLeaf(dir string, tmpl, ca *x509.Certificate, caKey crypto.Signer, certFile, keyFile string) error {
	key, err := newKey()
	if err != nil {
		return err
	}
	serial, err := rand.Int(rand.Reader, big.NewInt(math.MaxInt64))
	if err != nil {
		return err
	}
	tmpl.SerialNumber = serial
	tmpl.NotBefore = time.Now().Add(-time.Hour)
	tmpl.NotAfter = time.Now().Add(10 * 365 * 24 * time.Hour)
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, key.Public(), caKey)
	if err != nil {
		return fmt.Errorf("sign %s: %w", tmpl.Subject.CommonName, err)
	}
	return writePair(dir, certFile, keyFile, der, key)
}

func newKey() (crypto.Signer, error) { return ecdsa.GenerateKey(elliptic.P256(), rand.Reader) }

// writePair writes a certificate (DER) and its key as PEM files in dir.
func writePair(dir, certFile, keyFile string, der []byte, key crypto.Signer) error {
	keyPEM, err := keyutil.MarshalPrivateKeyToPEM(key)
	if err != nil {
		return err
	}
	certPEM, err := cert.EncodeCertificates(&x509.Certificate{Raw: der})
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, certFile), certPEM, 0o600); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, keyFile), keyPEM, 0o600)
}
