package dns_test

import (
	"strings"
	"testing"

	mdns "github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/ztunnel/dns"
)

// TestIstioRequestsCounter proves istio_dns_requests_total counts every
// query the handler answers, mesh and forwarded, with Istio's labels: the
// query type (a fixed set, else "other") and the transport, the source
// labels unknown; and that it moves with isthmus_dns_queries_total.
func TestIstioRequestsCounter(t *testing.T) {
	m, up := newMesh(), startUpstream(t)
	p := startProxy(t, dns.Config{Upstreams: []string{up.addr}}, meshDeps(m))
	exchange(t, "udp", p.addr, m.client, "echo.demo.svc.cluster.local.", mdns.TypeA, 0)
	exchange(t, "udp", p.addr, m.client, "echo.demo.svc.cluster.local.", mdns.TypeA, 0)
	exchange(t, "tcp", p.addr, m.client, "echo.demo.svc.cluster.local.", mdns.TypeAAAA, 0)
	exchange(t, "udp", p.addr, m.client, "example.org.", mdns.TypeA, 0)            // forwarded
	exchange(t, "udp", p.addr, m.client, "echo.demo.svc.cluster.local.", 65280, 0) // private-use type

	want := `
# HELP istio_dns_requests_total Total number of DNS requests (Istio's ztunnel metric).
# TYPE istio_dns_requests_total counter
istio_dns_requests_total{request_protocol="tcp",request_query_type="aaaa",source_canonical_revision="unknown",source_canonical_service="unknown"} 1
istio_dns_requests_total{request_protocol="udp",request_query_type="a",source_canonical_revision="unknown",source_canonical_service="unknown"} 3
istio_dns_requests_total{request_protocol="udp",request_query_type="other",source_canonical_revision="unknown",source_canonical_service="unknown"} 1
`
	require.NoError(t, testutil.GatherAndCompare(p.reg, strings.NewReader(want), "istio_dns_requests_total"))
	require.Equal(t, 5.0, count(t, p, dns.KindMesh)+count(t, p, dns.KindForwarded))
}
