package realnode

import (
	"encoding/json"
	"fmt"
	"path/filepath"
)

// containerdConfig is containerd's config (version 3): every folder and
// socket in the node's folder, the sandbox image pinned (never pulled,
// never collected), and the settings this kind of machine needs:
// restrict_oom_score_adj (no CAP_SYS_RESOURCE: runc cannot set the pause
// container's -998), no AppArmor, cgroupfs, pod network namespaces mounted
// under containerd's own state folder (NetnsDir), the CNI binaries and
// config in CNIBinDir and CNIConfDir (the node's own folders bound there),
// NRI off (its socket would be under /var/run/nri).
func (n *Node) containerdConfig() string {
	d := func(p string) string { return filepath.Join(n.cfg.dir, p) }
	return fmt.Sprintf(`version = 3
root = %q
state = %q

[grpc]
  address = %q

[plugins."io.containerd.internal.v1.opt"]
  path = %q

[plugins."io.containerd.nri.v1.nri"]
  disable = true

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = %q

[plugins."io.containerd.cri.v1.runtime"]
  enable_selinux = false
  disable_apparmor = true
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = %q
        Root = %q
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = [%q]
    conf_dir = %q
    max_conf_num = 1
`, d("containerd/root"), d("containerd/state"), n.sock(), d("containerd/opt"), n.cfg.sandboxImage,
		filepath.Join(n.cfg.bin, "runc"), d("runc"), CNIBinDir, CNIConfDir)
}

// cniConfig is the node's CNI network: a bridge that is the pods' gateway
// (no masquerading: pods keep their IPs across the network), host-local addresses from
// the node's PodCIDR kept in the test's folder. containerd adds loopback itself.
func (n *Node) cniConfig() []byte {
	b, _ := json.MarshalIndent(map[string]any{
		"cniVersion": "1.0.0",
		"name":       "realnode",
		"plugins": []any{map[string]any{
			"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
			"ipam": map[string]any{
				"type":    "host-local",
				"ranges":  [][]map[string]string{{{"subnet": n.PodCIDR.String(), "gateway": n.PodCIDR.Addr().Next().String()}}},
				"routes":  []map[string]string{{"dst": "0.0.0.0/0"}},
				"dataDir": filepath.Join(n.cfg.dir, "cni", "ipam"),
			},
		}},
	}, "", "  ")
	return b
}

// kubeletConfig is the kubelet's KubeletConfiguration (JSON is YAML): cgroup
// v1 allowed (failCgroupV1: false; 1.37 refuses to start otherwise), the
// cgroupfs driver under the node's own cgroupRoot, containerd's socket,
// webhook authentication and authorization against the API server, and
// eviction and image GC thresholds that a busy build machine's disk never
// trips.
func (n *Node) kubeletConfig() ([]byte, error) {
	return json.MarshalIndent(map[string]any{
		"apiVersion":               "kubelet.config.k8s.io/v1beta1",
		"kind":                     "KubeletConfiguration",
		"failCgroupV1":             false,
		"cgroupDriver":             "cgroupfs",
		"cgroupRoot":               "/" + n.cgroup,
		"containerRuntimeEndpoint": "unix://" + n.sock(),
		"address":                  n.IP.String(),
		"readOnlyPort":             0,
		"healthzBindAddress":       "127.0.0.1",
		"authentication": map[string]any{
			"anonymous": map[string]any{"enabled": false},
			"webhook":   map[string]any{"enabled": true},
			"x509":      map[string]any{"clientCAFile": n.cfg.caFile},
		},
		"authorization":               map[string]any{"mode": "Webhook"},
		"podLogsDir":                  filepath.Join(n.cfg.dir, "pod-logs"),
		"failSwapOn":                  false,
		"serializeImagePulls":         false,
		"imageGCHighThresholdPercent": 100,
		"imageGCLowThresholdPercent":  99,
		"evictionHard": map[string]string{
			"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%",
			"nodefs.inodesFree": "1%", "imagefs.inodesFree": "1%",
		},
		"clusterDomain":             ClusterDomain,
		"clusterDNS":                n.clusterDNS(),
		"nodeStatusUpdateFrequency": "2s",
		"nodeStatusReportFrequency": "10s",
		"maxPods":                   32,
	}, "", "  ")
}

// clusterDNS is the kubelet's clusterDNS: the cluster DNS Service's IP, if
// any.
func (n *Node) clusterDNS() []string {
	if !n.cfg.clusterDNS.IsValid() {
		return []string{}
	}
	return []string{n.cfg.clusterDNS.String()}
}

// kubeProxyConfig is kube-proxy's KubeProxyConfiguration: nftables mode
// (its tables in the node's network namespace), every Service connection
// masqueraded (a pod reaching itself through its Service gets the reply
// back through the node, with no br_netfilter), and nothing written
// outside the node's namespaces: the conntrack sizes and timeouts, which
// are the host's sysctls, are left alone (zero), the OOM score too (no
// CAP_SYS_RESOURCE), and healthz and metrics listen on the node's
// loopback.
func (n *Node) kubeProxyConfig() ([]byte, error) {
	return json.MarshalIndent(map[string]any{
		"apiVersion":         "kubeproxy.config.k8s.io/v1alpha1",
		"kind":               "KubeProxyConfiguration",
		"clientConnection":   map[string]any{"kubeconfig": n.cfg.kubeconfig},
		"hostnameOverride":   n.Name,
		"bindAddress":        n.IP.String(), // the node's IP, not waited for from its Node
		"mode":               "nftables",
		"nftables":           map[string]any{"masqueradeAll": true, "syncPeriod": "30s", "minSyncPeriod": "0s"},
		"clusterCIDR":        n.cfg.clusterCIDR.String(),
		"detectLocalMode":    "ClusterCIDR",
		"healthzBindAddress": "127.0.0.1:10256",
		"metricsBindAddress": "127.0.0.1:10249",
		"nodePortAddresses":  []string{n.IP.String() + "/32"},
		"oomScoreAdj":        0,
		"conntrack": map[string]any{
			"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s",
			"udpTimeout": "0s", "udpStreamTimeout": "0s",
		},
	}, "", "  ")
}
