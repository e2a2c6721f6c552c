package ca

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	jose "github.com/go-jose/go-jose/v4"
	"github.com/go-jose/go-jose/v4/jwt"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// tokenAlgorithms are the signature algorithms a Kubernetes API server signs ServiceAccount
// tokens with (RSA or ECDSA keys; PS* for external signers). Never "none", never HMAC: a token
// signed otherwise is refused before any review.
var tokenAlgorithms = []jose.SignatureAlgorithm{
	jose.RS256, jose.RS384, jose.RS512,
	jose.ES256, jose.ES384, jose.ES512,
	jose.PS256, jose.PS384, jose.PS512,
}

// parseAlgorithms is every algorithm go-jose knows: a token is parsed with them so that one
// signed with another (HS256, say) is told apart from a malformed one.
var parseAlgorithms = append(slices.Clone(tokenAlgorithms), jose.EdDSA, jose.HS256, jose.HS384, jose.HS512)

// maxTokenSize bounds a token's length: Kubernetes tokens are one or two KiB.
const maxTokenSize = 16 << 10

// DiscoveryRefreshInterval is the least time between two reads of one cluster's OIDC discovery
// document and keys: an unknown key ID or issuer makes the prefilter read them again at most
// this often, however many tokens ask.
const DiscoveryRefreshInterval = 10 * time.Second

// tokenClaims are the claims the prefilter reads. They are unverified unless the cluster's
// keys were known (prefiltered.verified).
type tokenClaims struct {
	jwt.Claims
}

// prefiltered is a token that passed the prefilter.
type prefiltered struct {
	claims tokenClaims
	// namespace and serviceAccount are from the sub claim.
	namespace, serviceAccount string
	// verified is true when the signature was checked against the cluster's own keys.
	verified bool
}

// issuers holds what the prefilter knows of each cluster's token issuer: one entry per cluster
// that was ever federated (only those reach the prefilter). Safe for concurrent use.
type issuers struct {
	mu       sync.Mutex
	clusters map[string]*issuer
}

// issuer is one cluster's token issuer: its name and keys, from the cluster's OIDC discovery
// (served by the API server at /.well-known/openid-configuration and /openid/v1/jwks), or, when
// the cluster does not serve it, the issuer of the first token its TokenReview accepted.
type issuer struct {
	mu       sync.Mutex // held while fetching, so that concurrent callers fetch once
	name     string     // "" while unknown
	keys     *jose.JSONWebKeySet
	learned  bool      // name came from an accepted token, not from discovery
	fetched  time.Time // last discovery attempt; zero: never
	failures int       // discovery attempts failed in a row
}

func (is *issuers) of(cluster string) *issuer {
	is.mu.Lock()
	defer is.mu.Unlock()
	if is.clusters == nil {
		is.clusters = map[string]*issuer{}
	}
	i := is.clusters[cluster]
	if i == nil {
		i = &issuer{}
		is.clusters[cluster] = i
	}
	return i
}

// discoveryDoc is the part of the OIDC discovery document read here.
type discoveryDoc struct {
	Issuer string `json:"issuer"`
}

// refresh reads the cluster's discovery document and keys unless it did so less than
// DiscoveryRefreshInterval ago (or force is false and it did so ever). Errors leave what was
// known in place. Callers hold i.mu.
func (i *issuer) refresh(ctx context.Context, client kubernetes.Interface, now time.Time, force bool, timeout time.Duration) error {
	if !i.fetched.IsZero() && (!force || now.Sub(i.fetched) < DiscoveryRefreshInterval) {
		return nil
	}
	i.fetched = now
	rc, ok := client.CoreV1().RESTClient().(*rest.RESTClient)
	if !ok || rc == nil {
		return errors.New("cluster client has no REST client for OIDC discovery")
	}
	if timeout <= 0 || timeout > 5*time.Second {
		timeout = 5 * time.Second
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
	defer cancel()
	raw, err := rc.Get().AbsPath("/.well-known/openid-configuration").DoRaw(ctx)
	if err != nil {
		return fmt.Errorf("read OIDC discovery: %w", err)
	}
	var doc discoveryDoc
	if err := json.Unmarshal(raw, &doc); err != nil || doc.Issuer == "" {
		return fmt.Errorf("OIDC discovery document names no issuer (%v)", err)
	}
	raw, err = rc.Get().AbsPath("/openid/v1/jwks").DoRaw(ctx)
	if err != nil {
		return fmt.Errorf("read service-account keys: %w", err)
	}
	var keys jose.JSONWebKeySet
	if err := json.Unmarshal(raw, &keys); err != nil {
		return fmt.Errorf("service-account keys: %w", err)
	}
	usable := keys.Keys[:0]
	for _, k := range keys.Keys {
		if k.Valid() && k.IsPublic() {
			usable = append(usable, k)
		}
	}
	if len(usable) == 0 {
		return errors.New("service-account key set holds no usable public key")
	}
	keys.Keys = usable
	i.name, i.keys, i.learned = doc.Issuer, &keys, false
	return nil
}

// learn records the issuer of a token the cluster's TokenReview accepted, when discovery gave
// none.
func (i *issuer) learn(name string) {
	if name == "" {
		return
	}
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.name == "" {
		i.name, i.learned = name, true
	}
}

// parseToken checks a token's form and reads its claims unverified: three base64url parts of
// JSON, one signature by an asymmetric algorithm, an exp claim that has not passed, a sub that
// is a ServiceAccount, and an audience among audiences. It never looks at keys; see
// (*TokenReviewAuthenticator).prefilter.
func parseToken(token string, audiences []string, now time.Time) (*jwt.JSONWebToken, *prefiltered, error) {
	if len(token) > maxTokenSize {
		return nil, nil, refuse(ReasonTokenMalformed, "token of %d bytes, over %d", len(token), maxTokenSize)
	}
	if strings.Count(token, ".") != 2 {
		return nil, nil, refuse(ReasonTokenMalformed, "token is not a compact JWS (three dot-separated parts)")
	}
	// Only base64url and the dots: no whitespace for the parser to strip, so that the token
	// reviewed and cached is the token checked.
	if i := strings.IndexFunc(token, func(r rune) bool {
		return !(r == '.' || r == '-' || r == '_' || r >= '0' && r <= '9' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z')
	}); i >= 0 {
		return nil, nil, refuse(ReasonTokenMalformed, "token has a character outside base64url at offset %d", i)
	}
	tok, err := jwt.ParseSigned(token, parseAlgorithms)
	if err != nil {
		var alg *jose.ErrUnexpectedSignatureAlgorithm
		if errors.As(err, &alg) {
			return nil, nil, refuse(ReasonTokenAlgorithm, "token signed with %q, not one of %q", truncate(string(alg.Got), 16), tokenAlgorithms)
		}
		return nil, nil, refuse(ReasonTokenMalformed, "token does not parse: %s", truncate(err.Error(), 120))
	}
	if len(tok.Headers) != 1 {
		return nil, nil, refuse(ReasonTokenMalformed, "token has %d signatures, want 1", len(tok.Headers))
	}
	if alg := jose.SignatureAlgorithm(tok.Headers[0].Algorithm); !slices.Contains(tokenAlgorithms, alg) {
		return nil, nil, refuse(ReasonTokenAlgorithm, "token signed with %q, not one of %q", alg, tokenAlgorithms)
	}
	p := &prefiltered{}
	if err := tok.UnsafeClaimsWithoutVerification(&p.claims); err != nil {
		return nil, nil, refuse(ReasonTokenMalformed, "token claims: %s", truncate(err.Error(), 120))
	}
	c := &p.claims
	if c.Expiry == nil {
		return nil, nil, refuse(ReasonTokenMalformed, "token has no exp claim")
	}
	if exp := c.Expiry.Time(); !now.Before(exp) {
		return nil, nil, refuse(ReasonTokenExpired, "token expired at %s", exp.UTC().Format(time.RFC3339))
	}
	parts := strings.Split(c.Subject, ":")
	if len(parts) != 4 || parts[0] != "system" || parts[1] != "serviceaccount" || parts[2] == "" || parts[3] == "" {
		return nil, nil, refuse(ReasonNotServiceAccount, "token subject %q is not system:serviceaccount:<namespace>:<name>", truncate(c.Subject, 80))
	}
	p.namespace, p.serviceAccount = parts[2], parts[3]
	if !slices.ContainsFunc(c.Audience, func(s string) bool { return slices.Contains(audiences, s) }) {
		return nil, nil, refuse(ReasonWrongAudience, "token is for audiences %q, want one of %q", truncateAll(c.Audience, 4, 64), audiences)
	}
	return tok, p, nil
}

// prefilter refuses, before any TokenReview and without counting against any review limit, a
// token that cannot be one the caller's cluster issued: malformed, signed with an algorithm
// the API server does not use, expired, not of a ServiceAccount, for another audience, of
// another issuer than the cluster's, or, when the cluster's keys are known, not signed by one
// of them. The issuer and keys come from the cluster's OIDC discovery, read on first use and
// again (at most every DiscoveryRefreshInterval) when a token names an unknown key or issuer.
func (a *TokenReviewAuthenticator) prefilter(ctx context.Context, client kubernetes.Interface, cluster, token string) (*prefiltered, error) {
	now := a.now()
	tok, p, err := parseToken(token, a.Audiences, now)
	if err != nil {
		return nil, err
	}
	iss := a.issuers.of(cluster)
	name, set := a.issuerView(ctx, iss, client, cluster, func(i *issuer) bool {
		// Keys still unknown (discovery failed before), or maybe the cluster's issuer
		// changed: look again, at most every interval.
		return i.keys == nil || (i.name != "" && p.claims.Issuer != i.name && !i.learned)
	})
	if name != "" && p.claims.Issuer != name {
		return nil, refuse(ReasonForeignIssuer, "cluster %q: token issuer %q is not the cluster's %q", cluster, truncate(p.claims.Issuer, 120), name)
	}
	if set == nil {
		return p, nil // no keys (no discovery): the review decides
	}
	kid := tok.Headers[0].KeyID
	keysOf := func(set *jose.JSONWebKeySet) []jose.JSONWebKey {
		if kid == "" {
			return set.Keys
		}
		return set.Key(kid)
	}
	keys := keysOf(set)
	if len(keys) == 0 {
		// Maybe a new signing key: look again, at most every interval.
		if _, set = a.issuerView(ctx, iss, client, cluster, func(*issuer) bool { return true }); set != nil {
			keys = keysOf(set)
		}
	}
	if len(keys) == 0 {
		return nil, refuse(ReasonTokenSignature, "cluster %q: token signed by unknown key %q", cluster, truncate(kid, 64))
	}
	for _, k := range keys {
		var verified tokenClaims
		if tok.Claims(k.Key, &verified) == nil {
			p.verified = true
			return p, nil
		}
	}
	return nil, refuse(ReasonTokenSignature, "cluster %q: token signature does not verify with key %q", cluster, truncate(kid, 64))
}

// issuerView returns what is known of cluster's issuer: its name and its keys (nil when
// unknown). It reads the
// cluster's discovery on first use, and again (at most every DiscoveryRefreshInterval) when
// again says so of what is known. The keys returned are never modified.
func (a *TokenReviewAuthenticator) issuerView(ctx context.Context, iss *issuer, client kubernetes.Interface, cluster string,
	again func(*issuer) bool) (string, *jose.JSONWebKeySet) {
	iss.mu.Lock()
	defer iss.mu.Unlock()
	a.refreshIssuer(ctx, iss, client, cluster, false)
	if again(iss) {
		a.refreshIssuer(ctx, iss, client, cluster, true)
	}
	return iss.name, iss.keys
}

// refreshIssuer refreshes iss (held) and logs a failure.
func (a *TokenReviewAuthenticator) refreshIssuer(ctx context.Context, iss *issuer, client kubernetes.Interface, cluster string, force bool) {
	err := iss.refresh(ctx, client, a.now(), force, a.Timeout)
	switch {
	case err == nil:
		iss.failures = 0
	case a.Logger != nil:
		level := slog.LevelDebug
		if iss.failures == 0 {
			level = slog.LevelWarn
		}
		iss.failures++
		a.Logger.Log(ctx, level, "token prefilter: the cluster's issuer and keys are unavailable; tokens are checked by review only",
			"cluster", cluster, "err", err)
	}
}

// truncate cuts s (request data) to n bytes for an error message.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

func truncateAll(ss []string, most, n int) []string {
	out := make([]string, 0, min(len(ss), most))
	for i, s := range ss {
		if i == most {
			out = append(out, "...")
			break
		}
		out = append(out, truncate(s, n))
	}
	return out
}
