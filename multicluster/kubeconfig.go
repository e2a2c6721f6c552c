package multicluster

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// Options a remote kubeconfig may use only when the operator allows them by
// name (Config.AllowedKubeconfigOptions): each runs a program or reads the
// local filesystem of pilot. Exec plugins are not among them: they are
// allowed command by command (Config.Exec.Allowlist).
const (
	AllowAuthProvider         = "auth-provider" // every provider; "auth-provider:<name>" allows one
	AllowTokenFile            = "tokenFile"
	AllowClientCertificate    = "clientCertificate"
	AllowClientKey            = "clientKey"
	AllowCertificateAuthority = "certificateAuthority"
)

// KubeconfigError says why a remote kubeconfig was refused. It never holds
// credentials.
type KubeconfigError struct {
	// Reason is a stable, machine-readable reason (a Status reason).
	Reason string
	// Detail explains it for people.
	Detail string
}

func (e *KubeconfigError) Error() string { return e.Reason + ": " + e.Detail }

// Reasons of KubeconfigError.
const (
	ReasonInvalidKubeconfig = "InvalidKubeconfig"
	ReasonNoCurrentContext  = "NoCurrentContext"
	ReasonForbiddenOption   = "ForbiddenKubeconfigOption"
	// ReasonExecNotAllowed: the kubeconfig's exec command, an argument or
	// an environment variable is not on the operator's exec allowlist.
	ReasonExecNotAllowed = "ExecNotAllowed"
)

// KubeconfigPolicy says what a remote kubeconfig may use besides inline
// credentials. The zero value allows only inline credentials (and oidc).
type KubeconfigPolicy struct {
	// AllowedOptions names options that read files or run auth providers
	// (the Allow* constants).
	AllowedOptions []string
	// Exec lists the exec credential plugins remote kubeconfigs may run;
	// none when empty.
	Exec []ExecRule
}

// validateKubeconfigOptions checks operator-given option names. "exec" is
// refused with a pointer to the allowlist: it used to allow every command.
func validateKubeconfigOptions(opts []string) error {
	for _, o := range opts {
		switch {
		case o == "exec":
			return errors.New(`kubeconfig option "exec" no longer allows every command: list the allowed exec plugins instead (Config.Exec.Allowlist; pilot --exec-allowlist or --exec-allow)`)
		case o == AllowAuthProvider, o == AllowTokenFile, o == AllowClientCertificate, o == AllowClientKey, o == AllowCertificateAuthority:
		case strings.HasPrefix(o, AllowAuthProvider+":") && len(o) > len(AllowAuthProvider)+1:
		default:
			return fmt.Errorf("unknown kubeconfig option %q (known: %s, %s[:name], %s, %s, %s)", o,
				AllowCertificateAuthority, AllowAuthProvider, AllowTokenFile, AllowClientCertificate, AllowClientKey)
		}
	}
	return nil
}

// SanitizeKubeconfig sanitizes raw under a policy that allows the named
// options and no exec plugin (see KubeconfigPolicy.Sanitize).
func SanitizeKubeconfig(raw []byte, allowed []string) (*clientcmdapi.Config, error) {
	return KubeconfigPolicy{AllowedOptions: allowed}.Sanitize(raw)
}

// Sanitize parses a remote kubeconfig and rebuilds, field by field, a
// config holding only its current context, that context's cluster and
// user. Options that read files or run auth providers are refused unless
// allowed by name, an exec plugin unless an allowlist rule allows its
// command, arguments and environment; unknown fields never pass.
func (p KubeconfigPolicy) Sanitize(raw []byte) (*clientcmdapi.Config, error) {
	name, kctx, cl, user, err := currentContext(raw)
	if err != nil {
		return nil, err
	}
	outCluster, err := p.cluster(cl)
	if err != nil {
		return nil, err
	}
	outUser, err := p.user(user)
	if err != nil {
		return nil, err
	}
	out := clientcmdapi.NewConfig()
	out.Clusters[kctx.Cluster] = outCluster
	out.AuthInfos[kctx.AuthInfo] = outUser
	out.Contexts[name] = &clientcmdapi.Context{Cluster: kctx.Cluster, AuthInfo: kctx.AuthInfo, Namespace: kctx.Namespace}
	out.CurrentContext = name
	if err := clientcmd.Validate(*out); err != nil {
		return nil, &KubeconfigError{ReasonInvalidKubeconfig, redactValidation(err)}
	}
	return out, nil
}

// currentContext parses raw and returns its current context with the
// cluster and user it names.
func currentContext(raw []byte) (string, *clientcmdapi.Context, *clientcmdapi.Cluster, *clientcmdapi.AuthInfo, error) {
	if len(raw) == 0 {
		return "", nil, nil, nil, &KubeconfigError{ReasonInvalidKubeconfig, "empty kubeconfig"}
	}
	in, err := clientcmd.Load(raw)
	if err != nil {
		// The parser's message can quote input; keep only its kind.
		return "", nil, nil, nil, &KubeconfigError{ReasonInvalidKubeconfig, "cannot parse kubeconfig: " + firstLine(err.Error(), 80)}
	}
	name := in.CurrentContext
	if name == "" {
		return "", nil, nil, nil, &KubeconfigError{ReasonNoCurrentContext, "kubeconfig has no current-context"}
	}
	kctx, ok := in.Contexts[name]
	if !ok {
		return "", nil, nil, nil, &KubeconfigError{ReasonNoCurrentContext, fmt.Sprintf("current-context %q is not defined", name)}
	}
	cl, ok := in.Clusters[kctx.Cluster]
	if !ok || cl.Server == "" {
		return "", nil, nil, nil, &KubeconfigError{ReasonInvalidKubeconfig, fmt.Sprintf("context %q names no cluster with a server", name)}
	}
	user, ok := in.AuthInfos[kctx.AuthInfo]
	if !ok {
		return "", nil, nil, nil, &KubeconfigError{ReasonInvalidKubeconfig, fmt.Sprintf("context %q names no user", name)}
	}
	return name, kctx, cl, user, nil
}

func (p KubeconfigPolicy) allow(opt string) bool { return slices.Contains(p.AllowedOptions, opt) }

func forbidden(field string) error {
	return &KubeconfigError{ReasonForbiddenOption, fmt.Sprintf("%s is not allowed in remote kubeconfigs (operator option %q)", field, field)}
}

// cluster copies the fields of cl that may pass.
func (p KubeconfigPolicy) cluster(cl *clientcmdapi.Cluster) (*clientcmdapi.Cluster, error) {
	out := &clientcmdapi.Cluster{
		Server:                   cl.Server,
		TLSServerName:            cl.TLSServerName,
		InsecureSkipTLSVerify:    cl.InsecureSkipTLSVerify,
		CertificateAuthorityData: cl.CertificateAuthorityData,
		ProxyURL:                 cl.ProxyURL,
		DisableCompression:       cl.DisableCompression,
	}
	if cl.CertificateAuthority != "" {
		if !p.allow(AllowCertificateAuthority) {
			return nil, forbidden(AllowCertificateAuthority)
		}
		out.CertificateAuthority = cl.CertificateAuthority
	}
	return out, nil
}

// user copies the fields of user that may pass: files only when allowed by
// name, an exec plugin only when the allowlist allows it, an auth provider
// only oidc unless allowed.
func (p KubeconfigPolicy) user(user *clientcmdapi.AuthInfo) (*clientcmdapi.AuthInfo, error) {
	out := &clientcmdapi.AuthInfo{
		ClientCertificateData: user.ClientCertificateData,
		ClientKeyData:         user.ClientKeyData,
		Token:                 user.Token,
		Impersonate:           user.Impersonate,
		ImpersonateUID:        user.ImpersonateUID,
		ImpersonateGroups:     slices.Clone(user.ImpersonateGroups),
		Username:              user.Username,
		Password:              user.Password,
	}
	for _, f := range []struct {
		value, option string
		into          *string
	}{{user.TokenFile, AllowTokenFile, &out.TokenFile}, {user.ClientCertificate, AllowClientCertificate, &out.ClientCertificate},
		{user.ClientKey, AllowClientKey, &out.ClientKey}} {
		if f.value == "" {
			continue
		}
		if !p.allow(f.option) {
			return nil, forbidden(f.option)
		}
		*f.into = f.value
	}
	if user.Exec != nil {
		if err := checkExecUser(p.Exec, user); err != nil {
			return nil, err
		}
		out.Exec = &clientcmdapi.ExecConfig{
			Command: user.Exec.Command, Args: slices.Clone(user.Exec.Args), Env: slices.Clone(user.Exec.Env),
			APIVersion: user.Exec.APIVersion, ProvideClusterInfo: user.Exec.ProvideClusterInfo,
			InteractiveMode: user.Exec.InteractiveMode,
		}
	}
	if ap := user.AuthProvider; ap != nil {
		if ap.Name != "oidc" && !p.allow(AllowAuthProvider) && !p.allow(AllowAuthProvider+":"+ap.Name) {
			return nil, &KubeconfigError{ReasonForbiddenOption, fmt.Sprintf("auth-provider %q is not allowed in remote kubeconfigs (only oidc, unless the operator allows %q)", ap.Name, AllowAuthProvider+":"+ap.Name)}
		}
		out.AuthProvider = ap.DeepCopy()
	}
	return out, nil
}

// Exec credential API versions pilot speaks.
const (
	execAPIv1      = "client.authentication.k8s.io/v1"
	execAPIv1beta1 = "client.authentication.k8s.io/v1beta1"
)

// checkExecUser refuses an exec user pilot cannot run safely: one that
// mixes exec with other credentials, needs a terminal, speaks an unknown
// API version, or is not allowlisted.
func checkExecUser(rules []ExecRule, user *clientcmdapi.AuthInfo) error {
	ex := user.Exec
	invalid := func(msg string) error { return &KubeconfigError{ReasonInvalidKubeconfig, msg} }
	switch {
	case user.Token != "" || user.TokenFile != "" || user.Username != "" || user.Password != "" ||
		len(user.ClientCertificateData) > 0 || user.ClientCertificate != "" || len(user.ClientKeyData) > 0 || user.ClientKey != "" ||
		user.AuthProvider != nil:
		return invalid("exec cannot be combined with other credentials (token, basic auth, client certificate, auth-provider)")
	case ex.APIVersion != execAPIv1 && ex.APIVersion != execAPIv1beta1:
		return invalid(fmt.Sprintf("exec apiVersion %q is not supported (%s or %s)", firstLine(ex.APIVersion, 80), execAPIv1, execAPIv1beta1))
	case ex.InteractiveMode == clientcmdapi.AlwaysExecInteractiveMode:
		return invalid("exec interactiveMode Always needs a terminal; pilot runs plugins without one")
	}
	return checkExec(rules, ex)
}

// redactValidation keeps validation messages but never values of fields.
func redactValidation(err error) string {
	var agg interface{ Errors() []error }
	if errors.As(err, &agg) && len(agg.Errors()) > 0 {
		msgs := make([]string, 0, len(agg.Errors()))
		for _, e := range agg.Errors() {
			msgs = append(msgs, firstLine(e.Error(), 120))
		}
		return strings.Join(msgs, "; ")
	}
	return firstLine(err.Error(), 120)
}

func firstLine(s string, max int) string {
	s, _, _ = strings.Cut(s, "\n")
	if len(s) > max {
		s = s[:max] + "…"
	}
	return s
}
