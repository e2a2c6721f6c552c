package ca_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	pb "istio.io/api/security/v1alpha1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/isthmus-mesh/isthmus/pilot/ca"
)

// countingTransport counts the TokenReviews a client sends.
type countingTransport struct {
	rt      http.RoundTripper
	reviews *atomic.Int64
}

func (c countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Method == http.MethodPost && strings.HasSuffix(r.URL.Path, "/tokenreviews") {
		c.reviews.Add(1)
	}
	return c.rt.RoundTrip(r)
}

// TestTokenReviewsCachedAndRateLimited: the CA asks a cluster's API server
// about a token once and reuses the verdict; made-up tokens never reach it;
// a flood of real tokens reaches it at most at the configured rate, and the
// rest are refused as review_rate_limited without a review.
func TestTokenReviewsCachedAndRateLimited(t *testing.T) {
	const ns = "isthmus-system"
	cfgC, remote := clusters(t)
	var reviews atomic.Int64
	rc := rest.CopyConfig(remote.Config)
	rc.WrapTransport = func(rt http.RoundTripper) http.RoundTripper { return countingTransport{rt: rt, reviews: &reviews} }
	counted, err := kubernetes.NewForConfig(rc)
	require.NoError(t, err)
	fed := federation{configCluster: cfgC.Client, remoteCluster: counted}
	ensureNamespace(t, cfgC.Client, ns)
	reg := prometheus.NewRegistry()
	c, err := ca.New(ca.Config{ClusterID: configCluster, Namespace: ns, ServingSANs: []string{servingName}, ReviewRate: 0.001, ReviewBurst: 3,
		ReviewSourceRate: 1000, ReviewSourceBurst: 1000, ReviewAccountRate: 1000, ReviewAccountBurst: 1000},
		ca.Deps{ConfigClient: cfgC.Client, Clusters: fed, Nodes: podLister{fed}, Registerer: reg})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, c.Init(ctx))
	roots := publishedRoots(t, c, configCluster, cfgC.Client, ns)
	client := pb.NewIstioCertificateServiceClient(serve(t, c, roots))

	good := token(t, remote.Client, "shop", "web", []string{"istio-ca"}, nil)
	for range 10 {
		_, err := call(ctx, client, remoteCluster, good, csrFor(t, ""), "")
		require.NoError(t, err)
	}
	require.Equal(t, int64(1), reviews.Load(), "one review for ten requests with one token")

	// Made-up tokens never reach the API server.
	for i := range 10 {
		_, err := call(ctx, client, remoteCluster, fmt.Sprintf("made-up-%d", i), csrFor(t, ""), "")
		require.Equal(t, codes.Unauthenticated, status.Code(err))
	}
	require.Equal(t, int64(1), reviews.Load(), "garbage is refused before any review")

	// Real, distinct tokens: the burst allows two more reviews; the rest are refused first.
	codesSeen := map[codes.Code]int{}
	for range 10 {
		_, err := call(ctx, client, remoteCluster, token(t, remote.Client, "shop", "web", []string{"istio-ca"}, nil), csrFor(t, ""), "")
		codesSeen[status.Code(err)]++
	}
	require.Equal(t, int64(3), reviews.Load())
	require.Equal(t, map[codes.Code]int{codes.OK: 2, codes.ResourceExhausted: 8}, codesSeen)
	require.Equal(t, 8.0, counter(t, reg, refusedTotal, string(ca.ReasonReviewRateLimited)))

	// And the good token still works without a review.
	_, err = call(ctx, client, remoteCluster, good, csrFor(t, ""), "")
	require.NoError(t, err)
	require.Equal(t, int64(3), reviews.Load())
}
