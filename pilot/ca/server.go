package ca

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509/pkix"
	"fmt"
	"log/slog"
	"net/url"
	"sync"
	"time"

	"github.com/isthmus-mesh/isthmus/internal/nodebind"
	"github.com/isthmus-mesh/isthmus/internal/spiffe"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	pb "istio.io/api/security/v1alpha1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// ImpersonatedIdentityMetadata is the request metadata field (Istio's name) in which a trusted
// node proxy names the SPIFFE ID it asks a certificate for.
const ImpersonatedIdentityMetadata = "ImpersonatedIdentity"

// certService adapts the CA to the generated gRPC interface.
type certService struct {
	pb.UnimplementedIstioCertificateServiceServer
	ca *CA
}

// CreateCertificate implements istio.v1.auth.IstioCertificateService.
func (s certService) CreateCertificate(ctx context.Context, req *pb.IstioCertificateRequest) (*pb.IstioCertificateResponse, error) {
	return s.ca.CreateCertificate(ctx, req)
}

// Register adds the CSR service (istio.v1.auth.IstioCertificateService) to srv.
func (c *CA) Register(srv grpc.ServiceRegistrar) {
	pb.RegisterIstioCertificateServiceServer(srv, certService{ca: c})
}

// CreateCertificate authenticates the caller, authorizes the identity asked for, and signs the
// CSR. A refusal is a gRPC status error with the code of its Reason and a message that starts
// with the reason; each refusal is counted by reason and logged (never with the token or CSR).
func (c *CA) CreateCertificate(ctx context.Context, req *pb.IstioCertificateRequest) (*pb.IstioCertificateResponse, error) {
	start := time.Now()
	resp, caller, id, err := c.createCertificate(ctx, req)
	log := c.log
	if caller != nil {
		log = log.With("cluster", caller.Cluster, "caller", caller.Namespace+"/"+caller.ServiceAccount)
	}
	if err != nil {
		re := reasonOf(err, ReasonSigningFailed)
		c.metrics.refused.WithLabelValues(string(re.Reason)).Inc()
		level, msg := slog.LevelInfo, re.Error()
		if code := re.Reason.Code(); code == codes.Internal || code == codes.Unavailable {
			// Server-side trouble: details (API server addresses, ...) go to the log only.
			level, msg = slog.LevelWarn, string(re.Reason)+": try again later"
		}
		log.Log(ctx, level, "certificate refused", "reason", re.Reason, "err", re.Err)
		return nil, status.Error(re.Reason.Code(), msg)
	}
	c.metrics.issued.Inc()
	c.metrics.latency.Observe(time.Since(start).Seconds())
	log.Debug("certificate issued", "identity", id)
	return resp, nil
}

func (c *CA) createCertificate(ctx context.Context, req *pb.IstioCertificateRequest) (*pb.IstioCertificateResponse, *Caller, string, error) {
	if c.current.Load() == nil {
		return nil, nil, "", refuse(ReasonNotReady, "CA has no signing material yet")
	}
	caller, err := c.authn.Authenticate(ctx)
	if err != nil {
		return nil, nil, "", reasonOf(err, ReasonTokenInvalid)
	}
	// Identities are issued in the trust domain of the caller's cluster,
	// by that domain's own CA.
	td := c.TrustDomainOf(caller.Cluster)
	b, err := c.signerFor(td)
	if err != nil {
		return nil, caller, "", err
	}
	id := Identity{TrustDomain: td, Namespace: caller.Namespace, ServiceAccount: caller.ServiceAccount}.String()
	own := true
	if imp := req.GetMetadata().GetFields()[ImpersonatedIdentityMetadata].GetStringValue(); imp != "" && imp != id {
		own = false
		want, err := c.authorizeImpersonation(ctx, caller, td, imp)
		if err != nil {
			return nil, caller, "", err
		}
		id = want.String() // canonical form, whatever encoding the request used
	}
	csr, err := parseCSR(req.GetCsr())
	if err != nil {
		return nil, caller, id, &RefusalError{Reason: ReasonMalformedCSR, Err: err}
	}
	if err := checkCSRIdentity(csr, id); err != nil {
		return nil, caller, id, &RefusalError{Reason: ReasonIdentityMismatch, Err: err}
	}
	var extensions []pkix.Extension
	if own && c.trusted[caller.Namespace+"/"+caller.ServiceAccount] {
		// A node account's own certificate is bound to the node of its pod: pilot's xDS
		// server serves it that node only.
		pod, err := c.callerPod(ctx, caller, ReasonNodeAccountPod)
		if err != nil {
			return nil, caller, id, err
		}
		ext, err := nodebind.Binding{Cluster: caller.Cluster, Node: pod.Spec.NodeName}.Extension()
		if err != nil {
			return nil, caller, id, &RefusalError{Reason: ReasonNodeAccountPod, Err: err}
		}
		extensions = append(extensions, ext)
	}
	u, err := url.Parse(id)
	if err != nil {
		return nil, caller, id, &RefusalError{Reason: ReasonSigningFailed, Err: err}
	}
	leaf, err := b.signLeaf(leafRequest{publicKey: csr.PublicKey, uris: []*url.URL{u}, extensions: extensions, ttl: c.ttl(req.GetValidityDuration())}, c.now())
	if err != nil {
		return nil, caller, id, &RefusalError{Reason: ReasonSigningFailed, Err: err}
	}
	return &pb.IstioCertificateResponse{CertChain: b.responseChain(leaf)}, caller, id, nil
}

// authorizeImpersonation allows a trusted node account to ask for the identity of a
// ServiceAccount that has a pod on the node of the caller's own pod, in the caller's cluster and
// its trust domain td.
func (c *CA) authorizeImpersonation(ctx context.Context, caller *Caller, td, requested string) (Identity, error) {
	if !c.trusted[caller.Namespace+"/"+caller.ServiceAccount] {
		return Identity{}, refuse(ReasonImpersonationNotTrusted, "%s/%s is not a trusted node account", caller.Namespace, caller.ServiceAccount)
	}
	want, err := ParseIdentity(requested)
	if err != nil {
		return Identity{}, &RefusalError{Reason: ReasonImpersonationInvalid, Err: err}
	}
	if want.TrustDomain != td {
		return Identity{}, refuse(ReasonImpersonationInvalid, "trust domain %q is not %q, cluster %q's", want.TrustDomain, td, caller.Cluster)
	}
	pod, err := c.callerPod(ctx, caller, ReasonImpersonationCallerPod)
	if err != nil {
		return Identity{}, err
	}
	if c.deps.Nodes == nil || !c.deps.Nodes.ServiceAccountOnNode(caller.Cluster, pod.Spec.NodeName, want.Namespace, want.ServiceAccount) {
		return Identity{}, refuse(ReasonImpersonationNotOnNode, "no pod of %s/%s on node %q of cluster %q", want.Namespace, want.ServiceAccount, pod.Spec.NodeName, caller.Cluster)
	}
	return want, nil
}

// callerPod returns the live pod the caller's token is bound to, of the caller's own
// ServiceAccount and scheduled on a node, from the caller's cluster; a token without a pod, a
// pod gone or replaced, of another ServiceAccount or not scheduled is refused for reason.
func (c *CA) callerPod(ctx context.Context, caller *Caller, reason Reason) (*corev1.Pod, error) {
	if caller.PodName == "" || caller.PodUID == "" {
		return nil, refuse(reason, "caller token is not bound to a pod")
	}
	if c.deps.Clusters == nil {
		return nil, refuse(ReasonUnknownCluster, "no cluster clients to look up the caller's pod")
	}
	client, ok := c.deps.Clusters.KubeClient(caller.Cluster)
	if !ok {
		return nil, refuse(ReasonUnknownCluster, "cluster %q is not federated", caller.Cluster)
	}
	lctx, cancel := context.WithTimeout(ctx, c.cfg.ReviewTimeout)
	defer cancel()
	pod, err := client.CoreV1().Pods(caller.Namespace).Get(lctx, caller.PodName, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return nil, refuse(reason, "caller pod %s/%s not found", caller.Namespace, caller.PodName)
	case err != nil:
		return nil, &RefusalError{Reason: ReasonReviewUnavailable, Err: fmt.Errorf("look up caller pod: %w", err)}
	case string(pod.UID) != caller.PodUID:
		return nil, refuse(reason, "caller pod %s/%s was replaced (uid changed)", caller.Namespace, caller.PodName)
	case pod.Spec.ServiceAccountName != caller.ServiceAccount:
		return nil, refuse(reason, "caller pod %s/%s runs as %q", caller.Namespace, caller.PodName, pod.Spec.ServiceAccountName)
	case pod.Spec.NodeName == "":
		return nil, refuse(reason, "caller pod %s/%s is not scheduled", caller.Namespace, caller.PodName)
	}
	return pod, nil
}

// ServingCertificate makes a fresh key and a certificate for the control plane's own TLS
// listener, with Config.ServingSANs (DNS names or IP literals) and Config.ServingTTL, issued by
// the same intermediate as workload certificates. The chain excludes the root.
func (c *CA) ServingCertificate() (*tls.Certificate, error) {
	b := c.current.Load()
	if b == nil {
		return nil, refuse(ReasonNotReady, "CA has no signing material yet")
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("serving key: %w", err)
	}
	leaf, err := b.signLeaf(leafRequest{publicKey: key.Public(), dnsNames: c.cfg.ServingSANs, ttl: c.cfg.ServingTTL}, c.now())
	if err != nil {
		return nil, fmt.Errorf("serving certificate: %w", err)
	}
	chain := [][]byte{leaf.Raw}
	for _, ic := range b.chain {
		chain = append(chain, ic.Raw)
	}
	return &tls.Certificate{Certificate: chain, PrivateKey: key, Leaf: leaf}, nil
}

// ServerTLSConfig is a TLS configuration for the 15012 listener: it serves a ServingCertificate
// renewed at RenewAt (and after Reload), verifies a client certificate, when a client sends one
// (CSR callers have none yet), against the roots of the trust domain it names (TrustBundle), and
// offers h2. Safe for concurrent handshakes.
func (c *CA) ServerTLSConfig() *tls.Config {
	var (
		mu     sync.Mutex
		cur    *tls.Config
		leaf   *tls.Certificate
		source *bundle
		trust  *trustState
	)
	base := &tls.Config{MinVersion: tls.VersionTLS12, NextProtos: []string{"h2"}, ClientAuth: tls.VerifyClientCertIfGiven}
	base.GetConfigForClient = func(*tls.ClientHelloInfo) (*tls.Config, error) {
		mu.Lock()
		defer mu.Unlock()
		b, t := c.current.Load(), c.trust.Load()
		if cur != nil && b == source && t == trust && c.now().Before(spiffe.RenewAt(leaf.Leaf)) {
			return cur, nil
		}
		next, err := c.ServingCertificate()
		if err != nil {
			return nil, err
		}
		leaf, source, trust = next, b, t
		cur = &tls.Config{
			MinVersion: tls.VersionTLS12,
			NextProtos: []string{"h2"},
			ClientAuth: tls.VerifyClientCertIfGiven,
			// The pool lets the TLS stack build the chain; VerifyConnection
			// then holds it to its own trust domain's roots.
			ClientCAs:    t.bundle.Pool(),
			Certificates: []tls.Certificate{*next},
			VerifyConnection: func(cs tls.ConnectionState) error {
				if len(cs.PeerCertificates) == 0 {
					return nil
				}
				_, err := t.bundle.Verify(cs.PeerCertificates, c.now())
				return err
			},
		}
		return cur, nil
	}
	return base
}
