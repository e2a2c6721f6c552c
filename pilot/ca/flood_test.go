package ca_test

import (
	"context"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	pb "istio.io/api/security/v1alpha1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/isthmus-mesh/isthmus/internal/nodebind"
	"github.com/isthmus-mesh/isthmus/pilot/ca"
)

// forgeClaims returns tok with its payload claims changed by edit and its signature kept:
// a token whose signature no longer matches.
func forgeClaims(t testing.TB, tok string, edit func(map[string]any)) string {
	t.Helper()
	parts := strings.Split(tok, ".")
	require.Len(t, parts, 3)
	raw, err := base64.RawURLEncoding.DecodeString(parts[1])
	require.NoError(t, err)
	var claims map[string]any
	require.NoError(t, json.Unmarshal(raw, &claims))
	edit(claims)
	raw, err = json.Marshal(claims)
	require.NoError(t, err)
	return parts[0] + "." + base64.RawURLEncoding.EncodeToString(raw) + "." + parts[2]
}

// forgeAlg returns tok with its header's alg set to alg, its signature dropped when alg is none.
func forgeAlg(t testing.TB, tok, alg string) string {
	t.Helper()
	parts := strings.Split(tok, ".")
	require.Len(t, parts, 3)
	raw, err := base64.RawURLEncoding.DecodeString(parts[0])
	require.NoError(t, err)
	var hdr map[string]any
	require.NoError(t, json.Unmarshal(raw, &hdr))
	hdr["alg"] = alg
	raw, err = json.Marshal(hdr)
	require.NoError(t, err)
	sig := parts[2]
	if alg == "none" {
		sig = ""
	}
	return base64.RawURLEncoding.EncodeToString(raw) + "." + parts[1] + "." + sig
}

// TestReviewsNotStarvedByFloods: four attacking clients, each from its own loopback source
// address and three connections, send CSRs to the real gRPC CA as fast as they can (at least ten
// times the cluster's review rate): garbage tokens, tokens of another cluster's issuer, real
// tokens with forged claims (claiming the ztunnel account: bad signatures), expired tokens
// signed with the cluster's own key, and a tenant's own valid tokens, each new. Meanwhile a
// ztunnel on node-flood of the remote cluster, from a quiet address, asks for its own
// certificate with fresh pod-bound tokens, within its own address's limit: every request is answered with a certificate bound
// to node-flood. Garbage never reaches a TokenReview; the tenant's reviews are held to its
// account's and sources' limits, so the cluster's bucket is never spent.
func TestReviewsNotStarvedByFloods(t *testing.T) {
	const (
		ns          = "isthmus-system"
		clusterRate = 3
	)
	cfgC, remote := clusters(t)
	var reviews atomic.Int64
	rc := rest.CopyConfig(remote.Config)
	rc.WrapTransport = func(rt http.RoundTripper) http.RoundTripper { return countingTransport{rt: rt, reviews: &reviews} }
	counted, err := kubernetes.NewForConfig(rc)
	require.NoError(t, err)
	fed := federation{configCluster: cfgC.Client, remoteCluster: counted}
	ensureNamespace(t, cfgC.Client, ns)
	reg := prometheus.NewRegistry()
	c, err := ca.New(ca.Config{
		ClusterID: configCluster, Namespace: ns, ServingSANs: []string{servingName},
		ReviewRate: clusterRate, ReviewBurst: 10,
		ReviewSourceRate: 1, ReviewSourceBurst: 2, ReviewAccountRate: 2, ReviewAccountBurst: 5,
	}, ca.Deps{ConfigClient: cfgC.Client, Clusters: fed, Nodes: podLister{fed}, Registerer: reg})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	require.NoError(t, c.Init(ctx))
	roots := publishedRoots(t, c, configCluster, cfgC.Client, ns)
	addr := serveOn(t, c)

	// The attackers' material.
	csr := csrFor(t, "")
	foreign := token(t, cfgC.Client, "shop", "web", []string{"istio-ca"}, nil) // the config cluster's issuer
	real := token(t, remote.Client, "shop", "web", []string{"istio-ca"}, nil)
	expired := expiredToken(t, remote, "shop", "web")
	var tenant []string
	for range 60 {
		tenant = append(tenant, token(t, remote.Client, "tenant", "attacker", []string{"istio-ca"}, nil))
	}
	var next atomic.Int64
	attack := func(i int64) string {
		switch i % 6 {
		case 0:
			return fmt.Sprintf("garbage-%d", i)
		case 1:
			return fmt.Sprintf("eyJhbGciOiJub25lIn0.%s.", base64.RawURLEncoding.EncodeToString([]byte(fmt.Sprintf(`{"n":%d}`, i))))
		case 2:
			return foreign
		case 3:
			return forgeClaims(t, real, func(m map[string]any) {
				m["sub"] = "system:serviceaccount:" + ns + ":ztunnel"
				m["jti"] = fmt.Sprint(i)
			})
		case 4:
			return expired
		default:
			return tenant[int(i/6)%len(tenant)]
		}
	}

	// The honest ztunnel, from its own address.
	zpod := createPod(t, remote.Client, ns, "ztunnel-flood", "ztunnel", "node-flood")
	honest := pb.NewIstioCertificateServiceClient(dialFrom(t, addr, roots, "127.0.0.50"))

	flood, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	var sent atomic.Int64
	for s := range 4 {
		src := fmt.Sprintf("127.0.0.%d", 11+s)
		for range 3 {
			client := pb.NewIstioCertificateServiceClient(dialFrom(t, addr, roots, src))
			wg.Go(func() {
				for flood.Err() == nil {
					_, _ = call(flood, client, remoteCluster, attack(next.Add(1)), csr, "")
					sent.Add(1)
				}
			})
		}
	}
	start := time.Now()
	time.Sleep(500 * time.Millisecond) // every bucket the flood can reach is spent by now
	var refused []error
	const honestRequests = 4
	for range honestRequests {
		tok := token(t, remote.Client, ns, "ztunnel", []string{"istio-ca"}, zpod)
		resp, err := call(ctx, honest, remoteCluster, tok, csrFor(t, ""), "")
		if err != nil {
			refused = append(refused, err)
			continue
		}
		leaf := leafOf(t, resp, roots)
		onlySAN(t, leaf, "spiffe://cluster.local/ns/"+ns+"/sa/ztunnel")
		b, err := nodebind.FromCertificate(leaf)
		require.NoError(t, err)
		require.Equal(t, nodebind.Binding{Cluster: remoteCluster, Node: "node-flood"}, b)
		// Within its own address's limit (1/s): an honest ztunnel needs a review per
		// token rotation, not more.
		time.Sleep(1100 * time.Millisecond)
	}
	stop()
	wg.Wait()
	elapsed := time.Since(start)
	rate := float64(sent.Load()) / elapsed.Seconds()
	t.Logf("flood: %d requests in %s (%.0f/s, %.0fx the cluster's review rate); %d reviews",
		sent.Load(), elapsed.Round(time.Millisecond), rate, rate/clusterRate, reviews.Load())
	require.GreaterOrEqual(t, rate, 10.0*clusterRate, "the flood must reach ten times the cluster's review rate to prove anything")
	require.Empty(t, refused, "the honest ztunnel was refused while the flood ran")

	// Garbage was refused before any review, each kind for its own reason; the tenant was held
	// to its limits, and the cluster's bucket was never the one that refused.
	for _, r := range []ca.Reason{ca.ReasonTokenMalformed, ca.ReasonTokenAlgorithm, ca.ReasonForeignIssuer, ca.ReasonTokenSignature, ca.ReasonTokenExpired} {
		require.Positive(t, counter(t, reg, refusedTotal, string(r)), "refusals for %s", r)
	}
	require.Positive(t, counter(t, reg, refusedTotal, string(ca.ReasonSourceRateLimited))+counter(t, reg, refusedTotal, string(ca.ReasonAccountRateLimited)))
	require.Zero(t, counter(t, reg, refusedTotal, string(ca.ReasonReviewRateLimited)))
	maxTenant := 5 + 2*elapsed.Seconds() + 1 // the tenant account's burst and rate
	require.LessOrEqual(t, float64(reviews.Load()), maxTenant+honestRequests, "reviews: the tenant's within its account's limit, and the ztunnel's")
}

// leafNode returns the node binding of a leaf, failing the test when it has none.
func leafNode(t *testing.T, leaf *x509.Certificate) nodebind.Binding {
	t.Helper()
	b, err := nodebind.FromCertificate(leaf)
	require.NoError(t, err)
	return b
}
