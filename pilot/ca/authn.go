package ca

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc/metadata"
	authnv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
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
// metadata (DefaultCluster when absent). Safe for concurrent use; the token is never logged.
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
	// Now is the clock used to tell an expired token from an otherwise invalid one.
	Now func() time.Time
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
		return nil, refuse(ReasonUnknownCluster, "cluster %q is not federated", cluster)
	}
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
