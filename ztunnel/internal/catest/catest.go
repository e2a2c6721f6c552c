// Package catest runs the real mesh CA (pilot/ca) in-process, on a TLS gRPC
// listener, for ztunnel's tests: caclient's unit tests and the node
// end-to-end test. Kubernetes stays out: a fake clientset holds the CA
// Secret and the ztunnel pods, a token table stands in for TokenReview
// (through pilot/ca's Authenticator dependency), and the test says which
// ServiceAccounts have pods on which node. Only tests import this package;
// it is the one place where ztunnel code touches pilot/ca.
package catest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	pb "istio.io/api/security/v1alpha1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/isthmus-mesh/isthmus/pilot/ca"
)

// Node-proxy account the CA trusts by default (pilot/ca's default).
const (
	ControlPlaneNamespace = ca.DefaultNamespace
	NodeServiceAccount    = "ztunnel"
)

// Options configure a Server.
type Options struct {
	// ConfigCluster is the CA's own cluster (default "c1").
	ConfigCluster string
	// TrustDomain (default cluster.local).
	TrustDomain string
	// DefaultTTL and MaxTTL of issued leaves (pilot/ca defaults when zero).
	DefaultTTL, MaxTTL time.Duration
	// Listen is the listen address (default 127.0.0.1:0). The serving
	// certificate names the listen IP.
	Listen string
}

// Request is one CreateCertificate call as the CA saw it.
type Request struct {
	Token, ClusterID, Impersonated string
	At                             time.Time
	Err                            error
}

// Server is a running CA. Its methods are safe for concurrent use.
type Server struct {
	CA       *ca.CA
	Addr     string
	RootsPEM []byte

	mu       sync.Mutex
	tokens   map[string]ca.Caller
	clusters map[string]*fake.Clientset
	onNode   map[string]bool // cluster/node/ns/sa
	requests []Request
}

// Start runs a CA until the test ends.
func Start(t testing.TB, opts Options) *Server {
	t.Helper()
	if opts.ConfigCluster == "" {
		opts.ConfigCluster = "c1"
	}
	if opts.Listen == "" {
		opts.Listen = "127.0.0.1:0"
	}
	lis, err := net.Listen("tcp", opts.Listen)
	require.NoError(t, err)
	host, _, err := net.SplitHostPort(lis.Addr().String())
	require.NoError(t, err)
	s := &Server{
		Addr: lis.Addr().String(), tokens: map[string]ca.Caller{},
		clusters: map[string]*fake.Clientset{}, onNode: map[string]bool{},
	}
	c, err := ca.New(ca.Config{
		ClusterID: opts.ConfigCluster, TrustDomain: opts.TrustDomain,
		DefaultTTL: opts.DefaultTTL, MaxTTL: opts.MaxTTL, ServingSANs: []string{host},
	}, ca.Deps{
		ConfigClient: s.cluster(opts.ConfigCluster), Clusters: s, Nodes: s,
		Authenticator: s, Registerer: prometheus.NewRegistry(),
	})
	require.NoError(t, err)
	require.NoError(t, c.Init(context.Background()))
	s.CA, s.RootsPEM = c, c.Roots()
	srv := grpc.NewServer(grpc.Creds(credentials.NewTLS(c.ServerTLSConfig())), grpc.UnaryInterceptor(s.record))
	c.Register(srv)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-done
	})
	return s
}

func (s *Server) cluster(id string) *fake.Clientset {
	s.mu.Lock()
	defer s.mu.Unlock()
	c, ok := s.clusters[id]
	if !ok {
		c = fake.NewClientset()
		s.clusters[id] = c
	}
	return c
}

// AddNode registers the ztunnel of node in cluster: a pod of the trusted
// node account scheduled there, and token authenticating as that pod.
func (s *Server) AddNode(t testing.TB, token, cluster, node string) {
	t.Helper()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "ztunnel-" + node, Namespace: ControlPlaneNamespace, UID: types.UID("uid-" + node)},
		Spec:       corev1.PodSpec{ServiceAccountName: NodeServiceAccount, NodeName: node},
	}
	_, err := s.cluster(cluster).CoreV1().Pods(ControlPlaneNamespace).Create(context.Background(), pod, metav1.CreateOptions{})
	require.NoError(t, err)
	s.AddToken(token, cluster, node)
}

// AddToken makes token authenticate as the ztunnel of node (a rotated
// token of a node added with AddNode).
func (s *Server) AddToken(token, cluster, node string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.tokens[token] = ca.Caller{
		Cluster: cluster, Namespace: ControlPlaneNamespace, ServiceAccount: NodeServiceAccount,
		PodName: "ztunnel-" + node, PodUID: "uid-" + node,
	}
}

// Place records that namespace/serviceAccount has (on=true) or no longer
// has a pod on node of cluster, for impersonation checks.
func (s *Server) Place(cluster, node, namespace, serviceAccount string, on bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.onNode[strings.Join([]string{cluster, node, namespace, serviceAccount}, "/")] = on
}

// Requests returns the CreateCertificate calls seen so far.
func (s *Server) Requests() []Request {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Request(nil), s.requests...)
}

// Authenticate implements ca.Authenticator from the token table; the
// "clusterid" metadata must name the caller's cluster.
func (s *Server) Authenticate(ctx context.Context) (*ca.Caller, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	tok := bearer(md)
	s.mu.Lock()
	c, ok := s.tokens[tok]
	s.mu.Unlock()
	if !ok {
		return nil, errors.New("unknown token")
	}
	if v := md.Get(ca.ClusterIDMetadata); len(v) != 1 || v[0] != c.Cluster {
		return nil, fmt.Errorf("clusterid %q does not match the token's cluster", v)
	}
	return &c, nil
}

// KubeClient implements ca.Clusters.
func (s *Server) KubeClient(id string) (kubernetes.Interface, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c, ok := s.clusters[id]
	if !ok {
		return nil, false
	}
	return c, true
}

// ServiceAccountOnNode implements ca.NodeIndex from Place.
func (s *Server) ServiceAccountOnNode(cluster, node, namespace, serviceAccount string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.onNode[strings.Join([]string{cluster, node, namespace, serviceAccount}, "/")]
}

func (s *Server) record(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	r := Request{Token: bearer(md), At: time.Now()}
	if v := md.Get(ca.ClusterIDMetadata); len(v) > 0 {
		r.ClusterID = v[0]
	}
	if cr, ok := req.(*pb.IstioCertificateRequest); ok {
		r.Impersonated = cr.GetMetadata().GetFields()[ca.ImpersonatedIdentityMetadata].GetStringValue()
	}
	resp, err := h(ctx, req)
	if err != nil {
		r.Err = status.Convert(err).Err()
	}
	s.mu.Lock()
	s.requests = append(s.requests, r)
	s.mu.Unlock()
	return resp, err
}

func bearer(md metadata.MD) string {
	for _, v := range md.Get(ca.AuthorizationMetadata) {
		if tok, ok := strings.CutPrefix(v, "Bearer "); ok {
			return tok
		}
	}
	return ""
}
