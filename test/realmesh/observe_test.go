package realmesh_test

import (
	"bufio"
	"encoding/json"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/test/framework/meshup"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// checkDeniedLogged: the destination's ztunnel (cluster-2, on the server's
// node) logged the intruder's refused connection as Istio's ztunnel does:
// one "connection complete" line with both identities and policy_denied.
func (s *scenario) checkDeniedLogged(t *testing.T) {
	node := s.nodeOf(t, s.c2)
	var seen int
	ok := assert.EventuallyWithT(t, func(c *assert.CollectT) {
		pods, err := s.c2.Client.CoreV1().Pods(meshup.SystemNamespace).List(t.Context(), metav1.ListOptions{
			LabelSelector: "app=" + ztunnelDS, FieldSelector: "spec.nodeName=" + node,
		})
		require.NoError(c, err)
		require.NotEmpty(c, pods.Items, "ztunnel of %s", node)
		seen = 0
		var found bool
		for _, p := range pods.Items {
			raw, err := s.c2.Client.CoreV1().Pods(p.Namespace).GetLogs(p.Name, &corev1.PodLogOptions{Container: p.Spec.Containers[0].Name}).DoRaw(t.Context())
			require.NoError(c, err)
			sc := bufio.NewScanner(strings.NewReader(string(raw)))
			sc.Buffer(make([]byte, 64<<10), 1<<20)
			for sc.Scan() {
				var line map[string]any
				if json.Unmarshal(sc.Bytes(), &line) != nil || line["msg"] != "connection complete" {
					continue
				}
				seen++
				src, _ := line["src.identity"].(string)
				dst, _ := line["dst.identity"].(string)
				if line["reason"] == "policy_denied" && strings.HasSuffix(src, "/ns/"+appNS+"/sa/other") && strings.HasSuffix(dst, "/ns/"+appNS+"/sa/default") {
					found = true
					t.Logf("access log of %s: %s", p.Name, sc.Text())
				}
			}
		}
		require.True(c, found, "no policy_denied line for sa/other -> sa/default among %d access log lines", seen)
	}, time.Minute, 2*time.Second)
	if !ok {
		t.FailNow()
	}
}

// checkZtunnelConfig runs `isthmusctl ztunnel-config workloads` against
// cluster-1's ztunnel, through the API server's port-forward to its pod
// (kubelet and container runtime included): the server, on the other
// network, is listed with no address of its own and cluster-2's gateway.
func (s *scenario) checkZtunnelConfig(t *testing.T) {
	run := func(args ...string) []byte {
		out, err := s.isthmusctl(t, s.c1, append([]string{"ztunnel-config"}, append(args, "--node", s.nodeOf(t, s.c1))...)...)
		require.NoError(t, err, "isthmusctl ztunnel-config %v", args)
		return out
	}
	t.Logf("isthmusctl ztunnel-config workloads:\n%s", run("workloads"))
	var ws []state.Workload
	require.NoError(t, json.Unmarshal(run("workloads", "-o", "json"), &ws))
	gateway := netip.AddrPortFrom(s.c2.NodeIP, meshup.HBONEPort).String()
	require.True(t, slices.ContainsFunc(ws, func(w state.Workload) bool {
		return w.Network == s.c2.Network && len(w.Addresses) == 0 && slices.ContainsFunc(w.Gateways, func(g *state.NetworkGateway) bool {
			return g.Target() == gateway
		})
	}), "a workload of %s without an address, reached through %s, among %d", s.c2.Network, gateway, len(ws))
}
