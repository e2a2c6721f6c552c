package remotesecret_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
)

// TestReplaceServer: the new server is dialled, the old host name still
// verifies the certificate, the CA and token stay.
func TestReplaceServer(t *testing.T) {
	kc, err := remotesecret.Kubeconfig("c2", "https://127.0.0.1:6443", []byte("ca"), "tok")
	require.NoError(t, err)
	out, err := remotesecret.ReplaceServer(kc, "https://10.2.0.1:6443")
	require.NoError(t, err)
	cfg, err := clientcmd.Load(out)
	require.NoError(t, err)
	c := cfg.Clusters["c2"]
	require.Equal(t, "https://10.2.0.1:6443", c.Server)
	require.Equal(t, "127.0.0.1", c.TLSServerName)
	require.Equal(t, []byte("ca"), c.CertificateAuthorityData)
	require.Equal(t, "tok", cfg.AuthInfos["c2"].Token)

	_, err = remotesecret.ReplaceServer([]byte("{not yaml"), "https://x")
	require.Error(t, err)
}
