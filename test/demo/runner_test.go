//go:build linux

package demo_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/isthmus-mesh/isthmus/test/demo"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// TestUnavailableIsOneLine: when neither root nor user namespaces allow the
// isolated demo, it says so in one line that offers --loopback.
func TestUnavailableIsOneLine(t *testing.T) {
	msg := demo.Unavailable(fmt.Errorf("fork/exec /bin/isthmus-demo:\noperation not permitted"))
	require.NotContains(t, msg, "\n")
	require.Contains(t, msg, "--loopback")
	require.Contains(t, msg, "operation not permitted")
}

// TestRunnerKilledLeavesNothing runs `isthmus-demo` as `make demo` does (as
// root: it re-executes itself in a mount and PID namespace of its own),
// kills it with SIGKILL once the reply is printed, and checks that no
// process of its PID namespace, no mount namespace of it and none of the
// network namespaces it made survive; its run folder goes with the next
// sweep.
func TestRunnerKilledLeavesNothing(t *testing.T) {
	bin := binDir(t)
	work := t.TempDir()
	cmd := exec.Command(filepath.Join(bin, "isthmus-demo"), "--bin", bin, "--workdir", work)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	killed := false
	defer func() {
		if !killed {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	}()
	printed := waitForLine(t, stdout, "==> reply reached", 5*time.Minute)
	require.True(t, printed, "the runner printed no reply; stderr: %s", stderr.String())
	go func() { _, _ = io.Copy(io.Discard, stdout) }()

	inner := childOf(t, cmd.Process.Pid)
	pidNS, mntNS := nsOf(inner, "pid"), nsOf(inner, "mnt")
	require.NotEqual(t, nsOf(os.Getpid(), "pid"), pidNS, "the runner has a PID namespace of its own")
	require.Greater(t, len(processesIn("pid", pidNS)), 8, "apiservers, etcd, pilot, agents, ztunnels run in it")
	ri, err := demo.ReadRunInfo(work)
	require.NoError(t, err)
	require.Len(t, ri.Netns, 11, "wan, two routers, nodes, node ztunnels and gateways, and the pods echo-0 and sleep-0")
	require.Empty(t, demo.MountsUnder(ri.Run), "its bind mounts are in its own mount namespace, not the host's")

	require.NoError(t, syscall.Kill(cmd.Process.Pid, syscall.SIGKILL))
	_ = cmd.Wait()
	killed = true
	require.Eventually(t, func() bool {
		return len(processesIn("pid", pidNS)) == 0 && len(processesIn("mnt", mntNS)) == 0 && len(demo.NetnsInUse(ri.Netns)) == 0
	}, time.Minute, 50*time.Millisecond, "left behind: processes %v, in its mount namespace %v, namespaces %v",
		processesIn("pid", pidNS), processesIn("mnt", mntNS), demo.NetnsInUse(ri.Netns))
	demo.SweepDeadRuns(filepath.Dir(ri.Run))
	require.NoDirExists(t, ri.Run)
	framework.SweepOrphans(filepath.Join(os.TempDir(), "isthmus-testclusters"))
}

// TestRootless runs `isthmus-demo` as an unprivileged user (nobody). Where
// the kernel allows unprivileged user namespaces (checked here on our own:
// a clone with CLONE_NEWUSER|CLONE_NEWNET as nobody, and AppArmor's
// restriction), the reply must arrive through network-2's gateway, pilot
// and the API servers must answer on the host's loopback, and after Ctrl-C
// nothing must be left behind; where it does not, the runner must say so in
// one line and offer --loopback.
func TestRootless(t *testing.T) {
	const nobody = 65534
	bin := binDir(t)
	home, err := os.MkdirTemp("", "rootless-") // short: the agents' socket paths live under it
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(home) })
	require.NoError(t, os.Chmod(home, 0o755))
	require.NotEmpty(t, os.Getenv("KUBEBUILDER_ASSETS"), "set KUBEBUILDER_ASSETS (make testbin prints the folder)")
	assets := filepath.Join(home, "assets")
	require.NoError(t, os.Mkdir(assets, 0o755))
	for _, b := range []string{"kube-apiserver", "etcd"} {
		linkOrCopy(t, filepath.Join(os.Getenv("KUBEBUILDER_ASSETS"), b), filepath.Join(assets, b))
	}
	tmp, work := filepath.Join(home, "tmp"), filepath.Join(home, "work")
	for _, d := range []string{tmp, work} {
		require.NoError(t, os.Mkdir(d, 0o700))
		require.NoError(t, os.Chown(d, nobody, nobody))
	}
	cmd := exec.Command(filepath.Join(bin, "isthmus-demo"), "--bin", bin, "--workdir", work)
	cmd.Env = []string{"PATH=/usr/bin:/bin", "HOME=" + tmp, "TMPDIR=" + tmp, "KUBEBUILDER_ASSETS=" + assets}
	cmd.Dir = tmp
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}, Pdeathsig: syscall.SIGKILL}
	var out lockedBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	require.NoError(t, cmd.Start())
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	defer func() {
		_ = cmd.Process.Kill()
		<-done
		dumpLogsOnFailure(t, work)
	}()

	if cause := usernsForbidden(bin, nobody); cause != nil {
		t.Logf("unprivileged user namespaces are not allowed here (%v): the runner must say so", cause)
		select {
		case err := <-done:
			done <- err
			require.Error(t, err)
		case <-time.After(2 * time.Minute):
			t.Fatalf("the runner did not give up: %s", out.String())
		}
		lines := strings.Split(strings.TrimSpace(out.String()), "\n")
		require.Len(t, lines, 1, "one line: %s", out.String())
		require.Contains(t, lines[0], "--loopback")
		return
	}
	t.Log("unprivileged user namespaces are allowed here: the isolated demo runs as nobody")
	require.Eventually(t, func() bool { return strings.Contains(out.String(), "==> reply reached") }, 5*time.Minute, 100*time.Millisecond,
		"no reply: %s", out.String())
	require.Contains(t, out.String(), "reply: echo-0 (cluster-2, network-2, 10.2.1.10)")
	require.Regexp(t, `-> east-west gateway network-2 \(\+[1-9]`, out.String())

	// Pilot and the API servers live in the runner's own namespace; the
	// host's loopback reaches them through the listeners passed down.
	resp, err := http.Get(demo.PilotURL(15014) + "/readyz")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	rc, err := clientcmd.BuildConfigFromFlags("", filepath.Join(work, "cluster-2.kubeconfig"))
	require.NoError(t, err)
	client, err := kubernetes.NewForConfig(rc)
	require.NoError(t, err)
	_, err = client.CoreV1().Pods("demo").Get(context.Background(), "echo-0", metav1.GetOptions{})
	require.NoError(t, err, "cluster-2's API server from the host")

	// Ctrl-C: everything stops and goes.
	require.NoError(t, cmd.Process.Signal(syscall.SIGINT))
	select {
	case err := <-done:
		done <- err
		require.NoError(t, err, out.String())
	case <-time.After(2 * time.Minute):
		t.Fatalf("the runner did not stop on SIGINT: %s", out.String())
	}
	require.Contains(t, out.String(), "==> stopping everything")
	ri, err := demo.ReadRunInfo(work)
	require.NoError(t, err)
	require.NoDirExists(t, ri.Run)
	require.Empty(t, demo.NetnsInUse(ri.Netns))
}

// lockedBuffer is a bytes.Buffer safe for a writing process and a reading
// test.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// usernsForbidden reports why uid may not make user namespaces with
// network namespaces (nil if it may), found without the demo's code: the
// test binary runs itself as uid (probeUserns in TestMain), and that
// process starts the demo binary with --help in new user, network and
// mount namespaces. AppArmor's switch lets such a clone succeed but takes
// every capability away, so it is read too.
func usernsForbidden(bin string, uid uint32) error {
	if b, err := os.ReadFile("/proc/sys/kernel/apparmor_restrict_unprivileged_userns"); err == nil && strings.TrimSpace(string(b)) == "1" {
		return errors.New("kernel.apparmor_restrict_unprivileged_userns=1")
	}
	probe := exec.Command("/proc/self/exe", "-test.run=^$")
	probe.Env = []string{probeEnv + "=" + filepath.Join(bin, "isthmus-demo")}
	probe.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
	if out, err := probe.CombinedOutput(); err != nil {
		return fmt.Errorf("%w: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

// probeEnv names the program probeUserns starts.
const probeEnv = "ISTHMUS_DEMO_USERNS_PROBE"

// probeUserns starts program with --help in new user, network and mount
// namespaces, mapping the caller's uid and gid to root, and exits 0 if the
// kernel allowed it.
func probeUserns(program string) {
	cmd := exec.Command(program, "--help")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWUSER | syscall.CLONE_NEWNET | syscall.CLONE_NEWNS,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getuid(), Size: 1}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getgid(), Size: 1}}}
	if err := cmd.Start(); err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	_ = cmd.Wait()
	os.Exit(0)
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

func linkOrCopy(t *testing.T, src, dst string) {
	t.Helper()
	if os.Link(src, dst) == nil {
		return
	}
	in, err := os.Open(src)
	require.NoError(t, err)
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY, 0o755)
	require.NoError(t, err)
	_, err = io.Copy(out, in)
	require.NoError(t, err)
	require.NoError(t, out.Close())
}

// waitForLine reads r until a line starts with prefix or timeout passes.
func waitForLine(t *testing.T, r io.Reader, prefix string, timeout time.Duration) bool {
	t.Helper()
	found := make(chan bool, 1)
	go func() {
		sc := bufio.NewScanner(r)
		for sc.Scan() {
			if strings.HasPrefix(sc.Text(), prefix) {
				found <- true
				return
			}
		}
		found <- false
	}()
	select {
	case ok := <-found:
		return ok
	case <-time.After(timeout):
		return false
	}
}

// childOf returns the (only) child process of pid.
func childOf(t *testing.T, pid int) int {
	t.Helper()
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	require.NoError(t, err)
	for _, task := range tasks {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/children", pid, task.Name()))
		if f := strings.Fields(string(b)); len(f) > 0 {
			child, err := strconv.Atoi(f[0])
			require.NoError(t, err)
			return child
		}
	}
	t.Fatalf("process %d has no child", pid)
	return 0
}

// nsOf returns the namespace of kind ("pid", "mnt", "net") of process pid.
func nsOf(pid int, kind string) string {
	l, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/%s", pid, kind))
	return l
}

// processesIn lists the processes whose namespace of kind is ns.
func processesIn(kind, ns string) []int {
	procs, _ := os.ReadDir("/proc")
	var out []int
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err == nil && nsOf(pid, kind) == ns {
			out = append(out, pid)
		}
	}
	return out
}
