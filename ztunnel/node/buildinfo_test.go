package node_test

import (
	"context"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/internal/version"
	"github.com/isthmus-mesh/isthmus/ztunnel/caclient"
	"github.com/isthmus-mesh/isthmus/ztunnel/internal/catest"
	"github.com/isthmus-mesh/isthmus/ztunnel/node"
)

// TestProcessMetrics runs a ztunnel with its metrics listener on a
// loopback address and scrapes /metrics over TCP: isthmus_build_info
// names this build, and the Go runtime and process collectors are there.
func TestProcessMetrics(t *testing.T) {
	ca := catest.Start(t, catest.Options{Listen: netip.AddrPortFrom(nextAddr(), 0).String()})
	ln, err := net.Listen("tcp", netip.AddrPortFrom(nextAddr(), 0).String())
	require.NoError(t, err)
	metricsAddr := ln.Addr().String()
	require.NoError(t, ln.Close())
	cfg := node.Config{
		NodeName: "n", ClusterID: "c1", XDSAddress: "127.0.0.1:1", CAAddress: ca.Addr,
		OutboundListen: node.Disabled, SOCKS5Listen: node.Disabled, AdminListen: node.Disabled,
		ReadinessListen: node.Disabled, MetricsListen: metricsAddr,
	}
	n, err := node.New(cfg, node.Deps{Token: caclient.StaticToken("t"), RootsPEM: ca.RootsPEM, Registry: prometheus.NewRegistry()})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- n.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})

	var body string
	require.Eventually(t, func() bool {
		resp, err := net.DialTimeout("tcp", metricsAddr, time.Second)
		if err != nil {
			return false
		}
		resp.Close()
		var code int
		code, body = httpGet(t, "http://"+metricsAddr+"/metrics")
		return code == 200
	}, 20*time.Second, 20*time.Millisecond)
	i := version.Get()
	require.Contains(t, body, `isthmus_build_info{commit="`+i.Commit+`",go_version="`+i.GoVersion+`",version="`+i.Version+`"} 1`)
	require.Contains(t, body, "go_goroutines ")
	require.Contains(t, body, "process_cpu_seconds_total ")
}
