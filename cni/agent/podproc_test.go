//go:build linux

package agent_test

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
)

// sandboxHolderEnv makes the test binary a pod's process: it waits for its
// stdin to close, and does nothing else.
const sandboxHolderEnv = "ISTHMUS_CNI_TEST_SANDBOX_PROCESS"

func holdSandbox() {
	_, _ = io.Copy(io.Discard, os.Stdin)
	os.Exit(0)
}

// kubepodsCgroup makes the test's own "kubepods" cgroup in a writable
// cgroup2 mount (never the node's real kubepods), removed when the test
// ends: its directory, and its path as /proc/<pid>/cgroup shows it.
func kubepodsCgroup(t *testing.T) (dir, cgPath string) {
	t.Helper()
	mnt, root := cgroup2Mount(t)
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	name := "isthmus-test-" + hex.EncodeToString(b)
	base := filepath.Join(mnt, name)
	require.NoError(t, os.Mkdir(base, 0o755), "create a cgroup under %s (tests run as root)", mnt)
	t.Cleanup(func() { removeCgroupTree(t, base) })
	dir = filepath.Join(base, "kubepods")
	require.NoError(t, os.Mkdir(dir, 0o755))
	return dir, filepath.Join(root, name, "kubepods")
}

// cgroup2Mount finds a writable cgroup2 mount and the cgroup path of its
// root (field 4 of mountinfo).
func cgroup2Mount(t *testing.T) (mnt, root string) {
	t.Helper()
	f, err := os.Open("/proc/self/mountinfo")
	require.NoError(t, err)
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		sep := -1
		for i, fl := range fields {
			if fl == "-" {
				sep = i
				break
			}
		}
		if sep < 0 || sep+1 >= len(fields) || fields[sep+1] != "cgroup2" || len(fields) < 6 {
			continue
		}
		if unix.Access(fields[4], unix.W_OK) == nil && !strings.Contains(","+fields[5]+",", ",ro,") {
			return fields[4], fields[3]
		}
	}
	t.Fatal("no writable cgroup2 mount: the sandbox tests need one (hybrid hosts have it at /sys/fs/cgroup/unified; run as root)")
	return "", ""
}

func removeCgroupTree(t *testing.T, dir string) {
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if e.IsDir() {
			removeCgroupTree(t, filepath.Join(dir, e.Name()))
		}
	}
	// A cgroup goes once its last process is reaped; give it a moment.
	deadline := time.Now().Add(5 * time.Second)
	for {
		err := unix.Rmdir(dir)
		if err == nil || errors.Is(err, unix.ENOENT) {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("remove cgroup %s: %v", dir, err)
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// podProcess starts a process in ns and moves it into the kubelet-style
// cgroup of the pod with uid (<root>/pod<uid>, as the kubelet's cgroupfs
// driver names it), as the runtime does with a pod's processes; it is
// stopped, and the cgroup removed, when the test ends.
func (e *env) podProcess(ns *os.File, uid string) int {
	e.t.Helper()
	cg := filepath.Join(e.cgDir, "pod"+uid)
	if err := os.Mkdir(cg, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		require.NoError(e.t, err)
	}
	cmd := exec.Command(os.Args[0])
	cmd.Env = []string{sandboxHolderEnv + "=1"}
	stdin, err := cmd.StdinPipe()
	require.NoError(e.t, err)
	// The child is forked by a thread inside ns, so it is born there.
	require.NoError(e.t, netns.Do(ns, cmd.Start))
	pid := cmd.Process.Pid
	e.t.Cleanup(func() {
		stdin.Close()
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	require.NoError(e.t, os.WriteFile(filepath.Join(cg, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0o644))
	child, err := netns.Open(filepath.Join("/proc", strconv.Itoa(pid), "ns", "net"))
	require.NoError(e.t, err)
	defer child.Close()
	got, err := netns.IDOf(child)
	require.NoError(e.t, err)
	want, err := netns.IDOf(ns)
	require.NoError(e.t, err)
	require.Equal(e.t, want, got, "the pod's process runs in the pod's namespace")
	return pid
}

// events returns the reasons of the Events on pod.
func (e *env) events(ct assert.TestingT, p *pod) []string {
	list, err := e.c.Client.CoreV1().Events(p.namespace).List(context.Background(), metav1.ListOptions{
		FieldSelector: "involvedObject.uid=" + string(p.obj.UID),
	})
	if !assert.NoError(ct, err) {
		return nil
	}
	var out []string
	for _, ev := range list.Items {
		if ev.Type == corev1.EventTypeWarning && ev.Source.Component == "isthmus-cni" {
			out = append(out, ev.Reason)
		}
	}
	return out
}
