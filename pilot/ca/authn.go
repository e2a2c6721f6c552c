package ca

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	authnv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/lru"
)

// gRPC metadata keys read by the TokenReview authenticator (Istio's names).
const (
	AuthorizationMetadata = "authorization"
	ClusterIDMetadata     = "clusterid"
)

// Keys of TokenReview user.extra for tokens bound to a pod.
const (
	extraPodName = "authentication.kubernetes.io/pod-name"
	extraPodUID  = "authentication.kubernetes.io/pod-uid"
)

// Caller is an authenticated ServiceAccount of a federated cluster.
type Caller struct {
	// Cluster is the ID of the cluster whose API server vouched for the caller.
	Cluster string
	// Namespace is the ServiceAccount's namespace.
	Namespace string
	// ServiceAccount is the ServiceAccount's name.
	ServiceAccount string
	// PodName and PodUID name the pod the token is bound to; empty for a token not bound to a pod.
	PodName string
	PodUID  string
}

// TokenReviewAuthenticator authenticates a Kubernetes ServiceAccount token from the
// "authorization: Bearer" metadata with a TokenReview in the cluster named by the "clusterid"
// metadata (DefaultCluster when absent). Verdicts are cached by a digest of (cluster, token).
//
// Before a token is reviewed it is prefiltered (see prefilter): a token that cannot be one the
// cluster issued (malformed, an algorithm the API server does not use, expired, not of a
// ServiceAccount, another audience, another issuer, or a signature that does not verify with
// the cluster's own keys from its OIDC discovery) is refused without a review. A review then
// takes one token from three buckets, or from none: the caller's source address's, the claimed
// ServiceAccount's (cluster/namespace/name) and the cluster's, so that garbage and floods from
// some sources or accounts cannot keep a quiet caller's valid token from being reviewed.
//
// Safe for concurrent use; the token is never logged nor kept.
type TokenReviewAuthenticator struct {
	// Clusters gives the client of the cluster the caller names.
	Clusters Clusters
	// DefaultCluster is used when the request has no "clusterid" metadata (Istio does the same
	// with its own cluster).
	DefaultCluster string
	// Audiences are sent with the review; the API server must confirm at least one.
	Audiences []string
	// Timeout bounds the review (0: none beyond the request's own deadline).
	Timeout time.Duration
	// CacheTTL is how long a verdict is reused (0: DefaultReviewCacheTTL; negative: no cache);
	// a success never past the token's exp claim, a refusal for a sixth of it.
	CacheTTL time.Duration
	// Rate and Burst bound the reviews sent per cluster (0: DefaultReviewRate, DefaultReviewBurst).
	Rate  float64
	Burst int
	// SourceRate and SourceBurst bound the reviews asked for from one source address (an IPv4
	// address or an IPv6 /64; 0: DefaultReviewSourceRate, DefaultReviewSourceBurst).
	SourceRate  float64
	SourceBurst int
	// AccountRate and AccountBurst bound the reviews of tokens claiming one ServiceAccount of
	// one cluster (0: DefaultReviewAccountRate, DefaultReviewAccountBurst).
	AccountRate  float64
	AccountBurst int
	// Now is the clock used to tell an expired token from an otherwise invalid one.
	Now func() time.Time
	// Logger receives what the prefilter cannot read of a cluster's issuer (nil: nothing).
	Logger *slog.Logger

	once     sync.Once
	verdicts *lru.Cache // [sha256.Size]byte -> verdict
	clusters *limiterSet
	sources  *limiterSet
	accounts *limiterSet
	issuers  issuers
}

// verdict is a cached review outcome: a caller or a refusal.
type verdict struct {
	caller  *Caller
	err     error
	expires time.Time
}

// reviewCacheSize bounds the cached verdicts (a few MB at most); reviewLimitersSize bounds
// the buckets kept per kind (sources, accounts, clusters): about 100 bytes each.
const (
	reviewCacheSize    = 10000
	reviewLimitersSize = 10000
)

func (a *TokenReviewAuthenticator) init() {
	a.once.Do(func() {
		a.verdicts = lru.New(reviewCacheSize)
		orDefault := func(r float64, b int, dr float64, db int) (float64, int) {
			if r <= 0 {
				r = dr
			}
			if b <= 0 {
				b = db
			}
			return r, b
		}
		r, b := orDefault(a.Rate, a.Burst, DefaultReviewRate, DefaultReviewBurst)
		a.clusters = newLimiterSet(r, b, reviewLimitersSize)
		r, b = orDefault(a.SourceRate, a.SourceBurst, DefaultReviewSourceRate, DefaultReviewSourceBurst)
		a.sources = newLimiterSet(r, b, reviewLimitersSize)
		r, b = orDefault(a.AccountRate, a.AccountBurst, DefaultReviewAccountRate, DefaultReviewAccountBurst)
		a.accounts = newLimiterSet(r, b, reviewLimitersSize)
	})
}

func (a *TokenReviewAuthenticator) cacheTTL() time.Duration {
	if a.CacheTTL == 0 {
		return DefaultReviewCacheTTL
	}
	return a.CacheTTL
}

// cached returns a live verdict on key.
func (a *TokenReviewAuthenticator) cached(key [sha256.Size]byte) (*verdict, bool) {
	v, ok := a.verdicts.Get(key)
	if !ok {
		return nil, false
	}
	vd := v.(*verdict)
	if !a.now().Before(vd.expires) {
		a.verdicts.Remove(key)
		return nil, false
	}
	return vd, true
}

// remember caches the verdict of a review on token.
func (a *TokenReviewAuthenticator) remember(key [sha256.Size]byte, token string, c *Caller, err error) {
	ttl := a.cacheTTL()
	if ttl < 0 {
		return
	}
	var re *RefusalError
	if err != nil {
		if !errors.As(err, &re) || re.Reason == ReasonReviewUnavailable || re.Reason.rateLimited() {
			return // a transient failure says nothing about the token
		}
		ttl /= 6
	}
	expires := a.now().Add(ttl)
	if claims := unverifiedClaims(token); err == nil && claims != nil && claims.Exp != 0 {
		// The API server vouched for the token, so its exp claim holds.
		if exp := time.Unix(claims.Exp, 0); exp.Before(expires) {
			expires = exp
		}
	}
	a.verdicts.Add(key, &verdict{caller: c, err: err, expires: expires})
}

// Authenticate implements Authenticator.
func (a *TokenReviewAuthenticator) Authenticate(ctx context.Context) (*Caller, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	token := bearerToken(md.Get(AuthorizationMetadata))
	if token == "" {
		return nil, refuse(ReasonNoToken, "no bearer token in %q metadata", AuthorizationMetadata)
	}
	cluster := a.DefaultCluster
	if v := md.Get(ClusterIDMetadata); len(v) > 0 && v[0] != "" {
		cluster = v[0]
	}
	client, ok := a.Clusters.KubeClient(cluster)
	if !ok {
		return nil, refuse(ReasonUnknownCluster, "cluster %q is not federated", truncate(cluster, 64))
	}
	a.init()
	key := sha256.Sum256([]byte(cluster + "\x00" + token))
	if v, ok := a.cached(key); ok {
		return v.caller, v.err
	}
	p, err := a.prefilter(ctx, client, cluster, token)
	if err != nil {
		return nil, err
	}
	var src net.Addr
	if pr, ok := peer.FromContext(ctx); ok {
		src = pr.Addr
	}
	switch takeAll(a.now(), a.sources.get(sourceKey(src)), a.accounts.get(cluster+"/"+p.namespace+"/"+p.serviceAccount), a.clusters.get(cluster)) {
	case 0:
		return nil, refuse(ReasonSourceRateLimited, "too many token reviews asked for from this address; retry later")
	case 1:
		return nil, refuse(ReasonAccountRateLimited, "too many token reviews for %s/%s of cluster %q; retry later", p.namespace, p.serviceAccount, cluster)
	case 2:
		return nil, refuse(ReasonReviewRateLimited, "too many token reviews for cluster %q; retry later", cluster)
	}
	c, err := a.review(ctx, client, cluster, token)
	if err == nil {
		a.issuers.of(cluster).learn(p.claims.Issuer)
	}
	a.remember(key, token, c, err)
	return c, err
}

// review asks cluster's API server about token.
func (a *TokenReviewAuthenticator) review(ctx context.Context, client kubernetes.Interface, cluster, token string) (*Caller, error) {
	if a.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, a.Timeout)
		defer cancel()
	}
	review, err := client.AuthenticationV1().TokenReviews().Create(ctx, &authnv1.TokenReview{
		Spec: authnv1.TokenReviewSpec{Token: token, Audiences: a.Audiences},
	}, metav1.CreateOptions{})
	if err != nil {
		return nil, &RefusalError{Reason: ReasonReviewUnavailable, Err: fmt.Errorf("token review in cluster %q: %w", cluster, err)}
	}
	st := review.Status
	if !st.Authenticated {
		return nil, a.classify(token, cluster, st.Error)
	}
	if !slices.ContainsFunc(st.Audiences, func(s string) bool { return slices.Contains(a.Audiences, s) }) {
		return nil, refuse(ReasonWrongAudience, "cluster %q: token is for audiences %q, want one of %q", cluster, st.Audiences, a.Audiences)
	}
	parts := strings.Split(st.User.Username, ":")
	if len(parts) != 4 || parts[0] != "system" || parts[1] != "serviceaccount" || parts[2] == "" || parts[3] == "" {
		return nil, refuse(ReasonNotServiceAccount, "cluster %q: user %q is not a ServiceAccount", cluster, st.User.Username)
	}
	c := &Caller{Cluster: cluster, Namespace: parts[2], ServiceAccount: parts[3]}
	if v := st.User.Extra[extraPodName]; len(v) == 1 {
		c.PodName = v[0]
	}
	if v := st.User.Extra[extraPodUID]; len(v) == 1 {
		c.PodUID = v[0]
	}
	return c, nil
}

// classify names why the API server refused a token. The claims read here are unverified: they
// only choose the reason of a refusal that the API server already made.
func (a *TokenReviewAuthenticator) classify(token, cluster, reviewErr string) error {
	claims := unverifiedClaims(token)
	switch {
	case claims != nil && len(claims.Aud) > 0 && !slices.ContainsFunc(claims.Aud, func(s string) bool { return slices.Contains(a.Audiences, s) }):
		return refuse(ReasonWrongAudience, "cluster %q: token is for audiences %q, want one of %q", cluster, []string(claims.Aud), a.Audiences)
	case claims != nil && claims.Exp != 0 && a.now().Unix() >= claims.Exp:
		return refuse(ReasonTokenExpired, "cluster %q: token expired at %s", cluster, time.Unix(claims.Exp, 0).UTC().Format(time.RFC3339))
	default:
		return refuse(ReasonTokenInvalid, "cluster %q: token not authenticated: %s", cluster, reviewErr)
	}
}

func (a *TokenReviewAuthenticator) now() time.Time {
	if a.Now == nil {
		return time.Now()
	}
	return a.Now()
}

func bearerToken(values []string) string {
	for _, v := range values {
		if scheme, tok, ok := strings.Cut(v, " "); ok && strings.EqualFold(scheme, "bearer") {
			return strings.TrimSpace(tok)
		}
	}
	return ""
}

// audience is a JWT "aud" claim: a string or an array of strings.
type audience []string

// UnmarshalJSON accepts both forms of the claim.
func (a *audience) UnmarshalJSON(b []byte) error {
	var one string
	if err := json.Unmarshal(b, &one); err == nil {
		*a = []string{one}
		return nil
	}
	var many []string
	if err := json.Unmarshal(b, &many); err != nil {
		return fmt.Errorf("aud claim: %w", err)
	}
	*a = many
	return nil
}

type jwtClaims struct {
	Exp int64    `json:"exp"`
	Aud audience `json:"aud"`
}

// unverifiedClaims decodes a JWT's payload without checking it, or returns nil.
func unverifiedClaims(token string) *jwtClaims {
	parts := strings.Split(token, ".")
	if len(parts) != 3 {
		return nil
	}
	raw, err := base64.RawURLEncoding.DecodeString(parts[1])
	if err != nil {
		return nil
	}
	var c jwtClaims
	if json.Unmarshal(raw, &c) != nil {
		return nil
	}
	return &c
}
