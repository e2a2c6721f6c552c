//go:build linux

package demo

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/cni/plugin"
	"github.com/isthmus-mesh/isthmus/internal/nettopo"
	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
)

// The demo plays the container runtime of each node: it makes a pod's
// sandbox (a network namespace bind-mounted under the node's netns folder,
// a veth on the node's bridge, the pod's address and default route), which
// is what the network plugin of the node's conflist would do, then runs the
// plugins after it — the isthmus-cni binary the node's agent installed —
// with CNI_COMMAND=ADD and the previous result, exactly as a runtime does.

// conflist is the node's network configuration before the agent appends
// its plugin: the "bridge" entry stands for what the demo does itself.
const conflist = `{"cniVersion": "1.0.0", "name": "demo-net", "plugins": [{"type": "bridge", "bridge": "cni0"}]}`

// sandbox is one pod's network namespace.
type sandbox struct {
	spec podSpec
	path string // the bind mount: CNI_NETNS
	ns   *os.File
	uid  string
}

// veth is the node's end of the pod's veth pair.
func (sb *sandbox) veth() string { return "v-" + sb.spec.name }

func (sb *sandbox) remove() error {
	sb.ns.Close()
	return nettopo.Unmount(sb.path)
}

// startAgent writes the node's conflist, runs the CNI agent inside the
// node's namespace (as a hostNetwork DaemonSet runs) with a kubeconfig that
// reaches the API server through a forwarder there, and waits until it is
// ready (the plugin is installed).
func (n *isolated) startAgent(ctx context.Context, s *site) error {
	d := n.d
	bin, conf, nsDir := n.nodeDir(s, "cni", "bin"), n.nodeDir(s, "cni", "net.d"), n.nodeDir(s, "netns")
	for _, dir := range []string{bin, conf, nsDir} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
	}
	if err := os.WriteFile(filepath.Join(conf, "10-demo.conflist"), []byte(conflist), 0o644); err != nil {
		return err
	}
	c := d.Cluster(s.cluster)
	if err := n.forwardIn(ctx, s.node, "127.0.0.1:6443", hostPort(c.Host())); err != nil {
		return err
	}
	kc := n.nodeDir(s, "agent.kubeconfig")
	if err := writeKubeconfig(c, "https://127.0.0.1:6443", "localhost", kc); err != nil {
		return err
	}
	name := "cni-agent-" + s.node
	args := []string{"agent", "--node", s.node, "--kubeconfig", kc,
		"--system-namespace", ns, "--cni-bin-dir", bin, "--cni-conf-dir", conf, "--plugin-source", d.bin("isthmus-cni"),
		"--plugin-socket", n.nodeDir(s, "plugin.sock"), "--ztunnel-socket", n.nodeDir(s, "ztunnel.sock"),
		"--netns-dir", nsDir, "--proc-dir", "none", "--state-dir", n.nodeDir(s, "cni-state"), "--node-addresses", s.nodeIP.String() + "," + s.bridge().Addr().String(),
		"--redirect-dns", "--monitoring-addr", "127.0.0.1:15014", "--log-format", "text"}
	if d.cfg.AgentArgs != nil {
		args = d.cfg.AgentArgs(args)
	}
	if err := d.procs.spawn(d, name, n.get(s.node), "isthmus-cni", args...); err != nil {
		return err
	}
	if err := waitHTTP(ctx, n.httpIn(s.node), "http://127.0.0.1:15014/readyz", time.Minute); err != nil {
		return fmt.Errorf("CNI agent of %s not ready: %w (log: %s)", s.node, err, d.logOf(name))
	}
	return nil
}

// addPod creates the Pod object (pending, as the scheduler leaves it),
// makes its sandbox, runs the CNI ADD, reports it running with its address
// (as the kubelet does) and starts its application in the sandbox.
func (n *isolated) addPod(ctx context.Context, c *framework.Cluster, p podSpec) error {
	pod, err := c.Client.CoreV1().Pods(appNS).Create(ctx, framework.Pod(podOptions(p)), metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("create pod %s: %w", p.name, err)
	}
	sb, err := n.newSandbox(p)
	if err != nil {
		return err
	}
	sb.uid = string(pod.UID)
	if err := n.cni(ctx, plugin.CommandAdd, sb); err != nil {
		return err
	}
	if _, err := c.SetPodStatus(ctx, pod, p.ip, true); err != nil {
		return err
	}
	if p.app != "echo" {
		return nil
	}
	ln, err := netns.Listen(ctx, sb.ns, "tcp", "0.0.0.0:8080", nil)
	if err != nil {
		return fmt.Errorf("%s's application: %w", p.name, err)
	}
	n.d.apps.serveEcho(p.name, ln, p.who())
	return nil
}

// newSandbox makes the pod's namespace, bind-mounted in the node's netns
// folder, on the node's bridge.
func (n *isolated) newSandbox(p podSpec) (*sandbox, error) {
	s := p.site
	sb := &sandbox{spec: p, path: n.nodeDir(s, "netns", "cni-"+p.name)}
	f, err := n.newNS(p.name, sb.path)
	if err != nil {
		return nil, err
	}
	sb.ns = f
	n.mu.Lock()
	n.sandboxes[p.name] = sb
	n.mu.Unlock()
	node := n.get(s.node)
	if err := nettopo.Veth(node, sb.veth(), netip.Prefix{}, f, "eth0", netip.PrefixFrom(p.ip, 24)); err != nil {
		return nil, err
	}
	if err := nettopo.Attach(node, sb.veth(), "cni0"); err != nil {
		return nil, err
	}
	if err := nettopo.Route(f, pfx("0.0.0.0/0"), s.bridge().Addr()); err != nil {
		return nil, err
	}
	return sb, nil
}

// cni runs the plugin the agent installed, as the runtime does after the
// network plugin: its conflist entry on stdin with the previous result.
func (n *isolated) cni(ctx context.Context, command string, sb *sandbox) error {
	s := sb.spec.site
	conf, err := pluginConf(n.nodeDir(s, "cni", "net.d", "10-demo.conflist"), sb, s.bridge().Addr())
	if err != nil {
		return err
	}
	bin := n.nodeDir(s, "cni", "bin")
	cmd := exec.CommandContext(ctx, filepath.Join(bin, plugin.Name))
	cmd.Env = []string{
		"CNI_COMMAND=" + command, "CNI_CONTAINERID=ctr-" + sb.spec.name, "CNI_NETNS=" + sb.path,
		"CNI_IFNAME=eth0", "CNI_PATH=" + bin,
		fmt.Sprintf("CNI_ARGS=IgnoreUnknown=1;K8S_POD_NAMESPACE=%s;K8S_POD_NAME=%s;K8S_POD_INFRA_CONTAINER_ID=ctr-%s;K8S_POD_UID=%s",
			appNS, sb.spec.name, sb.spec.name, sb.uid),
	}
	cmd.Stdin = bytes.NewReader(conf)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if out, err := cmd.Output(); err != nil {
		return fmt.Errorf("CNI %s of %s: %w: %s %s", command, sb.spec.name, err, strings.TrimSpace(string(out)), strings.TrimSpace(stderr.String()))
	}
	return nil
}

// pluginConf is what the runtime hands the plugin: its entry from the
// conflist (with the list's name and version) and the previous plugin's
// result (the pod's interface and address).
func pluginConf(conflistPath string, sb *sandbox, gw netip.Addr) ([]byte, error) {
	b, err := os.ReadFile(conflistPath)
	if err != nil {
		return nil, err
	}
	var list struct {
		CNIVersion string           `json:"cniVersion"`
		Name       string           `json:"name"`
		Plugins    []map[string]any `json:"plugins"`
	}
	if err := json.Unmarshal(b, &list); err != nil {
		return nil, fmt.Errorf("%s: %w", conflistPath, err)
	}
	if len(list.Plugins) == 0 || list.Plugins[len(list.Plugins)-1]["type"] != plugin.Name {
		return nil, fmt.Errorf("%s: the agent has not installed %s last in the chain", conflistPath, plugin.Name)
	}
	entry := list.Plugins[len(list.Plugins)-1]
	entry["cniVersion"], entry["name"] = list.CNIVersion, list.Name
	entry["prevResult"] = map[string]any{
		"cniVersion": list.CNIVersion,
		"interfaces": []any{map[string]any{"name": "eth0", "sandbox": sb.path}},
		"ips":        []any{map[string]any{"address": netip.PrefixFrom(sb.spec.ip, 24).String(), "gateway": gw.String(), "interface": 0}},
	}
	return json.Marshal(entry)
}

// releasePods runs the CNI DEL of every live pod (as the runtime does when
// a pod stops), so the agents release them before they stop.
func (n *isolated) releasePods() {
	n.mu.Lock()
	sbs := make([]*sandbox, 0, len(n.sandboxes))
	for _, sb := range n.sandboxes {
		sbs = append(sbs, sb)
	}
	n.mu.Unlock()
	for _, sb := range sbs {
		if sb.uid == "" {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		if err := n.cni(ctx, plugin.CommandDel, sb); err != nil {
			n.d.say("cleanup: %v", err)
		}
		cancel()
	}
}

// lose makes the pod's sandbox vanish the way a crashed node's does, with
// no CNI DEL and nothing told to the API server: its veth (and so its
// address on the node's bridge) is deleted, its application stopped, its
// bind mount removed.
func (n *isolated) lose(name string) error {
	n.mu.Lock()
	sb := n.sandboxes[name]
	delete(n.sandboxes, name)
	delete(n.ns, name)
	n.mu.Unlock()
	if sb == nil {
		return fmt.Errorf("no pod %s", name)
	}
	err := nettopo.DeleteLink(n.get(sb.spec.site.node), sb.veth())
	n.d.apps.close(name)
	return errors.Join(err, sb.remove())
}
