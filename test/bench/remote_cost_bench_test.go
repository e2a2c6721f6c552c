package bench_test

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

var (
	remoteCounts   = flag.String("remotes", "1,10,30", "BenchmarkEmptyRemoteCost: the numbers of empty remotes to register, one sub-benchmark each")
	remoteProfiles = flag.String("remote-profiles", "", "BenchmarkEmptyRemoteCost: a folder to write heap and goroutine profiles to, before and after registering")
)

// BenchmarkEmptyRemoteCost measures the marginal cost of a registered remote
// cluster that holds nothing (real kube-apiservers with only what an API
// server makes itself: the default namespaces and the kubernetes service).
// One in-process pilot (every component: discovery, the CA's root
// publisher, registry, xDS) runs on cluster-0; each sub-benchmark starts a
// fresh pilot, measures its heap and goroutines once the config cluster has
// synced (the baseline, same run), registers N remotes from Secrets, waits
// for every one to sync, and reports the difference per remote.
//
// The clusters are started once, 1 + the largest N (-remotes), on one etcd.
func BenchmarkEmptyRemoteCost(b *testing.B) {
	var counts []int
	for f := range strings.SplitSeq(*remoteCounts, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		require.NoError(b, err, "-remotes")
		counts = append(counts, n)
	}
	maxN := 0
	for _, n := range counts {
		maxN = max(maxN, n)
	}
	names := make([]string, maxN+1)
	for i := range names {
		names[i] = clusterName(i)
	}
	start := time.Now()
	set, err := framework.Start(framework.Options{Names: names, MaxParallel: 4})
	require.NoError(b, err)
	defer func() { require.NoError(b, set.Stop()) }()
	var rss int64
	for _, pid := range set.ProcessPIDs() {
		if r, err := framework.RSSBytes(pid); err == nil {
			rss += r
		}
	}
	b.Logf("%d clusters started in %v, holding %d MiB RSS (etcd + API servers)", len(names), time.Since(start).Round(time.Millisecond), rss>>20)

	ctx := context.Background()
	kubeconfigs := make([][]byte, maxN+1)
	for i := 1; i <= maxN; i++ {
		c := set.Cluster(clusterName(i))
		kubeconfigs[i], err = c.ReaderKubeconfig(ctx, c.Name, remotesecret.ReaderOptions{})
		require.NoError(b, err)
	}
	for run, n := range counts {
		b.Run(fmt.Sprintf("remotes=%d", n), func(b *testing.B) {
			for range b.N {
				measureRemotes(b, set, kubeconfigs, n, fmt.Sprintf("run%d", run))
			}
		})
	}
}

// measureRemotes runs one pilot in namespace isthmus-system of cluster-0
// (the remotes' reader identities are bound there), registers remotes
// cluster-1..cluster-n and reports heap and goroutines per remote; run
// names the profiles.
func measureRemotes(b *testing.B, set *framework.ClusterSet, kubeconfigs [][]byte, n int, run string) {
	const ns = "isthmus-system"
	ctx := context.Background()
	c0 := set.Cluster(clusterName(0))
	require.NoError(b, c0.EnsureNamespace(ctx, ns, nil))
	p, err := server.New(server.Config{
		Namespace: ns, ClusterID: model.ClusterID(clusterName(0)), Network: "network-0", NoLeaderElection: true,
		DebugAddr: defaults.Disabled, MonitoringAddr: defaults.Disabled, GRPCAddr: defaults.Disabled, Logger: slog.New(slog.DiscardHandler),
	}, c0.Config, nil)
	require.NoError(b, err)
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- p.Run(rctx) }()
	defer func() { cancel(); require.NoError(b, <-done) }()
	require.Eventually(b, p.Ready, time.Minute, 10*time.Millisecond)

	heap0, g0 := settle()
	profile(b, run+"-before")
	b.ResetTimer()
	for i := 1; i <= n; i++ {
		sec := remotesecret.Secret(clusterName(i), ns, kubeconfigs[i])
		sec.Annotations[remotesecret.NetworkAnnotation] = "network-0"
		_, err := c0.Client.CoreV1().Secrets(ns).Create(ctx, sec, metav1.CreateOptions{})
		require.NoError(b, err)
	}
	require.EventuallyWithT(b, func(c *assert.CollectT) {
		synced := 0
		var not []multicluster.Status
		for _, s := range p.Multicluster.Statuses() {
			if s.State == multicluster.StateSynced && s.Pending == nil {
				synced++
			} else {
				not = append(not, s)
			}
		}
		assert.Equal(c, n+1, synced, "not synced: %+v", not)
	}, 5*time.Minute, 50*time.Millisecond)
	b.StopTimer()
	heap1, g1 := settle()
	profile(b, run+"-after")
	b.ReportMetric(float64(int64(heap1)-int64(heap0))/float64(n), "heap-B/remote")
	b.ReportMetric(float64(g1-g0)/float64(n), "goroutines/remote")
	b.Logf("%d remotes: heap %d -> %d B, goroutines %d -> %d", n, heap0, heap1, g0, g1)
	require.NoError(b, c0.Client.CoreV1().Secrets(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{LabelSelector: remotesecret.IstioLabel + "=true"}))
	require.Eventually(b, func() bool { return len(p.Multicluster.Statuses()) == 1 }, time.Minute, 50*time.Millisecond)
}

// settle waits for the process to be quiet (the watches established, the
// first liveness probes answered) and returns its live heap and goroutines.
func settle() (heap uint64, goroutines int) {
	time.Sleep(3 * time.Second)
	var ms runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc, runtime.NumGoroutine()
}

func profile(b *testing.B, name string) {
	if *remoteProfiles == "" {
		return
	}
	require.NoError(b, os.MkdirAll(*remoteProfiles, 0o755))
	for _, p := range []struct{ kind, file string }{{"heap", name + ".heap.pb.gz"}, {"goroutine", name + ".goroutines.txt"}} {
		f, err := os.Create(filepath.Join(*remoteProfiles, p.file))
		require.NoError(b, err)
		debug := 0
		if p.kind == "goroutine" {
			debug = 1
		}
		require.NoError(b, pprof.Lookup(p.kind).WriteTo(f, debug))
		require.NoError(b, f.Close())
	}
}
