package demo_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"os/exec"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/isthmus-mesh/isthmus/test/demo"
)

// TestDemoTopology runs the make demo topology with the real binaries (as
// processes): the request from sleep in cluster-1 reaches echo, which runs
// only in cluster-2 on network-2, through network-2's east-west gateway.
func TestDemoTopology(t *testing.T) {
	bin := t.TempDir()
	build := exec.Command("go", "build", "-o", bin+"/", "./cmd/pilot", "./cmd/ztunnel", "./cmd/isthmusctl")
	build.Dir = "../.."
	out, err := build.CombinedOutput()
	require.NoError(t, err, string(out))

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var narration strings.Builder
	d, err := demo.Start(ctx, demo.Config{BinDir: bin, Out: &narration})
	require.NoError(t, err, narration.String())
	stopped := false
	defer func() {
		if !stopped {
			d.Stop()
		}
	}()

	rc, err := d.RemoteClusters(ctx)
	require.NoError(t, err, rc)
	require.Regexp(t, `cluster-2\s+synced\s+Synced`, rc)

	before, err := d.Path(ctx)
	require.NoError(t, err)
	var reply string
	require.Eventually(t, func() bool {
		reply, err = d.Request(ctx, "hello")
		return err == nil
	}, time.Minute, 200*time.Millisecond, "last error: %v", err)
	require.Equal(t, `echo-0 (cluster-2, network-2, 127.20.0.10) got "hello"`, reply[:strings.Index(reply, " from ")])
	after, err := d.Path(ctx)
	require.NoError(t, err)
	require.Greater(t, after.Gateway, before.Gateway, "the network-2 gateway carried the connection")
	require.Greater(t, after.ClientZtunnel, before.ClientZtunnel)
	require.Greater(t, after.ServerZtunnel, before.ServerZtunnel)

	t.Run("pilot outage", func(t *testing.T) {
		// An open connection and new ones keep working from the last state.
		conn, err := d.Dial(ctx)
		require.NoError(t, err)
		defer conn.Close()
		_, err = demo.Exchange(conn, "before")
		require.NoError(t, err)
		d.StopPilot()
		got, err := demo.Exchange(conn, "during")
		require.NoError(t, err)
		require.Contains(t, got, `got "during"`)
		got, err = d.Request(ctx, "new connection during the outage")
		require.NoError(t, err)
		require.Contains(t, got, "echo-0 (cluster-2")
		// Pilot back: the ztunnels resync and see changes again (checked by
		// the failover below, which needs a new endpoint to arrive).
		require.NoError(t, d.StartPilot(ctx))
	})
	t.Run("prefer same network, fail over through the gateway", func(t *testing.T) {
		require.NoError(t, d.AddLocalEcho(ctx))
		require.Eventually(t, func() bool {
			got, err := d.Request(ctx, "local?")
			return err == nil && strings.HasPrefix(got, "echo-local (cluster-1")
		}, time.Minute, 100*time.Millisecond, "the same-network endpoint is preferred once known")
		for range 5 {
			got, err := d.Request(ctx, "still local?")
			require.NoError(t, err)
			require.True(t, strings.HasPrefix(got, "echo-local (cluster-1"), got)
		}
		gw, err := d.Path(ctx)
		require.NoError(t, err)
		start := time.Now()
		require.NoError(t, d.SetLocalEchoReady(ctx, false))
		require.Eventually(t, func() bool {
			got, err := d.Request(ctx, "failover?")
			return err == nil && strings.HasPrefix(got, "echo-0 (cluster-2")
		}, 10*time.Second, 20*time.Millisecond)
		t.Logf("failover to the remote network took %v after the pod went unready", time.Since(start).Round(time.Millisecond))
		after, err := d.Path(ctx)
		require.NoError(t, err)
		require.Greater(t, after.GatewayBytes, gw.GatewayBytes, "failover traffic crossed the gateway")
	})

	t.Run("a tenant posing as network-2's gateway", func(t *testing.T) {
		// A tenant of cluster-2 labels a Service of its own namespace as
		// network-2's gateway and points it at an address it listens on.
		lure, err := net.Listen("tcp", "127.20.255.66:15008")
		require.NoError(t, err)
		defer lure.Close()
		var lured atomic.Int64
		go func() {
			for {
				c, err := lure.Accept()
				if err != nil {
					return
				}
				lured.Add(1)
				c.Close()
			}
		}()
		c2 := d.Cluster("cluster-2")
		require.NoError(t, c2.EnsureNamespace(ctx, "aaa-tenant", nil))
		svc, err := c2.Client.CoreV1().Services("aaa-tenant").Create(ctx, &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: "eastwest", Namespace: "aaa-tenant", Labels: map[string]string{"topology.istio.io/network": "network-2"}},
			Spec: corev1.ServiceSpec{Type: corev1.ServiceTypeLoadBalancer, Selector: map[string]string{"app": "eastwest-gateway"},
				Ports: []corev1.ServicePort{{Name: "tls-hbone", Port: 15008, TargetPort: intstr.FromInt32(15008)}}},
		}, metav1.CreateOptions{})
		require.NoError(t, err)
		svc.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{{IP: "127.20.255.66"}}
		_, err = c2.Client.CoreV1().Services("aaa-tenant").UpdateStatus(ctx, svc, metav1.UpdateOptions{})
		require.NoError(t, err)
		require.Eventually(t, func() bool {
			resp, err := http.Get(demo.PilotURL(15014) + "/metrics")
			if err != nil {
				return false
			}
			defer resp.Body.Close()
			body, _ := io.ReadAll(resp.Body)
			return strings.Contains(string(body), `isthmus_gateway_candidates{cluster="cluster-2",status="untrusted_namespace"} 1`)
		}, time.Minute, 100*time.Millisecond, "pilot reports the ignored candidate")
		require.NoError(t, d.SetLocalEchoReady(ctx, false)) // no local echo: every request crosses networks
		for range 5 {
			got, err := d.Request(ctx, "through the real gateway")
			require.NoError(t, err)
			require.True(t, strings.HasPrefix(got, "echo-0 (cluster-2"), got)
		}
		require.Zero(t, lured.Load(), "no ztunnel ever dialled the tenant's address")
	})

	d.Stop()
	stopped = true
	ps, _ := exec.Command("pgrep", "-f", bin).Output()
	require.Empty(t, strings.TrimSpace(string(ps)), "demo processes left behind")
}
