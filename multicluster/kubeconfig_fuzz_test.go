package multicluster_test

import (
	"bytes"
	"errors"
	"slices"
	"strings"
	"testing"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/isthmus-mesh/isthmus/multicluster"
)

// fuzzAllowable are the operator options a fuzz input may turn on, one bit
// each.
var fuzzAllowable = []string{
	multicluster.AllowAuthProvider, multicluster.AllowTokenFile, multicluster.AllowClientCertificate,
	multicluster.AllowClientKey, multicluster.AllowCertificateAuthority, multicluster.AllowAuthProvider + ":gcp",
}

// FuzzSanitizeKubeconfig feeds arbitrary bytes, under an arbitrary set of
// operator allowances, to the remote-kubeconfig sanitizer. It must never
// panic; a refusal is a *KubeconfigError with a known reason that quotes no
// credential of the input; an accepted config holds exactly the current
// context with its cluster and user, none of the options that run programs
// or read files unless allowed, and is a fixed point: written out and
// sanitized again, it comes back byte for byte.
func FuzzSanitizeKubeconfig(f *testing.F) {
	f.Fuzz(func(t *testing.T, raw []byte, allowMask uint8) {
		var allowed []string
		for i, opt := range fuzzAllowable {
			if allowMask&(1<<i) != 0 {
				allowed = append(allowed, opt)
			}
		}
		out, err := multicluster.SanitizeKubeconfig(raw, allowed)
		if err != nil {
			checkRefusal(t, raw, err)
			return
		}
		checkSanitized(t, out, allowed)
		first, err := clientcmd.Write(*out)
		if err != nil {
			t.Fatalf("cannot write the sanitized config: %v", err)
		}
		again, err := multicluster.SanitizeKubeconfig(first, allowed)
		if err != nil {
			t.Fatalf("the sanitized config is refused: %v\n%s", err, first)
		}
		second, err := clientcmd.Write(*again)
		if err != nil {
			t.Fatalf("cannot write the re-sanitized config: %v", err)
		}
		if !bytes.Equal(first, second) {
			t.Fatalf("sanitizing is not idempotent:\n%s\n---\n%s", first, second)
		}
	})
}

// checkRefusal requires a KubeconfigError with a known reason, and, for an
// input that parses, that it quotes none of the input's credentials (those
// long enough not to occur by chance, and not also a name it may quote).
func checkRefusal(t *testing.T, raw []byte, err error) {
	var ke *multicluster.KubeconfigError
	if !errors.As(err, &ke) || !slices.Contains([]string{multicluster.ReasonInvalidKubeconfig, multicluster.ReasonNoCurrentContext, multicluster.ReasonForbiddenOption, multicluster.ReasonExecNotAllowed}, ke.Reason) {
		t.Fatalf("refusal %v (%T) is not a KubeconfigError with a known reason", err, err)
	}
	in, lerr := clientcmd.Load(raw)
	if lerr != nil {
		return
	}
	names := []string{in.CurrentContext}
	for n, c := range in.Contexts {
		names = append(names, n, c.Cluster, c.AuthInfo, c.Namespace)
	}
	for n := range in.Clusters {
		names = append(names, n)
	}
	for n, u := range in.AuthInfos {
		names = append(names, n)
		if u.AuthProvider != nil {
			names = append(names, u.AuthProvider.Name)
		}
	}
	for _, u := range in.AuthInfos {
		for _, secret := range []string{u.Token, u.Password, string(u.ClientKeyData)} {
			if len(secret) < 8 || slices.ContainsFunc(names, func(n string) bool { return strings.Contains(n, secret) }) {
				continue
			}
			if strings.Contains(err.Error(), secret) {
				t.Fatalf("refusal %q quotes a credential", err)
			}
		}
	}
}

// checkSanitized checks the shape of an accepted config.
func checkSanitized(t *testing.T, out *clientcmdapi.Config, allowed []string) {
	kctx, ok := out.Contexts[out.CurrentContext]
	if !ok || len(out.Contexts) != 1 || len(out.Clusters) != 1 || len(out.AuthInfos) != 1 {
		t.Fatalf("accepted config is not one context with its cluster and user: %+v", out)
	}
	cl, user := out.Clusters[kctx.Cluster], out.AuthInfos[kctx.AuthInfo]
	if cl == nil || user == nil || cl.Server == "" {
		t.Fatalf("context %q names a missing cluster or user, or a cluster without a server", out.CurrentContext)
	}
	if len(out.Extensions)+len(cl.Extensions)+len(user.Extensions)+len(kctx.Extensions) > 0 || len(out.Preferences.Extensions) > 0 {
		t.Fatal("extensions passed the sanitizer")
	}
	if user.Exec != nil {
		t.Fatal("an exec plugin passed without an allowlist rule")
	}
	allow := func(opt string) bool { return slices.Contains(allowed, opt) }
	for _, c := range []struct {
		set bool
		opt string
	}{
		{user.TokenFile != "", multicluster.AllowTokenFile},
		{user.ClientCertificate != "", multicluster.AllowClientCertificate},
		{user.ClientKey != "", multicluster.AllowClientKey},
		{cl.CertificateAuthority != "", multicluster.AllowCertificateAuthority},
	} {
		if c.set && !allow(c.opt) {
			t.Fatalf("%s passed without the operator's allowance", c.opt)
		}
	}
	if p := user.AuthProvider; p != nil && p.Name != "oidc" && !allow(multicluster.AllowAuthProvider) && !allow(multicluster.AllowAuthProvider+":"+p.Name) {
		t.Fatalf("auth-provider %q passed without the operator's allowance", p.Name)
	}
}
