package plugin

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/stretchr/testify/require"
)

// FuzzPluginInput feeds the plugin what the runtime controls: the network
// configuration on stdin and CNI_ARGS (and the container ID, netns path and
// interface name). Properties: no panic; every refusal is a CNI error of the
// code its step gives; an accepted configuration names the agent's socket
// and a positive timeout; an accepted event carries the runtime's values
// unchanged (the K8S_POD_* values are the last of their key, as CNI_ARGS
// reads), only valid unmapped addresses, and crosses the wire to the agent
// (JSON) unchanged.
func FuzzPluginInput(f *testing.F) {
	f.Add([]byte(`{"cniVersion":"1.0.0","name":"net","type":"isthmus-cni","agent_socket":"/s","timeout":"3s","prevResult":{"cniVersion":"1.0.0","ips":[{"address":"10.1.2.3/24"},{"address":"fd00::3/64"}]}}`),
		"IgnoreUnknown=1;K8S_POD_NAMESPACE=app;K8S_POD_NAME=web-0;K8S_POD_UID=u-1;K8S_POD_INFRA_CONTAINER_ID=c1", "c1", "/var/run/netns/x")
	f.Add([]byte(`{"cniVersion":"0.4.0","agent_socket":"/s","prevResult":{"cniVersion":"0.4.0","ips":[{"version":"4","address":"::ffff:10.0.0.1/24"}]}}`),
		"K8S_POD_NAME=a;K8S_POD_NAME=b", "", "")
	f.Add([]byte(`{"agent_socket":"/s","timeout":"-1s"}`), "K8S_POD_NAME", "c", "/proc/1/ns/net")
	f.Add([]byte(`{"cniVersion":"1.0.0","agent_socket":"/s","prevResult":{"cniVersion":"1.0.0","ips":"x"}}`), "a=b=c", "c", "")
	f.Add([]byte(`{`), "IgnoreUnknown=0;X=1", "c", "")
	f.Fuzz(func(t *testing.T, stdin []byte, args, containerID, netnsPath string) {
		conf, timeout, err := parseConf(stdin)
		if err != nil {
			var te *types.Error
			require.True(t, errors.As(err, &te), "a refusal is a CNI error: %v", err)
			require.Contains(t, []uint{types.ErrDecodingFailure, types.ErrInvalidNetworkConfig}, te.Code)
			return
		}
		require.NotEmpty(t, conf.AgentSocket)
		require.Positive(t, timeout)

		ev, err := event(CommandAdd, &skel.CmdArgs{ContainerID: containerID, Netns: netnsPath, IfName: "eth0", Args: args}, conf)
		want, ok := lastValues(args)
		if err != nil {
			var te *types.Error
			require.True(t, errors.As(err, &te), "a refusal is a CNI error: %v", err)
			require.Contains(t, []uint{types.ErrInvalidEnvironmentVariables, types.ErrDecodingFailure}, te.Code)
			if te.Code == types.ErrInvalidEnvironmentVariables {
				require.False(t, ok && !want.hasIgnoreUnknown, "well-formed CNI_ARGS %q refused: %v", args, err)
			}
			return
		}
		require.True(t, ok, "malformed CNI_ARGS %q accepted", args)
		require.Equal(t, containerID, ev.ContainerID)
		require.Equal(t, netnsPath, ev.Netns)
		require.Equal(t, want.values["K8S_POD_NAME"], ev.PodName)
		require.Equal(t, want.values["K8S_POD_NAMESPACE"], ev.PodNamespace)
		require.Equal(t, want.values["K8S_POD_UID"], ev.PodUID)
		for _, ip := range ev.IPs {
			require.True(t, ip.IsValid())
			require.False(t, ip.Is4In6(), "addresses are unmapped")
		}
		b, err := json.Marshal(ev)
		require.NoError(t, err)
		var back Event
		require.NoError(t, json.Unmarshal(b, &back))
		if !strings.ContainsRune(args+containerID+netnsPath, '\uFFFD') && validUTF8(args+containerID+netnsPath) {
			require.Equal(t, *ev, back, "the event crosses the wire unchanged")
		}
	})
}

type argValues struct {
	values           map[string]string
	hasIgnoreUnknown bool
}

// lastValues reads CNI_ARGS independently: ';'-separated pairs of exactly
// one '='; ok is false when a pair is malformed.
func lastValues(args string) (argValues, bool) {
	out := argValues{values: map[string]string{}}
	if args == "" {
		return out, true
	}
	for _, pair := range strings.Split(args, ";") {
		k, v, found := strings.Cut(pair, "=")
		if !found || strings.Contains(v, "=") {
			return out, false
		}
		switch k {
		case "IgnoreUnknown", "CommonArgs":
			out.hasIgnoreUnknown = true
		}
		out.values[k] = v
	}
	return out, true
}

func validUTF8(s string) bool { return strings.ToValidUTF8(s, "\uFFFD") == s }
