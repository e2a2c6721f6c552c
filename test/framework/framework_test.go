package framework

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
)

// TestThreeClusters starts three real clusters at once, writes objects into
// each (a Pod with its status IP among them), reads them back through the
// reader kubeconfig a remote secret would hold, and checks that Stop leaves
// no process and no file behind.
func TestThreeClusters(t *testing.T) {
	start := time.Now()
	set, err := Start(Options{})
	require.NoError(t, err)
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			_ = set.Stop()
		}
	})
	startTime := time.Since(start)
	pids := set.ProcessPIDs()
	require.Len(t, pids, 4, "one etcd and three kube-apiservers")
	var rss int64
	for _, p := range pids {
		b, err := RSSBytes(p)
		require.NoError(t, err)
		rss += b
	}
	t.Logf("3 clusters started in %v; RSS of etcd + 3 apiservers: %d MiB", startTime.Round(10*time.Millisecond), rss>>20)

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	errs := make([]error, len(set.Clusters))
	for i, c := range set.Clusters {
		wg.Go(func() { errs[i] = writeAndReadBack(ctx, c, i) })
	}
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, set.Clusters[i].Name)
	}

	root := set.root
	require.NoError(t, set.Stop())
	stopped = true
	require.Empty(t, PIDsWithArg(root), "processes left behind")
	_, err = os.Stat(root)
	require.True(t, os.IsNotExist(err), "cluster folder left behind")
}

func writeAndReadBack(ctx context.Context, c *Cluster, i int) error {
	ip := netip.AddrFrom4([4]byte{127, 1, byte(i + 1), 10})
	if err := c.EnsureNamespace(ctx, "demo", nil); err != nil {
		return err
	}
	if _, err := c.CreateService(ctx, "demo", "echo", map[string]string{"app": "echo"}, ServicePort{Name: "tcp", Port: 80, TargetPort: 8080}); err != nil {
		return err
	}
	if _, err := c.CreatePod(ctx, PodOptions{Namespace: "demo", Name: "echo-0", Labels: map[string]string{"app": "echo"}, IP: ip, Ready: true, Node: "node-0"}); err != nil {
		return err
	}
	kc, err := c.ReaderKubeconfig(ctx, c.Name, remotesecret.ReaderOptions{})
	if err != nil {
		return err
	}
	cfg, err := clientcmd.RESTConfigFromKubeConfig(kc)
	if err != nil {
		return err
	}
	reader, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	pod, err := reader.CoreV1().Pods("demo").Get(ctx, "echo-0", metav1.GetOptions{})
	if err != nil {
		return err
	}
	if pod.Status.PodIP != ip.String() {
		return fmt.Errorf("pod IP read back %q, want %s", pod.Status.PodIP, ip)
	}
	svc, err := reader.CoreV1().Services("demo").Get(ctx, "echo", metav1.GetOptions{})
	if err != nil {
		return err
	}
	if svc.Spec.Ports[0].Port != 80 {
		return fmt.Errorf("service port read back %d, want 80", svc.Spec.Ports[0].Port)
	}
	// The reader may read but not write.
	if err := reader.CoreV1().Pods("demo").Delete(ctx, "echo-0", metav1.DeleteOptions{}); !apierrors.IsForbidden(err) {
		return fmt.Errorf("reader deleting a pod: got %v, want forbidden", err)
	}
	return nil
}

// TestSweepOrphans shows that processes of a cluster set whose owner died
// are killed by the next Start's sweep, and live owners' sets are left alone.
func TestSweepOrphans(t *testing.T) {
	base := t.TempDir()
	dead := exec.Command("true")
	require.NoError(t, dead.Run())
	deadDir := filepath.Join(base, strconv.Itoa(dead.Process.Pid)+"-x")
	liveDir := filepath.Join(base, strconv.Itoa(os.Getpid())+"-y")
	for _, d := range []string{deadDir, liveDir} {
		require.NoError(t, os.MkdirAll(d, 0o700))
	}
	// Like envtest's processes: own process group, folder on the command line.
	spawn := func(dir string) *exec.Cmd {
		cmd := exec.Command("sh", "-c", "sleep 300; true", dir)
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		require.NoError(t, cmd.Start())
		return cmd
	}
	orphan := spawn(deadDir)
	keep := spawn(liveDir)
	t.Cleanup(func() { _ = syscall.Kill(-keep.Process.Pid, syscall.SIGKILL); _ = keep.Wait() })

	// Wait until both children have exec'd (their command lines name the folders).
	require.Eventually(t, func() bool { return len(PIDsWithArg(deadDir)) == 1 && len(PIDsWithArg(liveDir)) == 1 }, 5*time.Second, 5*time.Millisecond, "%v %v", PIDsWithArg(deadDir), PIDsWithArg(liveDir))
	SweepOrphans(base)
	state, err := orphan.Process.Wait()
	require.NoError(t, err)
	require.False(t, state.Success(), "orphan was killed")
	_, err = os.Stat(deadDir)
	require.True(t, os.IsNotExist(err))
	_, err = os.Stat(liveDir)
	require.NoError(t, err)
	require.NotEmpty(t, PIDsWithArg(liveDir), "a live owner's process is kept")
}

// TestSweepOrphansByLock shows that a set's lock, not its owner's pid,
// decides when the set has one: an owner in a PID namespace of its own is
// pid 1 (always "alive" here), yet its folder is swept once its lock is
// free, and kept while it is held.
func TestSweepOrphansByLock(t *testing.T) {
	base := t.TempDir()
	held, freed := filepath.Join(base, "1-held"), filepath.Join(base, "1-freed")
	for _, d := range []string{held, freed} {
		require.NoError(t, os.MkdirAll(d, 0o700))
	}
	lock, err := lockRoot(held)
	require.NoError(t, err)
	defer lock.Close()
	gone, err := lockRoot(freed)
	require.NoError(t, err)
	require.NoError(t, gone.Close()) // as when its owner died
	SweepOrphans(base)
	_, err = os.Stat(freed)
	require.True(t, os.IsNotExist(err), "a folder whose lock is free is swept")
	_, err = os.Stat(held)
	require.NoError(t, err, "a folder whose lock is held is kept")
}
