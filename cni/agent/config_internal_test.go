package agent

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/cni/istiozds"
	"github.com/isthmus-mesh/isthmus/cni/zds"
)

// TestZtunnelProtocolConfig: the JSON protocol stays the default; "istio"
// serves Istio's ZDS at Istio's path (unless another is given), and finds
// the ztunnel's cgroup through ProcDir, refusing without it unless
// ZtunnelMarkOnly.
func TestZtunnelProtocolConfig(t *testing.T) {
	c := Config{NodeName: "n"}.withDefaults()
	require.NoError(t, c.validate())
	zc := c.zds()
	require.Equal(t, ZtunnelProtocolIsthmus, c.ZtunnelProtocol)
	require.Equal(t, "/var/run/isthmus/cni/ztunnel.sock", zc.SocketPath)
	require.Nil(t, zc.Codec, "the server's default: JSON")
	require.Empty(t, zc.PeerProcDir, "the Isthmus hello carries the cgroup id")

	c = Config{NodeName: "n", ZtunnelProtocol: ZtunnelProtocolIstio}.withDefaults()
	require.NoError(t, c.validate())
	zc = c.zds()
	require.Equal(t, istiozds.SocketPath, zc.SocketPath)
	require.Equal(t, zds.Codec(istiozds.Codec{}), zc.Codec)
	require.Equal(t, "/host/proc", zc.PeerProcDir)
	require.False(t, zc.MarkOnlyFallback)

	c = Config{NodeName: "n", ZtunnelProtocol: ZtunnelProtocolIstio, ZtunnelSocket: "/s/z.sock"}.withDefaults()
	require.Equal(t, "/s/z.sock", c.zds().SocketPath)

	c = Config{NodeName: "n", ZtunnelProtocol: ZtunnelProtocolIstio, ProcDir: Disabled}.withDefaults()
	require.ErrorContains(t, c.validate(), "ZtunnelMarkOnly")
	c.ZtunnelMarkOnly = true
	require.NoError(t, c.validate())
	require.Empty(t, c.zds().PeerProcDir)
	require.True(t, c.zds().MarkOnlyFallback)

	c = Config{NodeName: "n", ZtunnelProtocol: "grpc"}.withDefaults()
	require.ErrorContains(t, c.validate(), `ZtunnelProtocol: "grpc"`)
}
