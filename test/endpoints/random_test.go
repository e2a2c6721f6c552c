package endpoints_test

import (
	"context"
	"flag"
	"fmt"
	"maps"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// Flags of the randomized run; `make soak` raises them.
var (
	firstSeed = flag.Uint64("endpoints.seed", 1, "first seed of TestRandomizedConsistency (replay a failure with its seed)")
	numSeeds  = flag.Int("endpoints.seeds", 1, "number of seeds TestRandomizedConsistency runs, from -endpoints.seed")
	numSteps  = flag.Int("endpoints.changes", 3000, "random changes per seed")
)

// TestRandomizedConsistency drives three clusters through random changes
// (pods appear, disappear, turn ready or not, change labels, terminate,
// are deleted and created again under the same name and address and flip
// their readiness right after; EndpointSlices with and without targetRefs,
// naming pods that exist, that do not, or that are created right after;
// Services deleted and recreated; a node's locality; a remote API server
// stopped and restarted; pilot cut off from a remote while it changes,
// whose API server restarts meanwhile so that pilot lists it again; pilot
// restarted), then, once the changes stop, requires pilot's registry, an
// EDS client and a workload client to hold exactly what the clusters'
// objects say, endpoint by endpoint and address by address (the workload
// served, its health and identity), and to still hold it after a quiet
// period. Each seed's addresses are drawn from a small pool, so pods and
// slice addresses of both namespaces and all clusters collide often.
func TestRandomizedConsistency(t *testing.T) {
	cp := "isthmus-random"
	cut := registerRemoteVia(t, cp, cutRemote)
	ctx := context.Background()
	kc, err := clusters.Cluster("cluster-2").ReaderKubeconfig(ctx, "cluster-2", remotesecret.ReaderOptions{Namespace: cp})
	require.NoError(t, err)
	sec := remotesecret.Secret("cluster-2", cp, kc)
	sec.Annotations[remotesecret.NetworkAnnotation] = network
	_, err = clusters.Cluster("cluster-1").Client.CoreV1().Secrets(cp).Create(ctx, sec, metav1.CreateOptions{})
	require.NoError(t, err)
	for seed := *firstSeed; seed < *firstSeed+uint64(*numSeeds); seed++ {
		ok := t.Run(fmt.Sprint("seed-", seed), func(t *testing.T) { randomRun(t, cp, cut, seed, *numSteps) })
		if !ok {
			t.Logf("replay: go test -race ./test/endpoints -run 'TestRandomizedConsistency' -endpoints.seed=%d -endpoints.changes=%d", seed, *numSteps)
		}
	}
}

// sim is one seed's run: what it created, and the random source.
type sim struct {
	t          *testing.T
	rng        *rand.Rand
	ctx        context.Context
	seed       uint64
	namespaces []string
	down       map[string]bool // remotes whose API server is stopped
	cut        *cutter         // between pilot and cutRemote
	isCut      bool
}

// cutRemote is the remote pilot reaches through a cutter.
const cutRemote = "cluster-3"

const (
	podNames, sliceNames, nodeCount = 12, 8, 3
	poolSize                        = 24 // addresses shared by pods and slice addresses
)

func randomRun(t *testing.T, cp string, cut *cutter, seed uint64, steps int) {
	s := &sim{t: t, rng: rand.New(rand.NewPCG(seed, 22)), ctx: context.Background(), seed: seed, down: map[string]bool{}, cut: cut,
		namespaces: []string{fmt.Sprintf("r%d-a", seed), fmt.Sprintf("r%d-b", seed)}}
	for _, c := range clusters.Clusters {
		for _, ns := range s.namespaces {
			require.NoError(t, c.EnsureNamespace(s.ctx, ns, nil))
		}
		for i := range nodeCount {
			s.putNode(c, i)
		}
	}
	t.Cleanup(s.cleanup)
	p := startPilot(t, cp)
	stopAt, restartAt, pilotAt := steps/4+s.rng.IntN(steps/4), steps/2+s.rng.IntN(steps/4), s.rng.IntN(steps)
	remote := clusterIDs[1+s.rng.IntN(2)]
	// Pilot is cut off from cutRemote for a tenth of the run (its API
	// server is restarted before pilot reconnects, so its watches cannot
	// resume and list again), once in the first half and once in the
	// second.
	cutAt := []int{s.rng.IntN(steps / 4), steps/2 + s.rng.IntN(steps/4)}
	start := time.Now()
	for step := range steps {
		switch step {
		case stopAt:
			require.NoError(t, clusters.Cluster(remote).StopAPIServer())
			s.down[remote] = true
		case restartAt:
			require.NoError(t, clusters.Cluster(remote).RestartAPIServer())
			delete(s.down, remote)
		case pilotAt:
			require.NoError(t, p.stop())
			p = startPilot(t, cp, s.unsynced()...)
		}
		for _, at := range cutAt {
			switch step {
			case at:
				s.setCut(true)
			case at + max(steps/10, 1):
				s.setCut(false)
			}
		}
		s.step()
	}
	s.setCut(false)
	changed := time.Since(start)
	w, err := expect(s.ctx, s.namespaces)
	require.NoError(t, err)
	settle := time.Now()
	require.EventuallyWithT(t, func(c *assert.CollectT) { p.compare(c, w, s.namespaces) }, 2*time.Minute, 100*time.Millisecond,
		"seed %d: pilot does not settle on the clusters' state", seed)
	settled := time.Since(settle)
	// Nothing drifts away once settled: after a quiet period pilot still
	// serves exactly the clusters' state.
	time.Sleep(quietPeriod)
	require.EventuallyWithT(t, func(c *assert.CollectT) { p.compare(c, w, s.namespaces) }, time.Second, 100*time.Millisecond,
		"seed %d: pilot drifts from the clusters' state after a quiet period", seed)
	n, bound := 0, 0
	for _, byCluster := range w.raw {
		for _, eps := range byCluster {
			n += len(eps)
			for _, e := range eps {
				if !e.pod && !strings.HasSuffix(e.Identity, "/default") {
					bound++
				}
			}
		}
	}
	t.Logf("seed %d: %d changes in %v; settled within %v: %d services, %d endpoints (%d slice addresses bound to pods), %d addresses owned, losing claims %v",
		seed, steps, changed.Round(time.Millisecond), settled.Round(100*time.Millisecond), len(w.endpoints), n, bound, len(w.owners), p.Registry.ConflictCounts())
}

// quietPeriod is how long the final state must hold once pilot settled.
const quietPeriod = 3 * time.Second

// unsynced returns the remotes a restarted pilot cannot sync: those whose
// API server is stopped or that it is cut off from.
func (s *sim) unsynced() []string {
	out := slices.Collect(maps.Keys(s.down))
	if s.isCut {
		out = append(out, cutRemote)
	}
	return out
}

// setCut cuts pilot off from cutRemote, or reconnects it: its API server
// is restarted first (unless stopped anyway), so that pilot's watches
// cannot resume from their versions and list again.
func (s *sim) setCut(cut bool) {
	if s.isCut == cut {
		return
	}
	if !cut && !s.down[cutRemote] {
		c := clusters.Cluster(cutRemote)
		require.NoError(s.t, c.StopAPIServer())
		require.NoError(s.t, c.RestartAPIServer())
	}
	s.cut.setCut(cut)
	s.isCut = cut
}

// step makes one random change in a cluster whose API server runs.
func (s *sim) step() {
	var live []*framework.Cluster
	for _, c := range clusters.Clusters {
		if !s.down[c.Name] {
			live = append(live, c)
		}
	}
	c := live[s.rng.IntN(len(live))]
	ns := s.namespaces[s.rng.IntN(len(s.namespaces))]
	switch op := s.rng.IntN(100); {
	case op < 18:
		s.putPod(c, ns)
	case op < 27:
		s.replacePod(c, ns)
	case op < 38:
		s.setReady(c, ns)
	case op < 45:
		s.relabel(c, ns)
	case op < 52:
		s.deletePod(c, ns, 0)
	case op < 55:
		s.deletePod(c, ns, 30) // terminating: no kubelet ever finishes it
	case op < 73:
		s.putSlice(c, ns)
	case op < 78:
		s.sliceBeforePod(c, ns)
	case op < 83:
		s.deleteSlice(c, ns)
	case op < 91:
		s.toggleService(c, ns)
	default:
		s.putNode(c, s.rng.IntN(nodeCount))
	}
}

// addr draws an address of the seed's pool.
func (s *sim) addr() netip.Addr {
	return netip.AddrFrom4([4]byte{10, byte(100 + s.seed%100), 0, byte(1 + s.rng.IntN(poolSize))})
}

func (s *sim) podName() string { return fmt.Sprint("p", s.rng.IntN(podNames)) }

// ignore tolerates the errors a random change may meet: a missing object,
// one that exists already, or a conflicting write.
func (s *sim) ignore(err error) {
	s.t.Helper()
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsAlreadyExists(err) && !apierrors.IsConflict(err) {
		require.NoError(s.t, err)
	}
}

func (s *sim) labels() map[string]string {
	if i := s.rng.IntN(4); i < 3 {
		return map[string]string{"app": fmt.Sprint("s", i)}
	}
	return nil
}

// putPod (re)creates a pod: a new account, node and readiness; a new
// address, or half the time the one it had (as a StatefulSet's pod).
func (s *sim) putPod(c *framework.Cluster, ns string) {
	name := s.podName()
	ip := s.addr()
	if old := s.podIP(c, ns, name); old.IsValid() && s.rng.IntN(2) == 0 {
		ip = old
	}
	s.ignore(c.Client.CoreV1().Pods(ns).Delete(s.ctx, name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}))
	opts := framework.PodOptions{Namespace: ns, Name: name, Labels: s.labels(), ServiceAccount: fmt.Sprint("sa", s.rng.IntN(2)),
		Node: fmt.Sprint("node-", s.rng.IntN(nodeCount)), IP: ip, Ready: s.rng.IntN(3) > 0}
	if s.rng.IntN(10) == 0 {
		opts.HostNetwork = true
		opts.IP = netip.AddrFrom4([4]byte{10, byte(100 + s.seed%100), 1, byte(1 + s.rng.IntN(nodeCount))})
	}
	_, err := c.CreatePod(s.ctx, opts)
	s.ignore(err)
}

// replacePod deletes a pod and creates it again under the same name and
// address (a new UID), half the time with the same account and node, then
// at once flips its readiness (as a restarted StatefulSet pod whose probe
// fails).
func (s *sim) replacePod(c *framework.Cluster, ns string) {
	name := s.podName()
	pod, err := c.Client.CoreV1().Pods(ns).Get(s.ctx, name, metav1.GetOptions{})
	if err != nil || pod.Status.PodIP == "" {
		s.ignore(err)
		return
	}
	ip := netip.MustParseAddr(pod.Status.PodIP)
	opts := framework.PodOptions{Namespace: ns, Name: name, Labels: pod.Labels, ServiceAccount: pod.Spec.ServiceAccountName,
		Node: pod.Spec.NodeName, IP: ip, Ready: s.rng.IntN(2) == 0, HostNetwork: pod.Spec.HostNetwork}
	if s.rng.IntN(2) == 0 {
		opts.ServiceAccount, opts.Node = fmt.Sprint("sa", s.rng.IntN(2)), fmt.Sprint("node-", s.rng.IntN(nodeCount))
	}
	s.ignore(c.Client.CoreV1().Pods(ns).Delete(s.ctx, name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}))
	created, err := c.CreatePod(s.ctx, opts)
	if err != nil {
		s.ignore(err)
		return
	}
	_, err = c.SetPodStatus(s.ctx, created, netip.Addr{}, !opts.Ready)
	s.ignore(err)
}

// sliceBeforePod writes a slice naming, at a pool address, a pod that does
// not exist yet, then creates that pod at that address.
func (s *sim) sliceBeforePod(c *framework.Cluster, ns string) {
	name := s.podName()
	if s.podIP(c, ns, name).IsValid() {
		return
	}
	ip := s.addr()
	s.writeSlice(c, ns, fmt.Sprint("sl", s.rng.IntN(sliceNames)), fmt.Sprint("s", 3+s.rng.IntN(3)), discoveryv1.Endpoint{
		Addresses: []string{ip.String()}, TargetRef: &corev1.ObjectReference{Kind: "Pod", Name: name},
		Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(s.rng.IntN(3) > 0)}, NodeName: ptr.To(fmt.Sprint("node-", s.rng.IntN(nodeCount))),
	})
	_, err := c.CreatePod(s.ctx, framework.PodOptions{Namespace: ns, Name: name, Labels: s.labels(), ServiceAccount: fmt.Sprint("sa", s.rng.IntN(2)),
		Node: fmt.Sprint("node-", s.rng.IntN(nodeCount)), IP: ip, Ready: s.rng.IntN(3) > 0})
	s.ignore(err)
}

// podIP returns the address of pod ns/name in c (invalid: none).
func (s *sim) podIP(c *framework.Cluster, ns, name string) netip.Addr {
	pod, err := c.Client.CoreV1().Pods(ns).Get(s.ctx, name, metav1.GetOptions{})
	if err != nil {
		s.ignore(err)
		return netip.Addr{}
	}
	a, _ := netip.ParseAddr(pod.Status.PodIP)
	return a
}

func (s *sim) setReady(c *framework.Cluster, ns string) {
	pod, err := c.Client.CoreV1().Pods(ns).Get(s.ctx, s.podName(), metav1.GetOptions{})
	if err != nil {
		s.ignore(err)
		return
	}
	_, err = c.SetPodStatus(s.ctx, pod, netip.Addr{}, s.rng.IntN(2) == 0)
	s.ignore(err)
}

func (s *sim) relabel(c *framework.Cluster, ns string) {
	pod, err := c.Client.CoreV1().Pods(ns).Get(s.ctx, s.podName(), metav1.GetOptions{})
	if err != nil {
		s.ignore(err)
		return
	}
	pod.Labels = s.labels()
	_, err = c.Client.CoreV1().Pods(ns).Update(s.ctx, pod, metav1.UpdateOptions{})
	s.ignore(err)
}

func (s *sim) deletePod(c *framework.Cluster, ns string, grace int64) {
	s.ignore(c.Client.CoreV1().Pods(ns).Delete(s.ctx, s.podName(), metav1.DeleteOptions{GracePeriodSeconds: &grace}))
}

// putSlice writes a slice of a selector-less service (s3..s5) with one to
// four addresses: random conditions and nodes, half naming a pod by
// targetRef (some in the other namespace, which must be ignored).
func (s *sim) putSlice(c *framework.Cluster, ns string) {
	name, svc := fmt.Sprint("sl", s.rng.IntN(sliceNames)), fmt.Sprint("s", 3+s.rng.IntN(3))
	var eps []discoveryv1.Endpoint
	maybe := func() *bool {
		if s.rng.IntN(4) == 0 {
			return nil
		}
		return ptr.To(s.rng.IntN(3) > 0)
	}
	for range 1 + s.rng.IntN(4) {
		ep := discoveryv1.Endpoint{Addresses: []string{s.addr().String()},
			Conditions: discoveryv1.EndpointConditions{Ready: maybe(), Serving: maybe()}}
		if s.rng.IntN(2) == 0 {
			// Name a pod, mostly at the address it has (if it exists here).
			pod := s.podName()
			ep.TargetRef = &corev1.ObjectReference{Kind: "Pod", Name: pod}
			if ip := s.podIP(c, ns, pod); ip.IsValid() && s.rng.IntN(3) > 0 {
				ep.Addresses = []string{ip.String()}
			}
			if s.rng.IntN(5) == 0 {
				ep.TargetRef.Namespace = s.namespaces[0]
			}
		}
		if s.rng.IntN(6) == 0 {
			ep.Conditions.Terminating = ptr.To(true)
		}
		if s.rng.IntN(4) > 0 {
			ep.NodeName = ptr.To(fmt.Sprint("node-", s.rng.IntN(nodeCount)))
		}
		eps = append(eps, ep)
	}
	s.writeSlice(c, ns, name, svc, eps...)
}

// writeSlice creates or replaces slice ns/name of service svc with eps.
func (s *sim) writeSlice(c *framework.Cluster, ns, name, svc string, eps ...discoveryv1.Endpoint) {
	es := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{discoveryv1.LabelServiceName: svc}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: ptr.To("http"), Port: ptr.To(int32(8080 + s.rng.IntN(2))), Protocol: ptr.To(corev1.ProtocolTCP)}},
		Endpoints:   eps,
	}
	cur, err := c.Client.DiscoveryV1().EndpointSlices(ns).Get(s.ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		_, err = c.Client.DiscoveryV1().EndpointSlices(ns).Create(s.ctx, es, metav1.CreateOptions{})
	case err == nil:
		es.ResourceVersion = cur.ResourceVersion
		_, err = c.Client.DiscoveryV1().EndpointSlices(ns).Update(s.ctx, es, metav1.UpdateOptions{})
	}
	s.ignore(err)
}

func (s *sim) deleteSlice(c *framework.Cluster, ns string) {
	s.ignore(c.Client.DiscoveryV1().EndpointSlices(ns).Delete(s.ctx, fmt.Sprint("sl", s.rng.IntN(sliceNames)), metav1.DeleteOptions{}))
}

// toggleService deletes service sN if it exists, else creates it: s0..s2
// select app=sN, s3..s5 have no selector.
func (s *sim) toggleService(c *framework.Cluster, ns string) {
	i := s.rng.IntN(6)
	name := fmt.Sprint("s", i)
	err := c.Client.CoreV1().Services(ns).Delete(s.ctx, name, metav1.DeleteOptions{})
	if !apierrors.IsNotFound(err) {
		s.ignore(err)
		return
	}
	var selector map[string]string
	if i < 3 {
		selector = map[string]string{"app": name}
	}
	_, err = c.CreateService(s.ctx, ns, name, selector, framework.ServicePort{Name: "http", Port: 80, TargetPort: 8080})
	s.ignore(err)
}

// putNode creates node-i, or gives it another zone.
func (s *sim) putNode(c *framework.Cluster, i int) {
	name := fmt.Sprint("node-", i)
	labels := map[string]string{corev1.LabelTopologyRegion: fmt.Sprint("region-", i%2), corev1.LabelTopologyZone: fmt.Sprint("zone-", s.rng.IntN(3))}
	n, err := c.Client.CoreV1().Nodes().Get(s.ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		_, err = c.CreateNode(s.ctx, name, labels)
		s.ignore(err)
		return
	}
	s.ignore(err)
	if err == nil {
		n.Labels = labels
		_, err = c.Client.CoreV1().Nodes().Update(s.ctx, n, metav1.UpdateOptions{})
		s.ignore(err)
	}
}

// cleanup restarts a stopped API server and deletes what the seed made, so
// later seeds and tests start from clean clusters.
func (s *sim) cleanup() {
	s.cut.setCut(false)
	for name := range s.down {
		if err := clusters.Cluster(name).RestartAPIServer(); err != nil {
			s.t.Errorf("restart %s: %v", name, err)
		}
	}
	zero := metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}
	for _, c := range clusters.Clusters {
		require.EventuallyWithT(s.t, func(ct *assert.CollectT) {
			for _, ns := range s.namespaces {
				require.NoError(ct, c.Client.CoreV1().Pods(ns).DeleteCollection(s.ctx, zero, metav1.ListOptions{}))
				require.NoError(ct, c.Client.DiscoveryV1().EndpointSlices(ns).DeleteCollection(s.ctx, metav1.DeleteOptions{}, metav1.ListOptions{}))
				svcs, err := c.Client.CoreV1().Services(ns).List(s.ctx, metav1.ListOptions{})
				require.NoError(ct, err)
				for _, svc := range svcs.Items {
					err := c.Client.CoreV1().Services(ns).Delete(s.ctx, svc.Name, metav1.DeleteOptions{})
					require.True(ct, err == nil || apierrors.IsNotFound(err), "delete service: %v", err)
				}
			}
		}, time.Minute, 100*time.Millisecond)
	}
}
