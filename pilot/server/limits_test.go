package server_test

import (
	"io"
	"net"
	"net/http"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/pilot/server"
)

// metricValue reads one sample of pilot's /metrics.
func metricValue(t *testing.T, mon, sample string) float64 {
	t.Helper()
	resp, err := http.Get(mon + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	m := regexp.MustCompile(regexp.QuoteMeta(sample) + ` ([0-9.e+]+)`).FindSubmatch(body)
	if m == nil {
		return 0
	}
	v, err := strconv.ParseFloat(string(m[1]), 64)
	require.NoError(t, err)
	return v
}

// TestStrangersOnTheGRPCPort: a stranger that connects to 15012 and says
// nothing is dropped after the handshake timeout, one that speaks something
// other than TLS at once; each is counted by reason, and pilot keeps serving.
// The plaintext xDS port has the same limits: a silent stranger is dropped.
func TestStrangersOnTheGRPCPort(t *testing.T) {
	require.NoError(t, clusters.Cluster("primary").EnsureNamespace(t.Context(), "limits-system", nil))
	p := runPilot(t, server.Config{
		ClusterID: "primary", Namespace: "limits-system", Network: "network-1",
		DebugAddr: "127.0.0.1:0", MonitoringAddr: "127.0.0.1:0", GRPCAddr: "127.0.0.1:0", XDSPlaintextAddr: "127.0.0.1:0",
		GRPCLimits: server.GRPCLimits{HandshakeTimeout: 300 * time.Millisecond},
	})
	require.Eventually(t, func() bool {
		return p.MonitoringAddr() != "" && p.GRPCAddr() != "" && p.XDSPlaintextAddr() != ""
	}, 20*time.Second, 10*time.Millisecond)
	mon := "http://" + p.MonitoringAddr()

	require.NoError(t, staySilent(p.GRPCAddr()), "closed by pilot (EOF), long before the read deadline")

	garbage, err := net.Dial("tcp", p.GRPCAddr())
	require.NoError(t, err)
	defer garbage.Close()
	_, err = garbage.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
	require.NoError(t, err)
	require.NoError(t, garbage.SetReadDeadline(time.Now().Add(30*time.Second)))
	_, _ = io.ReadAll(garbage)

	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.Equal(c, 1.0, metricValue(t, mon, `isthmus_grpc_handshake_failures_total{reason="timeout"}`))
		require.Equal(c, 1.0, metricValue(t, mon, `isthmus_grpc_handshake_failures_total{reason="tls"}`))
	}, 10*time.Second, 20*time.Millisecond)
	require.Equal(t, http.StatusOK, get(t, mon+"/healthz", nil))

	require.NoError(t, staySilent(p.XDSPlaintextAddr()), "the plaintext port closes a silent connection (EOF) long before the read deadline")
}

// staySilent connects to addr, sends nothing and reads until the server
// closes the connection (nil) or 30 s pass (an error).
func staySilent(addr string) error {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	if err := c.SetReadDeadline(time.Now().Add(30 * time.Second)); err != nil {
		return err
	}
	_, err = io.ReadAll(c)
	return err
}
