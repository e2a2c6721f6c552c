package agent

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestPodUIDOfCgroups: a process belongs to the pod whose kubelet cgroup
// its path lies in, in the kubelet's layouts only; a cgroup a tenant makes
// inside its own pod's cgroup, named after another pod, is still the
// tenant's.
func TestPodUIDOfCgroups(t *testing.T) {
	const uid = "8f3c5b2e-1d4a-4c6b-9e7f-0a1b2c3d4e5f"
	const uid2 = "11111111-2222-4333-8444-555555555555"
	roots := []string{"/kubepods", "/kubepods.slice"}
	for _, tc := range []struct {
		name, data string
		want       string
	}{
		{"v2 cgroupfs guaranteed", "0::/kubepods/pod" + uid + "/cri-abc\n", uid},
		{"v2 cgroupfs burstable", "0::/kubepods/burstable/pod" + uid + "/abc\n", uid},
		{"v2 cgroupfs besteffort, process in the pod cgroup itself", "0::/kubepods/besteffort/pod" + uid + "\n", uid},
		{"v2 systemd guaranteed", "0::/kubepods.slice/kubepods-pod8f3c5b2e_1d4a_4c6b_9e7f_0a1b2c3d4e5f.slice/cri-containerd-abc.scope\n", uid},
		{"v2 systemd burstable", "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod8f3c5b2e_1d4a_4c6b_9e7f_0a1b2c3d4e5f.slice/cri-containerd-abc.scope\n", uid},
		{"v1 hybrid lines", "12:memory:/kubepods/burstable/pod" + uid + "/abc\n11:cpu,cpuacct:/kubepods/burstable/pod" + uid + "/abc\n1:name=systemd:/kubepods/burstable/pod" + uid + "/abc\n0::/\n", uid},
		{"seen from a cgroup namespace of the agent's own", "0::/../../kubepods-besteffort-pod8f3c5b2e_1d4a_4c6b_9e7f_0a1b2c3d4e5f.slice/cri-containerd-abc.scope\n", uid},
		{"seen from a cgroup namespace, cgroupfs with QoS", "0::/../../../besteffort/pod" + uid + "/abc\n", uid},
		{"not a pod", "0::/system.slice/containerd.service\n", ""},
		{"the root only", "0::/kubepods\n", ""},
		{"outside the roots", "0::/tenant/kubepods/pod" + uid + "/abc\n", ""},
		{"a tenant's nested cgroup named after another pod", "0::/kubepods/burstable/pod" + uid2 + "/abc/pod" + uid + "\n", uid2},
		{"a tenant's nested systemd slice named after another pod", "0::/kubepods.slice/kubepods-pod11111111_2222_4333_8444_555555555555.slice/x/kubepods-pod8f3c5b2e_1d4a_4c6b_9e7f_0a1b2c3d4e5f.slice\n", uid2},
		{"a QoS cgroup that is not the kubelet's", "0::/kubepods/custom/pod" + uid + "/abc\n", ""},
		{"systemd slice under the wrong QoS", "0::/kubepods.slice/kubepods-burstable.slice/kubepods-besteffort-pod8f3c5b2e_1d4a_4c6b_9e7f_0a1b2c3d4e5f.slice/x\n", ""},
		{"lines naming two pods", "4:memory:/kubepods/pod" + uid + "/a\n0::/kubepods/pod" + uid2 + "/b\n", ""},
		{"not a UID", "0::/kubepods/pod../etc\n", ""},
		{"upper case", "0::/kubepods/podABCDEF12-3456\n", ""},
		{"relative path", "0::kubepods/pod" + uid + "\n", ""},
		{"garbage", "\x00\n::\n:::\n0::/..\n0::/../..\n", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, podUIDOfCgroups([]byte(tc.data), roots))
		})
	}
	require.Equal(t, uid, podUIDOfCgroups([]byte("0::/isthmus-test-1/kubepods/pod"+uid+"\n"), []string{"/isthmus-test-1/kubepods"}))
	require.Empty(t, podUIDOfCgroups([]byte("0::/kubepods/pod"+uid+"\n"), []string{"/isthmus-test-1/kubepods"}))
	// A kubelet with --cgroup-root and the systemd driver.
	custom := []string{"/kubelet.slice/kubelet-kubepods.slice"}
	require.Equal(t, uid, podUIDOfCgroups([]byte("0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod8f3c5b2e_1d4a_4c6b_9e7f_0a1b2c3d4e5f.slice/cri-containerd-abc.scope\n"), custom))
	require.Empty(t, podUIDOfCgroups([]byte("0::/kubelet.slice/kubelet-kubepods.slice/kubepods-besteffort-pod8f3c5b2e_1d4a_4c6b_9e7f_0a1b2c3d4e5f.slice/x\n"), custom))
}
