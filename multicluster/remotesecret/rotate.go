package remotesecret

import (
	"context"
	"errors"
	"fmt"

	jose "github.com/go-jose/go-jose/v4"
	"github.com/go-jose/go-jose/v4/jwt"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

// Token is a reader token and the Secret of the remote cluster that it
// lives by: deleting that Secret revokes the token.
type Token struct {
	Value string
	// Secret is the name of the token's Secret, in the reader's namespace.
	Secret string
}

// NewToken mints a new token for the reader ServiceAccount (which
// EnsureReader made): a new service-account-token Secret with a generated
// name, filled by the token controller or, within TokenWait, replaced by a
// TokenRequest token bound to it. Tokens issued before stay valid until
// their own Secret is deleted (RevokeToken).
func NewToken(ctx context.Context, c kubernetes.Interface, opts ReaderOptions) (Token, error) {
	opts = opts.withDefaults()
	return anchoredToken(ctx, c, opts, newTokenSecret(opts))
}

// RevokeToken deletes the Secret a token lives by (Token.Secret, or
// TokenSecret's answer); one already gone is not an error.
func RevokeToken(ctx context.Context, c kubernetes.Interface, namespace, secret string) error {
	err := c.CoreV1().Secrets(namespace).Delete(ctx, secret, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete token secret %s/%s: %w", namespace, secret, err)
	}
	return nil
}

// ErrUnboundToken says that a token names no Secret it lives by (a
// TokenRequest token issued without a bound object, as create-remote-secret
// issued before tokens were bound): only deleting its ServiceAccount, or
// its expiry, ends it.
var ErrUnboundToken = errors.New("the token is bound to no Secret")

// TokenSecret returns the name of the Secret a ServiceAccount token lives
// by, read from its claims: a token controller's token names its Secret, a
// TokenRequest token its bound Secret. The signature is not verified: the
// answer only says what to delete, the API server still decides what a
// token is worth.
func TokenSecret(token string) (string, error) {
	tok, err := jwt.ParseSigned(token, []jose.SignatureAlgorithm{
		jose.RS256, jose.RS384, jose.RS512, jose.ES256, jose.ES384, jose.ES512, jose.PS256, jose.PS384, jose.PS512, jose.EdDSA,
	})
	if err != nil {
		return "", fmt.Errorf("not a ServiceAccount token: %w", err)
	}
	var claims struct {
		Legacy string `json:"kubernetes.io/serviceaccount/secret.name"`
		Bound  struct {
			Secret *struct {
				Name string `json:"name"`
			} `json:"secret"`
		} `json:"kubernetes.io"`
	}
	if err := tok.UnsafeClaimsWithoutVerification(&claims); err != nil {
		return "", fmt.Errorf("token claims: %w", err)
	}
	switch {
	case claims.Legacy != "":
		return claims.Legacy, nil
	case claims.Bound.Secret != nil && claims.Bound.Secret.Name != "":
		return claims.Bound.Secret.Name, nil
	}
	return "", ErrUnboundToken
}

// KubeconfigCredentials returns the server and the bearer token of the
// kubeconfig's current context ("" for what it lacks).
func KubeconfigCredentials(kubeconfig []byte) (server, token string, err error) {
	cfg, err := clientcmd.Load(kubeconfig)
	if err != nil {
		return "", "", fmt.Errorf("kubeconfig: %w", err)
	}
	cur := cfg.Contexts[cfg.CurrentContext]
	if cur == nil {
		return "", "", errors.New("kubeconfig: no current context")
	}
	if cl := cfg.Clusters[cur.Cluster]; cl != nil {
		server = cl.Server
	}
	if u := cfg.AuthInfos[cur.AuthInfo]; u != nil {
		token = u.Token
	}
	return server, token, nil
}

// newTokenSecret is the Secret of a new token: a generated name after the
// ServiceAccount's.
func newTokenSecret(opts ReaderOptions) *corev1.Secret {
	return &corev1.Secret{ObjectMeta: metav1.ObjectMeta{GenerateName: opts.ServiceAccount + "-token-"}}
}
