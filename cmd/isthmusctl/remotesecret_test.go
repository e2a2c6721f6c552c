package main

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/yaml"

	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// checkRemoteKubeconfig proves that the kubeconfig of a remote Secret
// passes pilot's sanitizer, points at remote with its CA inline, and that
// its token can list pods there. It returns the token.
func checkRemoteKubeconfig(t *testing.T, ctx context.Context, raw []byte, id string, remote *framework.Cluster) string {
	t.Helper()
	cfg, err := multicluster.SanitizeKubeconfig(raw, nil)
	require.NoError(t, err, "pilot accepts the kubeconfig")
	require.Equal(t, id, cfg.CurrentContext)
	require.Len(t, cfg.Clusters, 1)
	require.Equal(t, remote.Host(), cfg.Clusters[id].Server)
	require.Equal(t, remote.CAData(), cfg.Clusters[id].CertificateAuthorityData)
	token := cfg.AuthInfos[id].Token
	require.NotEmpty(t, token)

	rc, err := clientcmd.NewDefaultClientConfig(*cfg, nil).ClientConfig()
	require.NoError(t, err)
	client, err := kubernetes.NewForConfig(rc)
	require.NoError(t, err)
	_, err = client.CoreV1().Pods("").List(ctx, metav1.ListOptions{Limit: 1})
	require.NoError(t, err, "the remote Secret's token lists pods in the remote")
	return token
}

// TestCreateRemoteSecretPrintsSecret runs create-remote-secret against a
// real remote API server (no token controller: the TokenRequest fallback
// issues the token), applies the printed YAML to a real primary, and checks
// that it is a remote Secret pilot accepts and that its token works. The
// token appears nowhere but in the Secret on stdout.
func TestCreateRemoteSecretPrintsSecret(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	primary, remote := clusters.Cluster("primary"), clusters.Cluster("remote")
	require.NoError(t, primary.EnsureNamespace(ctx, "isthmus-system", nil))
	kc := writeKubeconfig(t, "remote-admin", remote.Config)

	stdout, stderr, err := runCtl(t, "create-remote-secret", "-v", "--kubeconfig", kc, "--name", "remote-1",
		"--network", "net-2", "--trust-domain", "network-2.example", "--token-wait", "300ms")
	require.NoError(t, err, stderr)

	var secret corev1.Secret
	require.NoError(t, yaml.UnmarshalStrict([]byte(stdout), &secret), stdout)
	require.Equal(t, "Secret", secret.Kind)
	require.Equal(t, "istio-remote-secret-remote-1", secret.Name)
	require.Equal(t, "isthmus-system", secret.Namespace)
	require.Equal(t, map[string]string{remotesecret.IstioLabel: "true"}, secret.Labels)
	require.Equal(t, "remote-1", secret.Annotations[remotesecret.ClusterAnnotation])
	require.Equal(t, "net-2", secret.Annotations[remotesecret.NetworkAnnotation])
	require.Equal(t, "network-2.example", secret.Annotations[remotesecret.TrustDomainAnnotation])
	require.Len(t, secret.Data, 1)
	raw, ok := secret.Data["remote-1"]
	require.True(t, ok, "the data key is the cluster ID")
	token := checkRemoteKubeconfig(t, ctx, raw, "remote-1", remote)
	require.NotContains(t, stderr, token, "the token is never logged")
	require.NotContains(t, stdout, token, "the token is only inside the base64 kubeconfig")

	// The printed YAML is a valid object for the primary's API server.
	created, err := primary.Client.CoreV1().Secrets("isthmus-system").Create(ctx, &secret, metav1.CreateOptions{})
	require.NoError(t, err)
	require.Equal(t, raw, created.Data["remote-1"])

	// The reader identity exists in the remote, with ReaderRules.
	role, err := remote.Client.RbacV1().ClusterRoles().Get(ctx, "isthmus-reader-isthmus-system", metav1.GetOptions{})
	require.NoError(t, err)
	require.Equal(t, remotesecret.ReaderRules(), role.Rules)
	// And, in the gateway namespace (by default the control-plane one),
	// GatewayRules.
	gw, err := remote.Client.RbacV1().Roles("isthmus-system").Get(ctx, remotesecret.GatewayRoleName("isthmus-system"), metav1.GetOptions{})
	require.NoError(t, err)
	require.Equal(t, remotesecret.GatewayRules(), gw.Rules)
}

// TestCreateRemoteSecretApply checks --apply: the first run creates the
// Secret in the primary, a second run (new network, new token) updates it,
// and stdout only reports what happened.
func TestCreateRemoteSecretApply(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	primary, remote := clusters.Cluster("primary"), clusters.Cluster("remote")
	require.NoError(t, primary.EnsureNamespace(ctx, "isthmus-system", nil))
	remoteKC := writeKubeconfig(t, "remote-admin", remote.Config)
	primaryKC := writeKubeconfig(t, "primary-admin", primary.Config)
	get := func() *corev1.Secret {
		s, err := primary.Client.CoreV1().Secrets("isthmus-system").Get(ctx, "istio-remote-secret-remote-apply", metav1.GetOptions{})
		require.NoError(t, err)
		return s
	}

	stdout, stderr, err := runCtl(t, "create-remote-secret", "--kubeconfig", remoteKC, "--name", "remote-apply",
		"--network", "net-a", "--token-wait", "100ms", "--apply", "--primary-kubeconfig", primaryKC)
	require.NoError(t, err, stderr)
	require.Equal(t, "secret/istio-remote-secret-remote-apply created in namespace isthmus-system of the primary cluster ("+primary.Host()+")\n", stdout)
	first := get()
	require.Equal(t, "true", first.Labels[remotesecret.IstioLabel])
	require.Equal(t, "net-a", first.Annotations[remotesecret.NetworkAnnotation])
	token1 := checkRemoteKubeconfig(t, ctx, first.Data["remote-apply"], "remote-apply", remote)
	require.NotContains(t, stdout+stderr, token1)

	stdout, stderr, err = runCtl(t, "create-remote-secret", "--kubeconfig", remoteKC, "--name", "remote-apply",
		"--network", "net-b", "--token-wait", "100ms", "--apply", "--primary-kubeconfig", primaryKC)
	require.NoError(t, err, stderr)
	require.Contains(t, stdout, "secret/istio-remote-secret-remote-apply updated")
	second := get()
	require.Equal(t, "net-b", second.Annotations[remotesecret.NetworkAnnotation])
	token2 := checkRemoteKubeconfig(t, ctx, second.Data["remote-apply"], "remote-apply", remote)
	require.NotEqual(t, token1, token2, "a second run issues a fresh token")
	require.Len(t, second.Data, 1)
}

// TestCreateRemoteSecretRefuses checks the command's refusals and that each
// error says what is wrong.
func TestCreateRemoteSecretRefuses(t *testing.T) {
	primary, remote := clusters.Cluster("primary"), clusters.Cluster("remote")
	remoteKC := writeKubeconfig(t, "remote-admin", remote.Config)
	primaryKC := writeKubeconfig(t, "primary-admin", primary.Config)
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"no name", []string{"--kubeconfig", remoteKC}, `required flag(s) "name" not set`},
		{"bad cluster ID", []string{"--kubeconfig", remoteKC, "--name", "Bad_ID"}, `--name "Bad_ID" is not a valid cluster ID`},
		{"bad trust domain", []string{"--kubeconfig", remoteKC, "--name", "c", "--trust-domain", "Not/A.Domain"}, `--trust-domain:`},
		{"primary without apply", []string{"--kubeconfig", remoteKC, "--name", "c", "--primary-kubeconfig", primaryKC}, "need --apply"},
		{"apply without primary", []string{"--kubeconfig", remoteKC, "--name", "c", "--apply"}, "--apply needs --primary-kubeconfig"},
		{"rotate without apply", []string{"--kubeconfig", remoteKC, "--name", "c", "--rotate"}, "--rotate needs --apply"},
		{"missing kubeconfig", []string{"--kubeconfig", "/nonexistent/kubeconfig", "--name", "c"}, "remote cluster: kubeconfig /nonexistent/kubeconfig"},
		{"unknown context", []string{"--kubeconfig", remoteKC, "--context", "nope", "--name", "c"}, `context "nope"`},
		{"primary is the remote", []string{"--kubeconfig", remoteKC, "--name", "c", "--token-wait", "1ms", "--apply", "--primary-kubeconfig", remoteKC},
			"a cluster is not its own remote"},
		{"namespace missing in the primary", []string{"--kubeconfig", remoteKC, "--name", "c", "--namespace", "only-in-remote",
			"--token-wait", "1ms", "--apply", "--primary-kubeconfig", primaryKC}, "namespace only-in-remote does not exist in the primary"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			stdout, _, err := runCtl(t, append([]string{"create-remote-secret"}, tc.args...)...)
			require.ErrorContains(t, err, tc.want)
			require.Empty(t, stdout)
		})
	}
}
