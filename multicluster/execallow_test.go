package multicluster_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/isthmus-mesh/isthmus/multicluster"
)

// execKubeconfig is a remote kubeconfig whose user runs ex.
func execKubeconfig(t testing.TB, server string, ca []byte, ex *clientcmdapi.ExecConfig) []byte {
	t.Helper()
	if ex.APIVersion == "" {
		ex.APIVersion = "client.authentication.k8s.io/v1"
	}
	if ex.InteractiveMode == "" {
		ex.InteractiveMode = clientcmdapi.NeverExecInteractiveMode
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["c"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: ca}
	cfg.AuthInfos["u"] = &clientcmdapi.AuthInfo{Exec: ex}
	cfg.Contexts["ctx"] = &clientcmdapi.Context{Cluster: "c", AuthInfo: "u"}
	cfg.CurrentContext = "ctx"
	out, err := clientcmd.Write(*cfg)
	require.NoError(t, err)
	return out
}

func execEnv(kv ...string) []clientcmdapi.ExecEnvVar {
	var out []clientcmdapi.ExecEnvVar
	for i := 0; i+1 < len(kv); i += 2 {
		out = append(out, clientcmdapi.ExecEnvVar{Name: kv[i], Value: kv[i+1]})
	}
	return out
}

// TestExecAllowlistDecisions: which exec users the sanitizer lets through
// under an allowlist, and the specific reason of each refusal, which never
// quotes an argument's or a variable's value.
func TestExecAllowlistDecisions(t *testing.T) {
	policy := multicluster.KubeconfigPolicy{Exec: []multicluster.ExecRule{
		{Command: "/opt/plugins/token", Args: []string{"get-token", "--cluster", "prod-*"}, Env: []string{"PROFILE", "REGION"}},
		{Command: "/opt/plugins/token", Args: []string{"version"}},
		{Command: "/opt/plugins/token", Args: []string{"describe", "*"}},
		{Command: "/opt/plugins/files", Args: []string{"--token-file", "/var/run/tokens/*.jwt"}},
		{Command: "/opt/plugins/bare"},
	}}
	const secretValue = "s3cr3t-v4lue"
	tok := func(args ...string) *clientcmdapi.ExecConfig {
		return &clientcmdapi.ExecConfig{Command: "/opt/plugins/token", Args: args}
	}
	cases := []struct {
		name   string
		exec   *clientcmdapi.ExecConfig
		user   func(*clientcmdapi.AuthInfo)
		reason string // "" allowed
		msg    string
	}{
		{name: "exact arguments and allowed env", exec: &clientcmdapi.ExecConfig{Command: "/opt/plugins/token",
			Args: []string{"get-token", "--cluster", "prod-eu"}, Env: execEnv("PROFILE", secretValue, "REGION", "eu")}},
		{name: "a subset of the allowed env", exec: &clientcmdapi.ExecConfig{Command: "/opt/plugins/token",
			Args: []string{"get-token", "--cluster", "prod-us"}, Env: execEnv("REGION", "us")}},
		{name: "second rule of the same command", exec: tok("version")},
		{name: "no arguments", exec: &clientcmdapi.ExecConfig{Command: "/opt/plugins/bare"}},
		{name: "file glob", exec: &clientcmdapi.ExecConfig{Command: "/opt/plugins/files", Args: []string{"--token-file", "/var/run/tokens/remote-1.jwt"}}},
		{name: "wildcard takes a plain word", exec: tok("describe", "cluster-1")},
		{name: "v1beta1", exec: &clientcmdapi.ExecConfig{Command: "/opt/plugins/bare", APIVersion: "client.authentication.k8s.io/v1beta1"}},

		{name: "command not listed", exec: &clientcmdapi.ExecConfig{Command: "/bin/sh", Args: []string{"-c", "touch /tmp/pwned"}},
			reason: multicluster.ReasonExecNotAllowed, msg: "exec command /bin/sh is not on the allowlist"},
		{name: "relative command", exec: &clientcmdapi.ExecConfig{Command: "token"},
			reason: multicluster.ReasonExecNotAllowed, msg: `exec command "token" is not an absolute path`},
		{name: "same file by another spelling", exec: &clientcmdapi.ExecConfig{Command: "/opt/plugins/../plugins/bare"},
			reason: multicluster.ReasonExecNotAllowed, msg: "is not on the allowlist"},
		{name: "too many arguments", exec: tok("get-token", "--cluster", "prod-eu", secretValue),
			reason: multicluster.ReasonExecNotAllowed, msg: "4 arguments given, the allowlist entry takes 3"},
		{name: "too few arguments", exec: &clientcmdapi.ExecConfig{Command: "/opt/plugins/files", Args: []string{"--token-file"}},
			reason: multicluster.ReasonExecNotAllowed, msg: "1 arguments given, the allowlist entry takes 2"},
		{name: "the closest rule explains", exec: tok("get-token"),
			reason: multicluster.ReasonExecNotAllowed, msg: `argument 0 does not match the allowed pattern "version"`},
		{name: "argument outside its pattern", exec: tok("get-token", "--cluster", "staging-"+secretValue),
			reason: multicluster.ReasonExecNotAllowed, msg: `argument 2 does not match the allowed pattern "prod-*"`},
		{name: "wildcard does not cross a slash", exec: tok("get-token", "--cluster", "prod-a/../../b"),
			reason: multicluster.ReasonExecNotAllowed, msg: "argument 2 does not match"},
		{name: "wildcard does not inject a flag", exec: tok("describe", "--exec-command=/bin/sh"),
			reason: multicluster.ReasonExecNotAllowed, msg: `argument 1 does not match the allowed pattern "*"`},
		{name: "file glob does not leave its folder", exec: &clientcmdapi.ExecConfig{Command: "/opt/plugins/files", Args: []string{"--token-file", "/var/run/tokens/../../../etc/shadow.jwt"}},
			reason: multicluster.ReasonExecNotAllowed, msg: "argument 1 does not match"},
		{name: "env not allowed", exec: &clientcmdapi.ExecConfig{Command: "/opt/plugins/token",
			Args: []string{"get-token", "--cluster", "prod-eu"}, Env: execEnv("LD_PRELOAD", "/tmp/"+secretValue+".so")},
			reason: multicluster.ReasonExecNotAllowed, msg: "environment variable LD_PRELOAD is not allowed"},
		{name: "env on a rule without env", exec: &clientcmdapi.ExecConfig{Command: "/opt/plugins/bare", Env: execEnv("PROFILE", secretValue)},
			reason: multicluster.ReasonExecNotAllowed, msg: "environment variable PROFILE is not allowed"},
		{name: "env set twice", exec: &clientcmdapi.ExecConfig{Command: "/opt/plugins/token",
			Args: []string{"get-token", "--cluster", "prod-eu"}, Env: execEnv("PROFILE", "a", "PROFILE", secretValue)},
			reason: multicluster.ReasonExecNotAllowed, msg: "environment variable PROFILE is set twice"},
		{name: "exec with a token too", exec: tok("version"), user: func(u *clientcmdapi.AuthInfo) { u.Token = secretValue },
			reason: multicluster.ReasonInvalidKubeconfig, msg: "exec cannot be combined with other credentials"},
		{name: "interactive only", exec: &clientcmdapi.ExecConfig{Command: "/opt/plugins/bare", InteractiveMode: clientcmdapi.AlwaysExecInteractiveMode},
			reason: multicluster.ReasonInvalidKubeconfig, msg: "needs a terminal"},
		{name: "unknown API version", exec: &clientcmdapi.ExecConfig{Command: "/opt/plugins/bare", APIVersion: "client.authentication.k8s.io/v1alpha1"},
			reason: multicluster.ReasonInvalidKubeconfig, msg: `exec apiVersion "client.authentication.k8s.io/v1alpha1" is not supported`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			raw := execKubeconfig(t, "https://remote.example:6443", nil, tc.exec)
			if tc.user != nil {
				raw = rewrite(t, raw, func(cfg *clientcmdapiConfig) { tc.user(cfg.AuthInfos["u"]) })
			}
			out, err := policy.Sanitize(raw)
			if tc.reason == "" {
				require.NoError(t, err)
				got := out.AuthInfos["u"].Exec
				require.Equal(t, tc.exec.Command, got.Command)
				require.Equal(t, tc.exec.Args, got.Args)
				require.Equal(t, tc.exec.Env, got.Env)
				return
			}
			kerr, ok := errors.AsType[*multicluster.KubeconfigError](err)
			require.True(t, ok, "a KubeconfigError: %v", err)
			require.Equal(t, tc.reason, kerr.Reason, kerr.Detail)
			require.Contains(t, kerr.Detail, tc.msg)
			require.NotContains(t, kerr.Error(), secretValue, "values are never quoted")
		})
	}

	t.Run("no allowlist refuses every exec", func(t *testing.T) {
		_, err := multicluster.SanitizeKubeconfig(execKubeconfig(t, "https://remote.example:6443", nil, tok("version")), nil)
		kerr, ok := errors.AsType[*multicluster.KubeconfigError](err)
		require.True(t, ok, "a KubeconfigError: %v", err)
		require.Equal(t, multicluster.ReasonExecNotAllowed, kerr.Reason)
		require.Contains(t, kerr.Detail, "no exec plugin is allowed")
	})
}

// TestExecAllowlistConfig: the allowlist's file and flag formats, and the
// operator mistakes they refuse.
func TestExecAllowlistConfig(t *testing.T) {
	rules, err := multicluster.ParseExecAllowlist([]byte(`
commands:
- command: /usr/local/bin/token-plugin
  args: [get-token, --cluster, "prod-*"]
  env: [PLUGIN_PROFILE]
- command: /usr/local/bin/other
`))
	require.NoError(t, err)
	require.Equal(t, []multicluster.ExecRule{
		{Command: "/usr/local/bin/token-plugin", Args: []string{"get-token", "--cluster", "prod-*"}, Env: []string{"PLUGIN_PROFILE"}},
		{Command: "/usr/local/bin/other"},
	}, rules)
	rule, err := multicluster.ParseExecRule(`{command: /usr/local/bin/token-plugin, args: [get-token, "*"], env: [A, B]}`)
	require.NoError(t, err)
	require.Equal(t, multicluster.ExecRule{Command: "/usr/local/bin/token-plugin", Args: []string{"get-token", "*"}, Env: []string{"A", "B"}}, rule)
	rule, err = multicluster.ParseExecRule(`{"command": "/bin/plugin"}`)
	require.NoError(t, err, "JSON is YAML")
	require.Equal(t, "/bin/plugin", rule.Command)

	bad := []struct{ name, spec, msg string }{
		{"relative command", `{command: plugin}`, "must be an absolute, clean path"},
		{"unclean command", `{command: /usr/bin/../bin/plugin}`, "must be an absolute, clean path"},
		{"bad pattern", `{command: /bin/p, args: ["[a-"]}`, "syntax error in pattern"},
		{"loader variable", `{command: /bin/p, env: [LD_PRELOAD]}`, "LD_PRELOAD may not be allowed"},
		{"protocol variable", `{command: /bin/p, env: [KUBERNETES_EXEC_INFO]}`, "KUBERNETES_EXEC_INFO may not be allowed"},
		{"not a name", `{command: /bin/p, env: ["A=B"]}`, "is not an environment variable name"},
		{"misspelt field", `{command: /bin/p, arg: [x]}`, `unknown field "arg"`},
	}
	for _, tc := range bad {
		t.Run(tc.name, func(t *testing.T) {
			_, err := multicluster.ParseExecRule(tc.spec)
			require.ErrorContains(t, err, tc.msg)
		})
	}
	_, err = multicluster.ParseExecAllowlist([]byte("commands:\n- command: /ok\n- command: relative\n"))
	require.ErrorContains(t, err, "rule 1")
	_, err = multicluster.ParseExecAllowlist([]byte("command: /bin/p\n"))
	require.ErrorContains(t, err, `unknown field "command"`)

	// The controller refuses the old all-or-nothing option, pointing to the allowlist.
	local, err := multicluster.NewClient(clusters.Cluster("config").Config)
	require.NoError(t, err)
	_, err = multicluster.New(multicluster.Config{AllowedKubeconfigOptions: []string{"exec"}}, local, nil)
	require.ErrorContains(t, err, "--exec-allowlist")
	_, err = multicluster.New(multicluster.Config{AllowedKubeconfigOptions: []string{"tokenfile"}}, local, nil)
	require.ErrorContains(t, err, `unknown kubeconfig option "tokenfile"`)
	_, err = multicluster.New(multicluster.Config{Exec: multicluster.ExecConfig{Allowlist: []multicluster.ExecRule{{Command: "plugin"}}}}, local, nil)
	require.ErrorContains(t, err, "must be an absolute, clean path")
	_, err = multicluster.New(multicluster.Config{AllowedKubeconfigOptions: []string{"auth-provider:gcp", "tokenFile"}}, local, nil)
	require.NoError(t, err)
}
