package ca

import (
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Reason names why a request was refused; it is the "reason" label of the refusal counter.
type Reason string

// Refusal reasons. Each maps to one gRPC code (see Reason.Code).
const (
	// ReasonNoToken: no "authorization: Bearer" metadata.
	ReasonNoToken Reason = "no_token"
	// ReasonUnknownCluster: the "clusterid" metadata names a cluster that is not federated.
	ReasonUnknownCluster Reason = "unknown_cluster"
	// ReasonTokenInvalid: TokenReview did not authenticate the token (deleted ServiceAccount
	// or bound object, a signature the prefilter could not check, ...).
	ReasonTokenInvalid Reason = "token_invalid"
	// ReasonTokenExpired: the token's exp claim has passed (found by the prefilter, or by
	// TokenReview's refusal).
	ReasonTokenExpired Reason = "token_expired"
	// ReasonTokenMalformed: the token is not a compact JWS of JSON with an exp claim; no
	// review was asked.
	ReasonTokenMalformed Reason = "token_malformed"
	// ReasonTokenAlgorithm: the token is signed with an algorithm Kubernetes API servers do not
	// use (none, HMAC, ...); no review was asked.
	ReasonTokenAlgorithm Reason = "token_algorithm"
	// ReasonForeignIssuer: the token's iss is not the issuer of the cluster it is presented
	// to; no review was asked.
	ReasonForeignIssuer Reason = "token_foreign_issuer"
	// ReasonTokenSignature: the token's signature does not verify with any key of the
	// cluster's (from its OIDC discovery); no review was asked.
	ReasonTokenSignature Reason = "token_bad_signature"
	// ReasonWrongAudience: the token is not meant for any of Config.Audiences.
	ReasonWrongAudience Reason = "wrong_audience"
	// ReasonNotServiceAccount: the token authenticates a user that is not a ServiceAccount.
	ReasonNotServiceAccount Reason = "not_service_account"
	// ReasonReviewUnavailable: the caller's API server could not be asked.
	ReasonReviewUnavailable Reason = "review_unavailable"
	// ReasonReviewRateLimited: too many TokenReviews to the caller's cluster
	// right now (Config.ReviewRate).
	ReasonReviewRateLimited Reason = "review_rate_limited"
	// ReasonSourceRateLimited: too many TokenReviews asked for from the
	// caller's source address (Config.ReviewSourceRate).
	ReasonSourceRateLimited Reason = "review_rate_limited_source"
	// ReasonAccountRateLimited: too many TokenReviews of tokens claiming the
	// caller's ServiceAccount (Config.ReviewAccountRate).
	ReasonAccountRateLimited Reason = "review_rate_limited_account"
	// ReasonNodeAccountPod: a trusted node account asked for its own
	// certificate with a token not bound to a live pod of its own scheduled
	// on a node, so its certificate could not be bound to that node.
	ReasonNodeAccountPod Reason = "node_account_pod"
	// ReasonMalformedCSR: the CSR is not a well-signed PEM CERTIFICATE REQUEST with a usable key.
	ReasonMalformedCSR Reason = "malformed_csr"
	// ReasonIdentityMismatch: the CSR names an identity other than the one being issued.
	ReasonIdentityMismatch Reason = "identity_mismatch"
	// ReasonImpersonationInvalid: ImpersonatedIdentity is not a SPIFFE ID of
	// the trust domain of the caller's cluster.
	ReasonImpersonationInvalid Reason = "impersonation_invalid"
	// ReasonImpersonationNotTrusted: the caller is not a trusted node account.
	ReasonImpersonationNotTrusted Reason = "impersonation_not_trusted"
	// ReasonImpersonationCallerPod: the caller's token is not bound to a live pod of its own
	// (no pod claims, pod gone, uid or ServiceAccount mismatch, or no node).
	ReasonImpersonationCallerPod Reason = "impersonation_caller_pod"
	// ReasonImpersonationNotOnNode: the impersonated ServiceAccount has no pod on the caller's node.
	ReasonImpersonationNotOnNode Reason = "impersonation_not_on_node"
	// ReasonTrustDomainUnavailable: the caller's cluster is in a trust
	// domain this CA holds no signing material for.
	ReasonTrustDomainUnavailable Reason = "trust_domain_unavailable"
	// ReasonNotReady: the CA has no signing material yet (Init has not succeeded).
	ReasonNotReady Reason = "not_ready"
	// ReasonSigningFailed: signing itself failed.
	ReasonSigningFailed Reason = "signing_failed"
)

// Code is the gRPC status code sent for a refusal with this reason.
func (r Reason) Code() codes.Code {
	switch r {
	case ReasonNoToken, ReasonUnknownCluster, ReasonTokenInvalid, ReasonTokenExpired,
		ReasonWrongAudience, ReasonNotServiceAccount, ReasonTokenMalformed, ReasonTokenAlgorithm,
		ReasonForeignIssuer, ReasonTokenSignature:
		return codes.Unauthenticated
	case ReasonMalformedCSR, ReasonImpersonationInvalid:
		return codes.InvalidArgument
	case ReasonIdentityMismatch, ReasonImpersonationNotTrusted, ReasonImpersonationCallerPod,
		ReasonImpersonationNotOnNode, ReasonNodeAccountPod:
		return codes.PermissionDenied
	case ReasonReviewUnavailable, ReasonNotReady:
		return codes.Unavailable
	case ReasonReviewRateLimited, ReasonSourceRateLimited, ReasonAccountRateLimited:
		return codes.ResourceExhausted
	case ReasonTrustDomainUnavailable:
		return codes.FailedPrecondition
	default:
		return codes.Internal
	}
}

// rateLimited reports whether r is a refusal for a review limit (transient: it says nothing
// about the token).
func (r Reason) rateLimited() bool {
	return r == ReasonReviewRateLimited || r == ReasonSourceRateLimited || r == ReasonAccountRateLimited
}

// RefusalError is a request refused for a Reason. Its Error text is safe to send to the caller
// and to log: it never holds a token, a key or a CSR.
type RefusalError struct {
	// Reason is the counted reason; it decides the gRPC code.
	Reason Reason
	// Err says what exactly was wrong.
	Err error
}

func refuse(r Reason, format string, args ...any) *RefusalError {
	return &RefusalError{Reason: r, Err: fmt.Errorf(format, args...)}
}

// Error implements error.
func (e *RefusalError) Error() string { return string(e.Reason) + ": " + e.Err.Error() }

// Unwrap returns the underlying error.
func (e *RefusalError) Unwrap() error { return e.Err }

// GRPCStatus makes status.FromError and status.Code see the reason's code.
func (e *RefusalError) GRPCStatus() *status.Status {
	return status.New(e.Reason.Code(), e.Error())
}

// reasonOf returns the refusal reason of err, defaulting to fallback.
func reasonOf(err error, fallback Reason) *RefusalError {
	var re *RefusalError
	if errors.As(err, &re) {
		return re
	}
	return &RefusalError{Reason: fallback, Err: err}
}
