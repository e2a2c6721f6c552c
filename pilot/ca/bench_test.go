package ca_test

import (
	"context"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	pb "istio.io/api/security/v1alpha1"

	"github.com/isthmus-mesh/isthmus/pilot/ca"
)

// staticAuthenticator admits every request as one ServiceAccount: it replaces the TokenReview
// round trip so that the benchmark measures gRPC, TLS framing and signing only.
type staticAuthenticator struct{ caller ca.Caller }

func (s staticAuthenticator) Authenticate(context.Context) (*ca.Caller, error) {
	c := s.caller
	return &c, nil
}

// BenchmarkCreateCertificate signs P-256 CSRs through the real gRPC server over TLS on
// 127.0.0.1 with 50 concurrent callers, and reports certificates per second and the p99 latency
// of one call. The CA's root comes from the real config cluster; authentication is
// staticAuthenticator (no TokenReview).
func BenchmarkCreateCertificate(b *testing.B) {
	cfgC, _ := clusters(b)
	const ns = "ca-bench"
	ensureNamespace(b, cfgC.Client, ns)
	c, err := ca.New(ca.Config{ClusterID: configCluster, Namespace: ns, ServingSANs: []string{servingName}}, ca.Deps{
		ConfigClient:  cfgC.Client,
		Authenticator: staticAuthenticator{ca.Caller{Cluster: configCluster, Namespace: "bench", ServiceAccount: "client"}},
		Registerer:    prometheus.NewRegistry(),
	})
	require.NoError(b, err)
	require.NoError(b, c.Init(context.Background()))
	client := pb.NewIstioCertificateServiceClient(serve(b, c, c.Roots()))
	csr := csrFor(b, "")
	// warm the connection and the serving certificate
	_, err = client.CreateCertificate(context.Background(), &pb.IstioCertificateRequest{Csr: csr})
	require.NoError(b, err)

	const callers = 50
	b.SetParallelism((callers + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
	var mu sync.Mutex
	var lat []time.Duration
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb2 *testing.PB) {
		var local []time.Duration
		for pb2.Next() {
			t := time.Now()
			_, err := client.CreateCertificate(context.Background(), &pb.IstioCertificateRequest{Csr: csr})
			local = append(local, time.Since(t))
			if err != nil {
				b.Error(err)
				return
			}
		}
		mu.Lock()
		lat = append(lat, local...)
		mu.Unlock()
	})
	elapsed := time.Since(start)
	b.StopTimer()
	slices.Sort(lat)
	b.ReportMetric(float64(len(lat))/elapsed.Seconds(), "certs/s")
	b.ReportMetric(float64(lat[(len(lat)*99)/100].Microseconds())/1000, "p99-ms")
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
}
