package plugin

import (
	"net/netip"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/stretchr/testify/require"
)

func TestParseConf(t *testing.T) {
	conf, timeout, err := parseConf([]byte(`{"cniVersion":"1.0.0","name":"net","type":"isthmus-cni","agent_socket":"/s","timeout":"3s",
		"prevResult":{"cniVersion":"1.0.0","ips":[{"address":"10.1.2.3/24"},{"address":"fd00::3/64"}]}}`))
	require.NoError(t, err)
	require.Equal(t, "/s", conf.AgentSocket)
	require.Equal(t, 3*time.Second, timeout)
	require.NotNil(t, conf.PrevResult)

	ev, err := event(CommandAdd, &skel.CmdArgs{ContainerID: "c1", Netns: "/var/run/netns/x", IfName: "eth0",
		Args: "IgnoreUnknown=1;K8S_POD_NAMESPACE=app;K8S_POD_NAME=web-0;K8S_POD_UID=u-1;SOMETHING_ELSE=1"}, conf)
	require.NoError(t, err)
	require.Equal(t, &Event{Command: CommandAdd, ContainerID: "c1", Netns: "/var/run/netns/x", IfName: "eth0",
		PodName: "web-0", PodNamespace: "app", PodUID: "u-1",
		IPs: []netip.Addr{netip.MustParseAddr("10.1.2.3"), netip.MustParseAddr("fd00::3")}}, ev)

	_, timeout, err = parseConf([]byte(`{"cniVersion":"1.0.0","agent_socket":"/s"}`))
	require.NoError(t, err)
	require.Equal(t, DefaultTimeout, timeout)

	for _, tc := range []struct {
		name, conf string
		code       uint
		msg        string
	}{
		{"not JSON", `{`, types.ErrDecodingFailure, "cannot decode"},
		{"no socket", `{"cniVersion":"1.0.0"}`, types.ErrInvalidNetworkConfig, "agent_socket"},
		{"bad timeout", `{"agent_socket":"/s","timeout":"soon"}`, types.ErrInvalidNetworkConfig, "bad timeout"},
		{"bad prevResult", `{"cniVersion":"1.0.0","agent_socket":"/s","prevResult":{"cniVersion":"1.0.0","ips":"x"}}`,
			types.ErrDecodingFailure, "prevResult"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := parseConf([]byte(tc.conf))
			var te *types.Error
			require.ErrorAs(t, err, &te)
			require.Equal(t, tc.code, te.Code)
			require.Contains(t, te.Msg, tc.msg)
		})
	}
	_, err = event(CommandAdd, &skel.CmdArgs{Args: "K8S_POD_NAME"}, conf)
	require.ErrorContains(t, err, "CNI_ARGS")
}
