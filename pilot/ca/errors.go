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
	// ReasonTokenInvalid: TokenReview did not authenticate the token (bad signature, another
	// issuer, deleted ServiceAccount or bound object, malformed).
	ReasonTokenInvalid Reason = "token_invalid"
	// ReasonTokenExpired: TokenReview refused the token and its exp claim has passed.
	ReasonTokenExpired Reason = "token_expired"
	// ReasonWrongAudience: the token is not meant for any of Config.Audiences.
	ReasonWrongAudience Reason = "wrong_audience"
	// ReasonNotServiceAccount: the token authenticates a user that is not a ServiceAccount.
	ReasonNotServiceAccount Reason = "not_service_account"
	// ReasonReviewUnavailable: the caller's API server could not be asked.
	ReasonReviewUnavailable Reason = "review_unavailable"
	// ReasonReviewRateLimited: too many TokenReviews to the caller's cluster
	// right now (Config.ReviewRate).
	ReasonReviewRateLimited Reason = "review_rate_limited"
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
		ReasonWrongAudience, ReasonNotServiceAccount:
		return codes.Unauthenticated
	case ReasonMalformedCSR, ReasonImpersonationInvalid:
		return codes.InvalidArgument
	case ReasonIdentityMismatch, ReasonImpersonationNotTrusted, ReasonImpersonationCallerPod,
		ReasonImpersonationNotOnNode:
		return codes.PermissionDenied
	case ReasonReviewUnavailable, ReasonNotReady:
		return codes.Unavailable
	case ReasonReviewRateLimited:
		return codes.ResourceExhausted
	case ReasonTrustDomainUnavailable:
		return codes.FailedPrecondition
	default:
		return codes.Internal
	}
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
