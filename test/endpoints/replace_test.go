package endpoints_test

import (
	"context"
	"io"
	"net"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// cutter is a TCP proxy on loopback between pilot and one cluster's API
// server that can cut pilot off (every connection closed, new ones
// refused) while the test keeps writing to the API server directly: the
// watches pilot had miss what happens meanwhile, as across a network
// partition.
type cutter struct {
	ln     net.Listener
	target string

	mu    sync.Mutex
	cut   bool
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup
}

func newCutter(t testing.TB, target string) *cutter {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &cutter{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	p.wg.Go(p.serve)
	t.Cleanup(p.close)
	return p
}

func (p *cutter) addr() string { return p.ln.Addr().String() }

func (p *cutter) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		if p.cut {
			p.mu.Unlock()
			_ = c.Close()
			continue
		}
		p.conns[c] = struct{}{}
		p.mu.Unlock()
		p.wg.Go(func() { p.pipe(c) })
	}
}

func (p *cutter) pipe(c net.Conn) {
	defer p.forget(c)
	up, err := net.DialTimeout("tcp", p.target, 5*time.Second)
	if err != nil {
		return
	}
	p.mu.Lock()
	if p.cut {
		p.mu.Unlock()
		_ = up.Close()
		return
	}
	p.conns[up] = struct{}{}
	p.mu.Unlock()
	defer p.forget(up)
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(up, c); done <- struct{}{} }()
	go func() { _, _ = io.Copy(c, up); done <- struct{}{} }()
	<-done
	_ = c.Close()
	_ = up.Close()
	<-done
}

func (p *cutter) forget(c net.Conn) {
	_ = c.Close()
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
}

// setCut cuts pilot off (true) or lets it reconnect (false).
func (p *cutter) setCut(cut bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = cut
	if cut {
		for c := range p.conns {
			_ = c.Close()
		}
	}
}

func (p *cutter) close() {
	_ = p.ln.Close()
	p.setCut(true)
	p.wg.Wait()
}

// registerRemoteVia creates control-plane namespace cp in cluster-1 and
// the remote secret of cluster id, whose API server pilot reaches through
// a cutter (returned).
func registerRemoteVia(t testing.TB, cp, id string) *cutter {
	t.Helper()
	ctx := context.Background()
	c1, c := clusters.Cluster("cluster-1"), clusters.Cluster(id)
	require.NoError(t, c1.EnsureNamespace(ctx, cp, nil))
	u, err := url.Parse(c.Host())
	require.NoError(t, err)
	cut := newCutter(t, u.Host)
	token, err := remotesecret.EnsureReader(ctx, c.Client, remotesecret.ReaderOptions{Namespace: cp, TokenWait: time.Millisecond})
	require.NoError(t, err)
	kc, err := remotesecret.Kubeconfig(id, "https://"+cut.addr(), c.CAData(), token)
	require.NoError(t, err)
	sec := remotesecret.Secret(id, cp, kc)
	sec.Annotations[remotesecret.NetworkAnnotation] = network
	_, err = c1.Client.CoreV1().Secrets(cp).Create(ctx, sec, metav1.CreateOptions{})
	require.NoError(t, err)
	return cut
}

// rotateRemote gives the remote secret of cluster id (reached through
// cut) a new token: pilot starts a new generation of the cluster, which
// lists everything afresh and replaces the old one once synced.
func rotateRemote(t testing.TB, cp, id string, cut *cutter) {
	t.Helper()
	ctx := context.Background()
	c := clusters.Cluster(id)
	token, err := remotesecret.EnsureReader(ctx, c.Client, remotesecret.ReaderOptions{Namespace: cp, TokenWait: time.Millisecond})
	require.NoError(t, err)
	kc, err := remotesecret.Kubeconfig(id, "https://"+cut.addr(), c.CAData(), token)
	require.NoError(t, err)
	secrets := clusters.Cluster("cluster-1").Client.CoreV1().Secrets(cp)
	sec, err := secrets.Get(ctx, remotesecret.Secret(id, cp, nil).Name, metav1.GetOptions{})
	require.NoError(t, err)
	sec.Data[id] = kc
	_, err = secrets.Update(ctx, sec, metav1.UpdateOptions{})
	require.NoError(t, err)
}

// replace deletes pod db-0 and creates it again under the same name and
// address (a new UID), with service account sa on node, ready; then, at
// once, it turns not ready.
func (f *dbFixture) replace(t *testing.T, sa, node string) {
	t.Helper()
	f.deletePod(t)
	f.pod(t, sa, node, true)
	f.setPodReady(t, false)
}

func (f *dbFixture) deletePod(t *testing.T) {
	t.Helper()
	require.NoError(t, f.c.Client.CoreV1().Pods(f.ns).Delete(context.Background(), "db-0", metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}))
}

func (f *dbFixture) deleteSlice(t *testing.T) {
	t.Helper()
	err := f.c.Client.DiscoveryV1().EndpointSlices(f.ns).Delete(context.Background(), "db-1", metav1.DeleteOptions{})
	require.NoError(t, err)
}

// expectServed waits until the workload served for the fixture's address
// is uid with status (HEALTHY or UNHEALTHY) and identity ns/sa.
func (f *dbFixture) expectServed(t *testing.T, p *pilot, uid, status, sa string) {
	t.Helper()
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		require.Equal(c, []string{uid}, p.workloadsAt(c, f.addr), "the workload served for %s", f.addr)
		w := p.workloads(c)[uid]
		require.NotNil(c, w)
		assert.Equal(c, status, w.GetStatus().String(), "its status")
		assert.Equal(c, sa, w.GetServiceAccount(), "its identity")
	}, time.Minute, 20*time.Millisecond)
}

// TestSliceAddressFollowsReplacedPod (#39): a selector-less Service's slice
// names pod db-0 by targetRef; db-0 is deleted and created again under the
// same name and address (a new UID, another account and node) and turns
// not ready right after. Whatever the order of the slice's and the pod's
// events, across a watch restart in which pilot missed them, and across a
// new generation of the cluster (its token rotated), the address is the
// new pod's: its workload is the one served (with the pod's readiness),
// the slice address has the pod's identity and placement, and EDS keeps
// the slice's readiness (the documented rule).
func TestSliceAddressFollowsReplacedPod(t *testing.T) {
	const cp = "isthmus-replaced"
	cut := registerRemoteVia(t, cp, "cluster-2")
	ctx := context.Background()
	c3 := clusters.Cluster("cluster-3")
	kc, err := c3.ReaderKubeconfig(ctx, "cluster-3", remotesecret.ReaderOptions{Namespace: cp})
	require.NoError(t, err)
	sec := remotesecret.Secret("cluster-3", cp, kc)
	sec.Annotations[remotesecret.NetworkAnnotation] = network
	_, err = clusters.Cluster("cluster-1").Client.CoreV1().Secrets(cp).Create(ctx, sec, metav1.CreateOptions{})
	require.NoError(t, err)
	p := startPilot(t, cp)
	c2 := clusters.Cluster("cluster-2")

	bound := func(f *dbFixture, sa, node, region string, sliceReady, podReady bool) want {
		return want{ready: sliceReady, identity: f.ns + "/" + sa, node: node, locality: region + "//", podReady: ptr.To(podReady)}
	}
	pod := func(f *dbFixture) string { return model.WorkloadUID(model.ClusterID(f.c.Name), f.ns, "db-0") }
	cases := []struct {
		name string
		// run replaces the pod (and perhaps rewrites the slice) after
		// the pod (db, node-a, ready) and the slice (ready) are bound.
		run func(t *testing.T, f *dbFixture)
	}{
		{"slice unchanged", func(t *testing.T, f *dbFixture) {
			f.replace(t, "db-v2", "node-c")
		}},
		{"slice unchanged, each step seen", func(t *testing.T, f *dbFixture) {
			f.deletePod(t)
			f.expectEndpoint(t, p, want{ready: true, identity: f.ns + "/default", node: "node-b", locality: "region-b//"})
			f.pod(t, "db-v2", "node-c", true)
			f.expectEndpoint(t, p, bound(f, "db-v2", "node-c", "region-c", true, true))
			f.setPodReady(t, false)
		}},
		{"slice rewritten while the pod is gone", func(t *testing.T, f *dbFixture) {
			f.deletePod(t)
			f.slice(t, false)
			f.slice(t, true)
			f.pod(t, "db-v2", "node-c", true)
			f.setPodReady(t, false)
		}},
		{"slice rewritten after the new pod", func(t *testing.T, f *dbFixture) {
			f.replace(t, "db-v2", "node-c")
			f.slice(t, false)
			f.slice(t, true)
		}},
		{"slice re-created after the new pod", func(t *testing.T, f *dbFixture) {
			f.deletePod(t)
			f.deleteSlice(t)
			f.pod(t, "db-v2", "node-c", true)
			f.setPodReady(t, false)
			f.slice(t, true)
		}},
		{"pilot cut off", func(t *testing.T, f *dbFixture) {
			cut.setCut(true)
			f.replace(t, "db-v2", "node-c")
			cut.setCut(false)
		}},
		{"pilot cut off, slice re-created", func(t *testing.T, f *dbFixture) {
			cut.setCut(true)
			f.deletePod(t)
			f.deleteSlice(t)
			f.pod(t, "db-v2", "node-c", true)
			f.slice(t, true)
			f.setPodReady(t, false)
			cut.setCut(false)
		}},
		{"pilot cut off, API server restarted", func(t *testing.T, f *dbFixture) {
			// The restarted API server's watch cache starts at the
			// current version: pilot's watches cannot resume and list
			// again (a relist of every kind).
			cut.setCut(true)
			f.replace(t, "db-v2", "node-c")
			require.NoError(t, f.c.StopAPIServer())
			require.NoError(t, f.c.RestartAPIServer())
			cut.setCut(false)
		}},
		{"pilot cut off, token rotated", func(t *testing.T, f *dbFixture) {
			// The new generation's state replaces the old one's, which
			// still has the first pod.
			before, ok := p.Multicluster.Status("cluster-2")
			require.True(t, ok)
			cut.setCut(true)
			f.replace(t, "db-v2", "node-c")
			rotateRemote(t, cp, "cluster-2", cut)
			cut.setCut(false)
			require.EventuallyWithT(t, func(c *assert.CollectT) {
				st, _ := p.Multicluster.Status("cluster-2")
				assert.Greater(c, st.Generation, before.Generation, "a new generation")
				assert.Equal(c, multicluster.StateSynced, st.State)
			}, time.Minute, 20*time.Millisecond)
		}},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newDB(t, c2, "replaced-"+string(rune('a'+i)), "10.96.0."+itoa(uint32(i+1)))
			f.pod(t, "db", "node-a", true)
			f.slice(t, true)
			f.expectEndpoint(t, p, bound(f, "db", "node-a", "region-a", true, true))
			f.expectServed(t, p, pod(f), "HEALTHY", "db")

			tc.run(t, f)
			f.expectEndpoint(t, p, bound(f, "db-v2", "node-c", "region-c", true, false))
			f.expectServed(t, p, pod(f), "UNHEALTHY", "db-v2")
		})
	}

	// A slice naming a pod that does not exist yet: the pod, created
	// later, takes the address, and its readiness flip right after.
	t.Run("pod created after the slice", func(t *testing.T) {
		f := newDB(t, c2, "replaced-later", "10.96.0.99")
		f.slice(t, true)
		f.expectEndpoint(t, p, want{ready: true, identity: f.ns + "/default", node: "node-b", locality: "region-b//"})
		f.pod(t, "db-v2", "node-c", true)
		f.setPodReady(t, false)
		f.expectEndpoint(t, p, bound(f, "db-v2", "node-c", "region-c", true, false))
		f.expectServed(t, p, pod(f), "UNHEALTHY", "db-v2")
	})
}
