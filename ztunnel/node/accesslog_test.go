package node_test

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
	"github.com/isthmus-mesh/isthmus/ztunnel/admin"
	"github.com/isthmus-mesh/isthmus/ztunnel/internal/catest"
	"github.com/isthmus-mesh/isthmus/ztunnel/node"
)

// TestNodeAccessLog: a node's proxies write the access log through the
// node's logger (scope=access), one line per hop of a connection, with
// its bytes; the admin endpoint serves /connections and the dropped-line
// counter is exported; with NoAccessLog (--access-log=false) no line is
// written and the connection is carried all the same.
func TestNodeAccessLog(t *testing.T) {
	for _, off := range []bool{false, true} {
		a1, a2 := nextAddr(), nextAddr()
		localVIP := nextAddr()
		startEcho(t, a2)
		ca := catest.Start(t, catest.Options{ConfigCluster: "c1", Listen: "127.0.0.1:0"})
		ca.AddNode(t, "token-a", "c1", "node-a")
		ca.Place("c1", "node-a", "default", "client", true)
		ca.Place("c1", "node-a", "default", "local", true)
		xc := cache.NewLinearCache(workloadv1.TypeURL, cache.WithInitialResources(map[string]types.Resource{
			"c1/default/a1": pod("c1/default/a1", "client", "node-a", "c1", a1, nil),
			"c1/default/a2": pod("c1/default/a2", "local", "node-a", "c1", a2, backs(localKey)),
			localKey:        service("local", localVIP),
		}))
		z := startNode(t, "node-a", "c1", "token-a", startXDS(t, xc, nextAddr(), nil), ca, func(c *node.Config) { c.NoAccessLog = off })
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			code, _ := httpGet(c, z.readyURL)
			require.Equal(c, http.StatusOK, code)
		}, 15*time.Second, 20*time.Millisecond)

		const msg = "logged or not"
		code, got := socksEcho(t, z.socks, a1, "local.default.svc.cluster.local", svcPort, msg)
		require.Equal(t, byte(0), code)
		require.Equal(t, msg, got)

		lines := func() []string {
			var out []string
			for _, l := range strings.Split(z.log.String(), "\n") {
				if strings.Contains(l, `msg="connection complete"`) {
					out = append(out, l)
				}
			}
			return out
		}
		if off {
			// The same exchange logged both lines with the log on; give
			// them the same chance to appear.
			require.Never(t, func() bool { return len(lines()) > 0 }, 300*time.Millisecond, 20*time.Millisecond)
		} else {
			require.EventuallyWithT(t, func(c *assert.CollectT) {
				ls := lines()
				require.Len(c, ls, 2, "the outbound and the inbound hop")
				for _, l := range ls {
					assert.Contains(c, l, "scope=access")
					assert.Contains(c, l, "reason=ok")
					assert.Contains(c, l, "bytes_sent=13")
					assert.Contains(c, l, "bytes_recv=13")
					assert.Contains(c, l, "src.identity=spiffe://cluster.local/ns/default/sa/client")
					assert.Contains(c, l, "dst.identity=spiffe://cluster.local/ns/default/sa/local")
				}
			}, 5*time.Second, 20*time.Millisecond)
		}
		_, body := httpGet(t, z.metricsURL)
		require.Contains(t, body, "isthmus_access_log_dropped_total 0")
		code2, conns := httpGet(t, "http://"+z.admin+"/connections")
		require.Equal(t, http.StatusOK, code2)
		var doc admin.Connections
		require.NoError(t, json.Unmarshal([]byte(conns), &doc))
		require.NotNil(t, doc.Connections)
		require.NoError(t, z.stop())
	}
}
