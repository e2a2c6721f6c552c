package multicluster_test

import (
	"context"
	"net/netip"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/isthmus-mesh/isthmus/test/framework"
)

type (
	clientcmdapiConfig = clientcmdapi.Config
	clientcmdapiExec   = clientcmdapi.ExecConfig
)

var osStat = os.Stat

func rewrite(t testing.TB, kc []byte, fn func(*clientcmdapi.Config)) []byte {
	t.Helper()
	cfg, err := clientcmd.Load(kc)
	require.NoError(t, err)
	fn(cfg)
	out, err := clientcmd.Write(*cfg)
	require.NoError(t, err)
	return out
}

func tokenOf(t testing.TB, kc []byte) string {
	t.Helper()
	cfg, err := clientcmd.Load(kc)
	require.NoError(t, err)
	tok := cfg.AuthInfos[cfg.CurrentContext].Token
	require.NotEmpty(t, tok)
	return tok
}

func mustGet(t testing.TB, e *env, secret, key string) []byte {
	t.Helper()
	s, err := clusters.Cluster("config").Client.CoreV1().Secrets(e.ns).Get(context.Background(), secret, metav1.GetOptions{})
	require.NoError(t, err)
	return s.Data[key]
}

func podOpts(ns, name string) framework.PodOptions {
	return framework.PodOptions{Namespace: ns, Name: name, Ready: true}
}

func listLimit(n int64) metav1.ListOptions { return metav1.ListOptions{Limit: n} }

// addrFor returns a distinct loopback address for pod i (used as data only).
func addrFor(i int) netip.Addr {
	return netip.AddrFrom4([4]byte{127, 20, byte(i >> 8), byte(i)})
}
