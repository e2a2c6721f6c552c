package realnode

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// The node's CNI folders, at the paths a real node has them (the CNI
// chart's cniBinDir and cniConfDir defaults), inside the node's mount
// namespace only: each is a bind mount of a folder of the node's own
// (<node dir>/cni/bin, <node dir>/cni/net.d). containerd uses them.
const (
	CNIBinDir  = "/opt/cni/bin"
	CNIConfDir = "/etc/cni/net.d"
)

// cniPlugins are the reference plugins copied into the node's CNI bin
// folder (the node binary cache is shared: a chart must never write there).
var cniPlugins = []string{"bridge", "host-local", "loopback"}

// NetnsDir is where the node's containerd mounts pod network namespaces
// (netns_mounts_under_state_dir: its CRI plugin's state folder). It is a
// shared mount in the node's namespace, so that a pod mounting it with
// mountPropagation HostToContainer (the CNI agent) sees the namespaces of
// pods created after it; the CNI chart's netnsDir must name it.
func (n *Node) NetnsDir() string {
	return filepath.Join(n.cfg.dir, "containerd", "state", "io.containerd.grpc.v1.cri", "netns")
}

// PodCgroupRoot is the cgroup under which the kubelet (cgroupfs driver,
// cgroupRoot /<node cgroup>) creates pod cgroups: the CNI chart's
// podCgroupRoots entry for this node.
func (n *Node) PodCgroupRoot() string { return "/" + n.cgroup + "/kubepods" }

// CNIDir is the node's own folder that is CNIConfDir (conf) or CNIBinDir
// (bin) inside its mount namespace, as the host sees it.
func (n *Node) CNIDir(which string) string { return filepath.Join(n.cfg.dir, "cni", which) }

// copyCNIPlugins copies the reference plugins from the binary cache into
// the node's CNI bin folder.
func (n *Node) copyCNIPlugins() error {
	for _, p := range cniPlugins {
		if err := copyFile(filepath.Join(n.cfg.bin, p), filepath.Join(n.CNIDir("bin"), p), 0o755); err != nil {
			return fmt.Errorf("copy CNI plugin %s: %w", p, err)
		}
	}
	return nil
}

func copyFile(from, to string, mode os.FileMode) error {
	in, err := os.Open(from)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(to, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// mountHostPaths runs on the launcher's thread inside the node's mount
// namespace. The host has no /etc/cni nor /opt/cni, and creating their
// mount points there would touch the host: /etc and /opt get an overlay
// whose upper layer is in the node's folder (the mounts under them are
// bound again on top), the mount points are made in it, and the node's
// CNI folders are bound onto them. The netns folder becomes a shared mount
// (see NetnsDir).
func (n *Node) mountHostPaths() error {
	for _, top := range []string{"/etc", "/opt"} {
		if err := n.overlay(top); err != nil {
			return err
		}
	}
	for mp, src := range map[string]string{CNIConfDir: n.CNIDir("net.d"), CNIBinDir: n.CNIDir("bin")} {
		if err := os.MkdirAll(mp, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(src, mp, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind %s on %s in the node's mount namespace: %w", src, mp, err)
		}
	}
	dir := n.NetnsDir()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if err := unix.Mount(dir, dir, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind %s on itself: %w", dir, err)
	}
	if err := unix.Mount("", dir, "", unix.MS_SHARED, ""); err != nil {
		return fmt.Errorf("make %s a shared mount: %w", dir, err)
	}
	return nil
}

// overlay mounts an overlay on top (lower: top itself) whose upper layer
// is in the node's folder, then binds again the mounts that were under top
// (they would be hidden by the overlay).
func (n *Node) overlay(top string) error {
	subs, err := submounts(top)
	if err != nil {
		return err
	}
	var fds []int
	defer func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}()
	for _, s := range subs {
		fd, err := unix.Open(s, unix.O_PATH|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open mount %s: %w", s, err)
		}
		fds = append(fds, fd)
	}
	base := filepath.Join(n.cfg.dir, "overlay", strings.TrimPrefix(top, "/"))
	upper, work := filepath.Join(base, "upper"), filepath.Join(base, "work")
	for _, d := range []string{upper, work} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", top, upper, work)
	if err := unix.Mount("overlay", top, "overlay", 0, opts); err != nil {
		return fmt.Errorf("overlay on %s in the node's mount namespace: %w", top, err)
	}
	for i, s := range subs {
		if err := unix.Mount(fmt.Sprintf("/proc/self/fd/%d", fds[i]), s, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("bind %s again over the overlay: %w", s, err)
		}
	}
	return nil
}

// submounts lists the mount points strictly under top, outermost first.
func submounts(top string) ([]string, error) {
	f, err := os.Open("/proc/thread-self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	seen := map[string]bool{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		mp := strings.ReplaceAll(fields[4], `\040`, " ")
		if strings.HasPrefix(mp, top+"/") && !seen[mp] {
			seen[mp] = true
			out = append(out, mp)
		}
	}
	return out, sc.Err()
}

// ImportImages imports a tarball (docker-archive, or a tarred OCI layout
// whose ref.name annotations are full references) into the node's
// containerd, in the kubelet's namespace (k8s.io): pods then use those
// references with pullPolicy IfNotPresent and nothing is pulled.
func (n *Node) ImportImages(tarball string) error {
	t0 := time.Now()
	out, err := exec.Command(filepath.Join(n.cfg.bin, "ctr"), "--address", n.sock(), "-n", "k8s.io",
		"images", "import", "--local", tarball).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ctr images import %s: %w: %s", tarball, err, strings.TrimSpace(string(out)))
	}
	n.cfg.log.Info("images imported into containerd", "tarball", filepath.Base(tarball), "took", time.Since(t0).Round(time.Millisecond))
	return nil
}

// ContainerLog returns the log the kubelet keeps of a container's latest
// run (in the node's folder; the API server cannot reach the kubelet for
// `kubectl logs` yet).
func (n *Node) ContainerLog(namespace, pod, container string) (string, error) {
	logs, err := filepath.Glob(filepath.Join(n.cfg.dir, "pod-logs", namespace+"_"+pod+"_*", container, "*.log"))
	if err != nil || len(logs) == 0 {
		return "", fmt.Errorf("no log of %s/%s container %s on the node", namespace, pod, container)
	}
	latest, latestTime := "", time.Time{}
	for _, l := range logs {
		if st, err := os.Stat(l); err == nil && st.ModTime().After(latestTime) {
			latest, latestTime = l, st.ModTime()
		}
	}
	b, err := os.ReadFile(latest)
	return string(b), err
}
