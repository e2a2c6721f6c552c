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
// local filesystem of pilot.
const (
	AllowExec                 = "exec"
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
)

// SanitizeKubeconfig parses a remote kubeconfig and rebuilds, field by
// field, a config holding only its current context, that context's cluster
// and user. Options that run programs or read files are refused unless
// allowed by name; unknown fields never pass.
func SanitizeKubeconfig(raw []byte, allowed []string) (*clientcmdapi.Config, error) {
	if len(raw) == 0 {
		return nil, &KubeconfigError{ReasonInvalidKubeconfig, "empty kubeconfig"}
	}
	in, err := clientcmd.Load(raw)
	if err != nil {
		// The parser's message can quote input; keep only its kind.
		return nil, &KubeconfigError{ReasonInvalidKubeconfig, "cannot parse kubeconfig: " + firstLine(err.Error(), 80)}
	}
	name := in.CurrentContext
	if name == "" {
		return nil, &KubeconfigError{ReasonNoCurrentContext, "kubeconfig has no current-context"}
	}
	kctx, ok := in.Contexts[name]
	if !ok {
		return nil, &KubeconfigError{ReasonNoCurrentContext, fmt.Sprintf("current-context %q is not defined", name)}
	}
	cl, ok := in.Clusters[kctx.Cluster]
	if !ok || cl.Server == "" {
		return nil, &KubeconfigError{ReasonInvalidKubeconfig, fmt.Sprintf("context %q names no cluster with a server", name)}
	}
	user, ok := in.AuthInfos[kctx.AuthInfo]
	if !ok {
		return nil, &KubeconfigError{ReasonInvalidKubeconfig, fmt.Sprintf("context %q names no user", name)}
	}
	allow := func(opt string) bool { return slices.Contains(allowed, opt) }
	forbidden := func(field string) error {
		return &KubeconfigError{ReasonForbiddenOption, fmt.Sprintf("%s is not allowed in remote kubeconfigs (operator option %q)", field, field)}
	}

	outCluster := &clientcmdapi.Cluster{
		Server:                   cl.Server,
		TLSServerName:            cl.TLSServerName,
		InsecureSkipTLSVerify:    cl.InsecureSkipTLSVerify,
		CertificateAuthorityData: cl.CertificateAuthorityData,
		ProxyURL:                 cl.ProxyURL,
		DisableCompression:       cl.DisableCompression,
	}
	if cl.CertificateAuthority != "" {
		if !allow(AllowCertificateAuthority) {
			return nil, forbidden(AllowCertificateAuthority)
		}
		outCluster.CertificateAuthority = cl.CertificateAuthority
	}

	outUser := &clientcmdapi.AuthInfo{
		ClientCertificateData: user.ClientCertificateData,
		ClientKeyData:         user.ClientKeyData,
		Token:                 user.Token,
		Impersonate:           user.Impersonate,
		ImpersonateUID:        user.ImpersonateUID,
		ImpersonateGroups:     slices.Clone(user.ImpersonateGroups),
		Username:              user.Username,
		Password:              user.Password,
	}
	if user.TokenFile != "" {
		if !allow(AllowTokenFile) {
			return nil, forbidden(AllowTokenFile)
		}
		outUser.TokenFile = user.TokenFile
	}
	if user.ClientCertificate != "" {
		if !allow(AllowClientCertificate) {
			return nil, forbidden(AllowClientCertificate)
		}
		outUser.ClientCertificate = user.ClientCertificate
	}
	if user.ClientKey != "" {
		if !allow(AllowClientKey) {
			return nil, forbidden(AllowClientKey)
		}
		outUser.ClientKey = user.ClientKey
	}
	if user.Exec != nil {
		if !allow(AllowExec) {
			return nil, forbidden(AllowExec)
		}
		outUser.Exec = user.Exec.DeepCopy()
	}
	if p := user.AuthProvider; p != nil {
		if p.Name != "oidc" && !allow(AllowAuthProvider) && !allow(AllowAuthProvider+":"+p.Name) {
			return nil, &KubeconfigError{ReasonForbiddenOption, fmt.Sprintf("auth-provider %q is not allowed in remote kubeconfigs (only oidc, unless the operator allows %q)", p.Name, AllowAuthProvider+":"+p.Name)}
		}
		outUser.AuthProvider = p.DeepCopy()
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
