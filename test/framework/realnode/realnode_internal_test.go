package realnode

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestCheckNamesWhatIsMissing: with no binaries, Start's check names each
// missing one and the make target that builds it, instead of skipping.
func TestCheckNamesWhatIsMissing(t *testing.T) {
	err := SetOptions{NodeBinDir: t.TempDir()}.check()
	require.Error(t, err)
	for _, b := range append(nodeBinaries, "coredns") {
		require.ErrorContains(t, err, b+" missing in")
	}
	require.NotContains(t, SetOptions{NodeBinDir: t.TempDir(), NoClusterDNS: true}.check().Error(), "coredns")
	require.ErrorContains(t, err, "run make nodebin")
	require.ErrorContains(t, err, "set KUBEBUILDER_ASSETS")

	err = SetOptions{}.check()
	require.ErrorContains(t, err, "set ISTHMUS_NODEBIN")
}

// TestSweepOrphans: the folder and cgroups of an environment whose test
// process died are removed by the next Start's sweep, with the processes
// left in its cgroups; a live owner's are kept.
func TestSweepOrphans(t *testing.T) {
	requireRoot(t)
	dead := exec.Command("true")
	require.NoError(t, dead.Run())
	for _, c := range []struct {
		owner  int
		swept  bool
		reason string
	}{
		{dead.Process.Pid, true, "owner gone, lock free"},
		{os.Getpid(), false, "owner alive"},
	} {
		t.Run(c.reason, func(t *testing.T) {
			dir, err := os.MkdirTemp("", fmt.Sprintf("%s%d-", dirPrefix, c.owner))
			require.NoError(t, err)
			t.Cleanup(func() { _ = removeCgroups(filepath.Base(dir)); _ = os.RemoveAll(dir) })
			require.NoError(t, createCgroups(filepath.Base(dir)))
			// A container the dead node left behind.
			sleeper := exec.Command("sleep", "600")
			require.NoError(t, sleeper.Start())
			exited := make(chan struct{})
			go func() { _ = sleeper.Wait(); close(exited) }()
			t.Cleanup(func() { _ = sleeper.Process.Kill(); <-exited })
			mounts, err := cgroupMounts()
			require.NoError(t, err)
			pids := filepath.Join(mounts[0], filepath.Base(dir), "cgroup.procs")
			require.NoError(t, os.WriteFile(pids, []byte(strconv.Itoa(sleeper.Process.Pid)), 0o644))

			sweepOrphans()

			_, err = os.Stat(dir)
			if !c.swept {
				require.NoError(t, err, "a live owner's folder was swept")
				require.NotEmpty(t, cgroupDirs(filepath.Base(dir)))
				return
			}
			require.ErrorIs(t, err, os.ErrNotExist)
			require.Empty(t, cgroupDirs(filepath.Base(dir)))
			require.EventuallyWithT(t, func(c *assert.CollectT) {
				select {
				case <-exited:
				default:
					c.Errorf("the orphan's process still runs")
				}
			}, 10*time.Second, 10*time.Millisecond)
		})
	}
}

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("this test needs root (cgroups): run the tests as root")
	}
}

// TestSetOptionsValidate: bad cluster lists are refused with the reason,
// before anything starts; defaults name the nodes and networks.
func TestSetOptionsValidate(t *testing.T) {
	for _, c := range []struct {
		name     string
		clusters []ClusterSpec
		want     string
	}{
		{"none", nil, "no clusters"},
		{"cluster twice", []ClusterSpec{{Name: "c1"}, {Name: "c1"}}, `"c1" used twice`},
		{"node named like a cluster", []ClusterSpec{{Name: "c1", NodeNames: []string{"c2"}}, {Name: "c2"}}, `"c2" used twice`},
		{"not a DNS label", []ClusterSpec{{Name: "C_1"}}, `name "C_1"`},
		{"negative nodes", []ClusterSpec{{Name: "c1", Nodes: -1}}, "-1 nodes"},
		{"full network", []ClusterSpec{{Name: "c1", Network: "n", Nodes: 60}, {Name: "c2", Network: "n", Nodes: 40}}, "network n: 100 nodes, at most 99"},
	} {
		t.Run(c.name, func(t *testing.T) {
			o, err := SetOptions{Clusters: c.clusters, ModuleDir: "/nonexistent"}.withDefaults()
			require.NoError(t, err)
			require.ErrorContains(t, o.validate(), c.want)
		})
	}
	o, err := SetOptions{Clusters: []ClusterSpec{{Name: "c1", Nodes: 2}, {Name: "c2", NodeNames: []string{"x"}}}, ModuleDir: "/nonexistent"}.withDefaults()
	require.NoError(t, err)
	require.NoError(t, o.validate())
	require.Equal(t, []string{"c1-node-1", "c1-node-2"}, o.Clusters[0].NodeNames)
	require.Equal(t, "c1-network", o.Clusters[0].Network)
	require.Equal(t, 1, o.Clusters[1].Nodes)
}
