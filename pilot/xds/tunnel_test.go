package xds_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/xds"
	"github.com/isthmus-mesh/isthmus/pilot/xds/xdstest"
)

// sliceAddress is w as discovery makes it from an EndpointSlice address of
// service svc: bound to the pod w by its targetRef (w's name and
// placement), or standing alone (the address as its name).
func sliceAddress(w *model.Workload, svc string, bound bool) *model.Workload {
	c := *w
	c.UID = model.SliceWorkloadPrefix(w.Cluster, model.ServiceKey{Namespace: w.Namespace, Name: svc}) + w.Addresses[0].String()
	c.FromSlice, c.SliceOfPod = true, bound
	if !bound {
		c.Name = w.Addresses[0].String()
	}
	return &c
}

// TestTunnelProtocolFollowsWhoIsCaptured: a pod is reached over HBONE, and
// so is a slice address bound to one; a hostNetwork pod and a slice
// address without a pod (the API server behind the kubernetes Service, a
// database outside the cluster) have no ztunnel and are reached in
// plaintext. Only HBONE endpoints count in a remote network's
// split-horizon workload: its gateway forwards to nothing else.
func TestTunnelProtocolFollowsWhoIsCaptured(t *testing.T) {
	reg := xdstest.New()
	reg.SetGateway(model.NetworkGateway{Network: "net2", Cluster: "c2", Address: ip("10.2.255.1"), HBONEPort: 15008,
		Source: "istio-system/eastwest", ServiceAccounts: []string{"eastwest"}, Capacity: 1})
	hostNet := xdstest.Pod("c1", "net1", ns, "agent", ip("10.1.0.3"))
	hostNet.HostNetwork = true
	local := []*model.Workload{
		xdstest.Pod("c1", "net1", ns, "pod", ip("10.1.0.1")),
		hostNet,
		sliceAddress(xdstest.Pod("c1", "net1", ns, "bound", ip("10.1.0.4")), "mixed", true),
		sliceAddress(xdstest.Pod("c1", "net1", ns, "x", ip("10.1.0.5")), "mixed", false),
	}
	remote := []*model.Workload{
		xdstest.Pod("c2", "net2", ns, "far", ip("10.2.0.1")),
		sliceAddress(xdstest.Pod("c2", "net2", ns, "y", ip("10.2.0.2")), "mixed", false),
	}
	svc, ws := xdstest.Backing("mixed", ns, tcp80, nil, append(local, remote...)...)
	publish(reg, svc, ws)
	// A remote service whose only endpoint is an address without a pod.
	ext, ews := xdstest.Backing("external", ns, tcp80, nil, sliceAddress(xdstest.Pod("c2", "net2", ns, "z", ip("10.2.0.3")), "external", false))
	publish(reg, ext, ews)

	e := start(t, reg)
	c := openDelta(t, dial(t, e.addr), wildcard(node("zt-1", "net1", "c1")))
	c.apply(c.next())
	proto := func(uid string) workloadv1.TunnelProtocol {
		t.Helper()
		w := c.resources[uid].GetWorkload()
		require.NotNil(t, w, uid)
		return w.GetTunnelProtocol()
	}
	require.Equal(t, workloadv1.TunnelProtocol_HBONE, proto(local[0].UID), "a pod")
	if w := c.resources[local[1].UID].GetWorkload(); w != nil { // served only where it claims its address
		require.Equal(t, workloadv1.TunnelProtocol_NONE, w.GetTunnelProtocol(), "a hostNetwork pod")
	}
	require.Equal(t, workloadv1.TunnelProtocol_HBONE, proto(local[2].UID), "a slice address bound to its pod")
	require.Equal(t, workloadv1.TunnelProtocol_NONE, proto(local[3].UID), "a slice address without a pod")
	require.False(t, c.resources[local[3].UID].GetWorkload().GetHostNetwork())

	split := c.resources[xds.SplitHorizonUID("net2", ns, svc.Hostname)].GetWorkload()
	require.NotNil(t, split)
	require.Equal(t, uint32(1), split.GetCapacity(), "the remote pod only: the gateway cannot reach the address without a pod")
	require.NotContains(t, c.state, xds.SplitHorizonUID("net2", ns, ext.Hostname), "no reachable endpoint in network 2: no split-horizon workload")
}
