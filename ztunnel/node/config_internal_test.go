package node

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestNodeIDDefaults: a gateway replica in a pod is named by its pod (the
// node's ztunnel and every replica on the node would otherwise share the
// node's id); a node proxy by its node; a NodeID given wins.
func TestNodeIDDefaults(t *testing.T) {
	base := Config{NodeName: "n1", Namespace: "mesh", PodName: "eastwest-7d9f-abcde"}
	gw := base
	gw.Mode = ModeGateway
	require.Equal(t, "gateway~eastwest-7d9f-abcde.mesh", gw.withDefaults().NodeID)
	gw.PodName = ""
	require.Equal(t, "ztunnel~n1.mesh", gw.withDefaults().NodeID, "a gateway outside a pod")
	gw.NodeID = "mine"
	require.Equal(t, "mine", gw.withDefaults().NodeID)
	require.Equal(t, "ztunnel~n1.mesh", base.withDefaults().NodeID, "node mode")
}
