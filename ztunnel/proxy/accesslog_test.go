package proxy

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	securityv1 "github.com/isthmus-mesh/isthmus/pilot/api/security/v1"
	"github.com/isthmus-mesh/isthmus/ztunnel/authz"
	"github.com/isthmus-mesh/isthmus/ztunnel/hbone"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// logBuffer collects JSON log lines; safe for concurrent use.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// lines returns the records logged with message msg.
func (b *logBuffer) lines(t testing.TB, msg string) []map[string]any {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(b.buf.Bytes()))
	for sc.Scan() {
		var rec map[string]any
		require.NoError(t, json.Unmarshal(sc.Bytes(), &rec), sc.Text())
		if rec["msg"] == msg {
			out = append(out, rec)
		}
	}
	return out
}

// accessLogs gives each proxy of the mesh an access log writing JSON to
// its own buffer, rate and burst as given (0: the defaults).
func accessLogs(t testing.TB, rate float64, burst int) (map[string]*AccessLog, map[string]*logBuffer, map[string]*prometheus.Registry) {
	logs, bufs, regs := map[string]*AccessLog{}, map[string]*logBuffer{}, map[string]*prometheus.Registry{}
	for _, node := range []string{"node-a", "node-b", "node-c", "node-g"} {
		bufs[node], regs[node] = &logBuffer{}, prometheus.NewRegistry()
		al, err := NewAccessLog(AccessLogConfig{Log: slog.New(slog.NewJSONHandler(bufs[node], nil)), Rate: rate, Burst: burst, Registerer: regs[node]})
		require.NoError(t, err)
		logs[node] = al
	}
	return logs, bufs, regs
}

// onlyRemote leaves n1 only the synthetic workload of n2's echo: the
// client's connections cross to cluster c2 through the gateway.
func onlyRemote(m *mesh) {
	m.n1.Update(func(tx *state.Tx) { tx.RemoveWorkload("b1") })
	m.n2.Update(func(tx *state.Tx) {
		c := pod("c1", m.c1, "node-c", "n2", "c2", "echo")
		c.WorkloadName = "echo-c2"
		tx.UpsertWorkload(c)
	})
}

// authzResource wraps a as the delta resource pilot sends.
func authzResource(t testing.TB, a *securityv1.Authorization) *discovery.Resource {
	b, err := proto.Marshal(a)
	require.NoError(t, err)
	var name string
	switch k := a.GetKind().(type) {
	case *securityv1.Authorization_Policy:
		name = securityv1.PolicyName(k.Policy.GetNamespace(), k.Policy.GetName())
	case *securityv1.Authorization_Workload:
		name = securityv1.WorkloadName(k.Workload.GetUid())
	}
	return &discovery.Resource{Name: name, Version: "1", Resource: &anypb.Any{TypeUrl: securityv1.TypeURL, Value: b}}
}

// denyClientEnforcer is a real authz.Enforcer holding one namespace DENY
// policy, default/deny-client, that refuses the client's identity, bound
// to workload c1.
func denyClientEnforcer(t testing.TB) *authz.Enforcer {
	s := authz.NewStore()
	deny := &securityv1.Authorization{Kind: &securityv1.Authorization_Policy{Policy: &securityv1.Policy{
		Name: "deny-client", Namespace: "default", Scope: securityv1.Scope_NAMESPACE, Action: securityv1.Action_DENY,
		Rules: []*securityv1.Rule{{Clauses: []*securityv1.Clause{{Matches: []*securityv1.Match{{
			Principals: []*securityv1.StringMatch{{Kind: &securityv1.StringMatch_Exact{Exact: "cluster.local/ns/default/sa/client"}}},
		}}}}}},
	}}}
	bind := &securityv1.Authorization{Kind: &securityv1.Authorization_Workload{Workload: &securityv1.WorkloadPolicies{Uid: "c1", Namespace: "default"}}}
	require.Empty(t, s.Apply([]*discovery.Resource{authzResource(t, deny), authzResource(t, bind)}, nil))
	e, err := authz.New(authz.Config{}, authz.Deps{Store: s, Registerer: prometheus.NewRegistry()})
	require.NoError(t, err)
	return e
}

// TestAccessLogPolicyDeniedAcrossClusters: a connection from cluster c1
// through n2's gateway to c1's echo, refused there by an
// AuthorizationPolicy, is in the destination ztunnel's access log with
// both identities, policy_denied and the deciding policy; the source's
// line says it failed.
func TestAccessLogPolicyDeniedAcrossClusters(t *testing.T) {
	logs, bufs, _ := accessLogs(t, 0, 0)
	m := newMesh(t, func(m *mesh) { m.logs, m.authzC = logs, denyClientEnforcer(t) })
	onlyRemote(m)
	c, code := socksDial(t, m.socksAddr, m.a1, echoHost, svcPort)
	c.Close()
	require.NotEqual(t, byte(0), code, "the destination refuses the client")

	var dst map[string]any
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		lines := bufs["node-c"].lines(t, "connection complete")
		require.Len(ct, lines, 1)
		dst = lines[0]
	}, 5*time.Second, 10*time.Millisecond)
	assert.Equal(t, "WARN", dst["level"])
	assert.Equal(t, ClosePolicyDenied, dst["reason"])
	assert.Equal(t, "spiffe://cluster.local/ns/default/sa/client", dst["src.identity"])
	assert.Equal(t, "spiffe://cluster.local/ns/default/sa/echo", dst["dst.identity"])
	assert.Equal(t, "default/deny-client", dst["policy"])
	assert.Equal(t, authz.ReasonDenyPolicy, dst["policy_reason"])
	assert.Equal(t, ReasonAuthzPrefix+authz.ReasonDenyPolicy, dst["detail"])
	assert.Equal(t, DirectionInbound, dst["direction"])
	assert.Equal(t, "echo-c2", dst["dst.workload"])
	assert.Equal(t, "c2", dst["dst.cluster"])
	assert.Equal(t, "n2", dst["dst.network"])
	assert.Equal(t, echoHost, dst["dst.service"])
	assert.Equal(t, netip.AddrPortFrom(m.c1, 15008).String(), dst["dst.hbone_addr"])
	assert.EqualValues(t, 0, dst["bytes_sent"])
	assert.EqualValues(t, 0, dst["bytes_recv"])
	assert.Contains(t, dst["error"], "deny-client")

	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		lines := bufs["node-a"].lines(t, "connection complete")
		require.Len(ct, lines, 1)
		assert.Equal(ct, DirectionOutbound, lines[0]["direction"])
		assert.NotEqual(ct, CloseOK, lines[0]["reason"])
		assert.Equal(ct, "spiffe://cluster.local/ns/default/sa/client", lines[0]["src.identity"])
		assert.Equal(ct, "c1", lines[0]["src.cluster"])
	}, 5*time.Second, 10*time.Millisecond)
	require.Empty(t, logs["node-c"].Active())
}

// TestAccessLogAllowed: a connection carried across clusters is logged
// once by each hop when it closes, with the bytes each way and the
// duration, and is listed as active while it is open.
func TestAccessLogAllowed(t *testing.T) {
	logs, bufs, _ := accessLogs(t, 0, 0)
	m := newMesh(t, func(m *mesh) { m.logs = logs })
	onlyRemote(m)
	c, code := socksDial(t, m.socksAddr, m.a1, echoHost, svcPort)
	defer c.Close()
	require.Equal(t, byte(0), code)
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		active := logs["node-c"].Active()
		require.Len(ct, active, 1)
		assert.Equal(ct, "spiffe://cluster.local/ns/default/sa/client", active[0].SourceIdentity)
		assert.Equal(ct, "echo-c2", active[0].DestinationWorkload)
		require.Len(ct, logs["node-a"].Active(), 1)
		require.Len(ct, logs["node-g"].Active(), 1)
	}, 5*time.Second, 10*time.Millisecond)
	require.Empty(t, bufs["node-c"].lines(t, "connection complete"), "nothing logged while open")

	const msg = "hello across clusters"
	got, err := echoOnce(c, msg)
	require.NoError(t, err)
	require.Equal(t, msg, got)

	line := func(node string) map[string]any {
		var l map[string]any
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			lines := bufs[node].lines(t, "connection complete")
			require.Len(ct, lines, 1)
			l = lines[0]
		}, 5*time.Second, 10*time.Millisecond, node)
		return l
	}
	for _, node := range []string{"node-a", "node-c"} {
		l := line(node)
		assert.Equal(t, CloseOK, l["reason"], node)
		assert.Equal(t, "INFO", l["level"], node)
		assert.EqualValues(t, len(msg), l["bytes_sent"], node)
		assert.EqualValues(t, len(msg), l["bytes_recv"], node)
		d, err := time.ParseDuration(l["duration"].(string))
		require.NoError(t, err, node)
		assert.GreaterOrEqual(t, d, time.Duration(0), node)
		assert.Equal(t, "spiffe://cluster.local/ns/default/sa/client", l["src.identity"], node)
		assert.Equal(t, echoHost, l["dst.service"], node)
		assert.Equal(t, "n2", l["dst.network"], node)
		assert.NotContains(t, l, "error", node)
	}
	a := line("node-a")
	assert.Equal(t, DirectionOutbound, a["direction"])
	assert.Equal(t, "c1", a["src.cluster"])
	assert.Equal(t, "n1", a["src.network"])
	assert.Equal(t, echoHost+":18080", a["dst.addr"], "what the client asked for")
	assert.Empty(t, a["dst.hbone_addr"], "hidden behind the gateway's pooled tunnel")
	cl := line("node-c")
	assert.Equal(t, DirectionInbound, cl["direction"])
	assert.Equal(t, "spiffe://cluster.local/ns/default/sa/echo", cl["dst.identity"])
	assert.Equal(t, "c2", cl["dst.cluster"])
	assert.Equal(t, "echo-c2", cl["dst.workload"])
	assert.Equal(t, netip.AddrPortFrom(m.c1, appPort).String(), cl["dst.addr"])

	// The gateway carries the pooled outer tunnel, which outlives the
	// connection: its line comes when the tunnel closes.
	require.Len(t, logs["node-g"].Active(), 1)
	require.NoError(t, m.out.Close())
	g := line("node-g")
	assert.Equal(t, DirectionGateway, g["direction"])
	assert.Equal(t, netip.AddrPortFrom(m.c1, appPort).String(), g["dst.addr"], "the endpoint the gateway chose")
	assert.Greater(t, g["bytes_sent"], float64(len(msg)), "the gateway carries the inner TLS")
	assert.Greater(t, g["bytes_recv"], float64(len(msg)))
	assert.Equal(t, "spiffe://cluster.local/ns/default/sa/client", g["src.identity"])
	assert.Equal(t, "spiffe://cluster.local/ns/default/sa/echo", g["dst.identity"])
	assert.Equal(t, echoHost, g["dst.service"])
	assert.Equal(t, "c2", g["dst.cluster"])
	assert.Contains(t, []any{CloseOK, CloseReset}, g["reason"], "the tunnel ends when the source closes its pool")
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		for _, node := range []string{"node-a", "node-c", "node-g"} {
			assert.Empty(ct, logs[node].Active(), node)
		}
	}, 5*time.Second, 10*time.Millisecond)
}

// TestAccessLogOff: with the access log off (no logger: the flag's
// false), connections are carried and listed as active, and no line is
// written, not even to the proxies' own logs.
func TestAccessLogOff(t *testing.T) {
	logs := map[string]*AccessLog{}
	for _, node := range []string{"node-a", "node-b", "node-c", "node-g"} {
		al, err := NewAccessLog(AccessLogConfig{})
		require.NoError(t, err)
		logs[node] = al
	}
	m := newMesh(t, func(m *mesh) { m.logs = logs })
	onlyRemote(m)
	c, code := socksDial(t, m.socksAddr, m.a1, echoHost, svcPort)
	defer c.Close()
	require.Equal(t, byte(0), code)
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		require.Len(ct, logs["node-c"].Active(), 1)
	}, 5*time.Second, 10*time.Millisecond)
	got, err := echoOnce(c, "quiet")
	require.NoError(t, err)
	require.Equal(t, "quiet", got)
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		require.Empty(ct, logs["node-c"].Active())
	}, 5*time.Second, 10*time.Millisecond)
	for node, al := range logs {
		require.Zero(t, al.Dropped(), node)
	}
}

// TestAccessLogOffWritesNothing: the same through a logger that records
// every line: an AccessLog without Log writes none of them.
func TestAccessLogOffWritesNothing(t *testing.T) {
	var buf logBuffer
	on, err := NewAccessLog(AccessLogConfig{Log: slog.New(slog.NewJSONHandler(&buf, nil))})
	require.NoError(t, err)
	off, err := NewAccessLog(AccessLogConfig{})
	require.NoError(t, err)
	for _, al := range []*AccessLog{off, on} {
		r := al.Open(DirectionInbound)
		r.Established()
		r.Close(CloseOK, 1, 2, nil)
	}
	require.Len(t, buf.lines(t, "connection complete"), 1, "only the one that is on")
}

// TestAccessLogRateLimit: over the token bucket, lines are dropped and
// counted (Dropped and isthmus_access_log_dropped_total); the
// connections are carried all the same.
func TestAccessLogRateLimit(t *testing.T) {
	// A bucket of 2 that refills once in ~30 years: no refill in the test.
	logs, bufs, regs := accessLogs(t, 1e-9, 2)
	m := newMesh(t, func(m *mesh) { m.logs = logs })
	m.n1.Update(func(tx *state.Tx) { tx.RemoveWorkload("n2/echo") })
	for i := range 5 {
		c, code := socksDial(t, m.socksAddr, m.a1, echoHost, svcPort)
		require.Equal(t, byte(0), code)
		got, err := echoOnce(c, fmt.Sprint("msg ", i))
		c.Close()
		require.NoError(t, err)
		require.Equal(t, fmt.Sprint("msg ", i), got)
	}
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		require.EqualValues(ct, 3, logs["node-b"].Dropped())
		require.EqualValues(ct, 3, logs["node-a"].Dropped())
	}, 5*time.Second, 10*time.Millisecond)
	require.Len(t, bufs["node-b"].lines(t, "connection complete"), 2)
	require.Len(t, bufs["node-a"].lines(t, "connection complete"), 2)
	require.Equal(t, 3.0, testutil.ToFloat64(mustCounter(t, regs["node-b"], "isthmus_access_log_dropped_total")))
}

func mustCounter(t testing.TB, reg *prometheus.Registry, name string) prometheus.Collector {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name {
			c := prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: "copy"})
			c.Add(mf.GetMetric()[0].GetCounter().GetValue())
			return c
		}
	}
	t.Fatalf("%s not registered", name)
	return nil
}

// TestCloseReason: every refusal reason the proxies count maps to one of
// the access log's reasons, and the mapping is the documented one.
func TestCloseReason(t *testing.T) {
	vocabulary := map[string]bool{ClosePolicyDenied: true, ClosePolicyRevoked: true, CloseConnectFailed: true, CloseNoRoute: true,
		ClosePeerIdentityMismatch: true, CloseGatewayIdentityMismatch: true, CloseNoPeerIdentity: true, CloseBadRequest: true}
	for _, tc := range []struct{ refusal, want string }{
		{ReasonAuthzPrefix + authz.ReasonDenyPolicy, ClosePolicyDenied},
		{ReasonAuthzPrefix + authz.ReasonAllowUnmatched, ClosePolicyDenied},
		{ReasonAuthzPrefix + authz.ReasonPolicyUnknown, ClosePolicyDenied},
		{ReasonAuthzPrefix + "revoked", ClosePolicyRevoked},
		{ReasonPlaintextRefused, ClosePolicyDenied},
		{ReasonUpstreamConnect, CloseConnectFailed},
		{ReasonUpstreamUnavailble, CloseConnectFailed},
		{ReasonNoLocalEndpoint, CloseConnectFailed},
		{ReasonNoRoute, CloseNoRoute},
		{ReasonUnknownService, CloseNoRoute},
		{ReasonNotVisible, CloseNoRoute},
		{ReasonDestinationNotLocal, CloseNoRoute},
		{ReasonSelfDestination, CloseNoRoute},
		{ReasonPeerIdentity, ClosePeerIdentityMismatch},
		{ReasonPeerUntrusted, ClosePeerIdentityMismatch},
		{ReasonGatewayIdentity, CloseGatewayIdentityMismatch},
		{ReasonNoPeerIdentity, CloseNoPeerIdentity},
		{hbone.ReasonBadAuthority, CloseBadRequest},
		{"anything else", CloseConnectFailed},
	} {
		got := closeReason(tc.refusal)
		require.Equal(t, tc.want, got, tc.refusal)
		require.True(t, vocabulary[got])
	}
}

// TestAccessLogNoSecrets: a line carries no certificate, key or token
// material, whatever the error says; the error is a bounded value.
func TestAccessLogNoSecrets(t *testing.T) {
	var buf logBuffer
	al, err := NewAccessLog(AccessLogConfig{Log: slog.New(slog.NewJSONHandler(&buf, nil))})
	require.NoError(t, err)
	r := al.Open(DirectionOutbound)
	r.Close(CloseConnectFailed, 0, 0, fmt.Errorf("peer said: %s", strings.Repeat("x", 4096)))
	lines := buf.lines(t, "connection complete")
	require.Len(t, lines, 1)
	require.LessOrEqual(t, len(lines[0]["error"].(string)), maxErrorLen+3)
	for k := range lines[0] {
		require.NotContains(t, strings.ToLower(k), "token")
		require.NotContains(t, strings.ToLower(k), "key")
	}
}

// TestAccessLogLevel: a line below the logger's level is neither written
// nor counted as dropped (it takes no token of the bucket).
func TestAccessLogLevel(t *testing.T) {
	var buf logBuffer
	al, err := NewAccessLog(AccessLogConfig{Log: slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelWarn})), Rate: 1e-9, Burst: 1})
	require.NoError(t, err)
	for range 3 {
		al.Open(DirectionInbound).Close(CloseOK, 1, 1, nil) // INFO: below WARN
	}
	al.Open(DirectionInbound).Close(ClosePolicyDenied, 0, 0, nil)
	lines := buf.lines(t, "connection complete")
	require.Len(t, lines, 1)
	require.Equal(t, ClosePolicyDenied, lines[0]["reason"])
	require.Zero(t, al.Dropped())
}
