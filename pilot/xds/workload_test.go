package xds_test

import (
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/stretchr/testify/require"

	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/xds"
	"github.com/isthmus-mesh/isthmus/pilot/xds/xdstest"
)

var (
	echoHost = model.Hostname("echo", ns, "")
	echoName = xds.ServiceResourceName(ns, echoHost)
)

// TestDeltaWildcard proves a wildcard subscriber gets the whole state of its
// network first, then only what changed: one added workload, one removal.
// TestServiceVIPsPerNetwork proves each cluster's VIPs are published on
// the network discovery reported for them, even for a cluster with no
// endpoint to tell it by.
func TestServiceVIPsPerNetwork(t *testing.T) {
	reg := xdstest.New()
	svc, ws := xdstest.Backing("echo", ns, tcp80, map[model.ClusterID][]netip.Addr{"c1": {ip("10.96.0.10")}, "c2": {ip("10.97.0.10")}},
		xdstest.Pod("c1", "net1", ns, "a", ip("10.0.0.1")))
	svc.VIPNetworks = map[model.ClusterID]model.Network{"c1": "net1", "c2": "net2"}
	publish(reg, svc, ws)
	e := start(t, reg)
	c := openDelta(t, dial(t, e.addr), wildcard(node("zt-1", "net1", "c1")))
	c.apply(c.next())
	got := map[string]string{}
	for _, a := range c.resources[echoName].GetService().GetAddresses() {
		addr, _ := netip.AddrFromSlice(a.GetAddress())
		got[addr.String()] = a.GetNetwork()
	}
	require.Equal(t, map[string]string{"10.96.0.10": "net1", "10.97.0.10": "net2"}, got)
}

func TestDeltaWildcard(t *testing.T) {
	reg := xdstest.New()
	svc, ws := xdstest.Backing("echo", ns, tcp80, map[model.ClusterID][]netip.Addr{"c1": {ip("10.96.0.10")}},
		xdstest.Pod("c1", "net1", ns, "a", ip("10.0.0.1")), xdstest.Pod("c1", "net1", ns, "b", ip("10.0.0.2")))
	publish(reg, svc, ws)
	e := start(t, reg)
	c := openDelta(t, dial(t, e.addr), wildcard(node("zt-1", "net1", "c1")))

	r := c.next()
	require.ElementsMatch(t, []string{"c1/default/a", "c1/default/b", echoName}, names(r))
	c.apply(r)
	svcRes := c.resources[echoName].GetService()
	require.Equal(t, echoHost, svcRes.GetHostname())
	require.Equal(t, []byte(ip("10.96.0.10").AsSlice()), svcRes.GetAddresses()[0].GetAddress())
	wa := c.resources["c1/default/a"].GetWorkload()
	require.Equal(t, [][]byte{ip("10.0.0.1").AsSlice()}, wa.GetAddresses())
	require.Equal(t, uint32(8080), wa.GetServices()[echoName].GetPorts()[0].GetTargetPort())
	require.Equal(t, workloadv1.TunnelProtocol_HBONE, wa.GetTunnelProtocol())

	// Add a third pod: only it is pushed (the Service resource is unchanged).
	svc, ws = xdstest.Backing("echo", ns, tcp80, svc.VIPs,
		xdstest.Pod("c1", "net1", ns, "a", ip("10.0.0.1")), xdstest.Pod("c1", "net1", ns, "b", ip("10.0.0.2")),
		xdstest.Pod("c1", "net1", ns, "c", ip("10.0.0.3")))
	publish(reg, svc, ws[2:])
	r = c.next()
	require.Equal(t, []string{"c1/default/c"}, names(r))
	require.Empty(t, r.GetRemovedResources())
	c.apply(r)

	// Remove it: only a removal is pushed.
	reg.RemoveWorkload("c1/default/c")
	r = c.next()
	require.Empty(t, r.GetResources())
	require.Equal(t, []string{"c1/default/c"}, r.GetRemovedResources())
	c.apply(r)

	// Remove the service: its resource goes, workloads stay.
	reg.RemoveService(echoHost)
	r = c.next()
	require.Equal(t, []string{echoName}, r.GetRemovedResources())
	c.apply(r)
	require.ElementsMatch(t, []string{"c1/default/a", "c1/default/b"}, slices.Collect(mapsKeys(c.state)))
}

// TestDeltaOnDemand proves a client subscribing by name gets only those
// resources, is not pushed changes of others, and can subscribe to more.
func TestDeltaOnDemand(t *testing.T) {
	reg := xdstest.New()
	svc, ws := xdstest.Backing("echo", ns, tcp80, nil,
		xdstest.Pod("c1", "net1", ns, "a", ip("10.0.0.1")), xdstest.Pod("c1", "net1", ns, "b", ip("10.0.0.2")))
	publish(reg, svc, ws)
	e := start(t, reg)
	c := openDelta(t, dial(t, e.addr), &discovery.DeltaDiscoveryRequest{
		Node: node("zt-1", "net1", "c1"), TypeUrl: xds.WorkloadType, ResourceNamesSubscribe: []string{"c1/default/a"},
	})
	r := c.next()
	require.Equal(t, []string{"c1/default/a"}, names(r))
	c.apply(r)

	// A change of b is not pushed to a client that did not ask for it.
	b := *ws[1]
	b.Ready = false
	reg.SetWorkload(&b)
	c.quiet(300 * time.Millisecond)

	// Subscribing to b and the service brings exactly them.
	require.NoError(t, c.stream.Send(&discovery.DeltaDiscoveryRequest{
		TypeUrl: xds.WorkloadType, ResourceNamesSubscribe: []string{"c1/default/b", echoName},
	}))
	r = c.next()
	require.ElementsMatch(t, []string{"c1/default/b", echoName}, names(r))
	c.apply(r)
	require.Equal(t, workloadv1.WorkloadStatus_UNHEALTHY, c.resources["c1/default/b"].GetWorkload().GetStatus())

	// A name that does not exist yet arrives when it is created.
	require.NoError(t, c.stream.Send(&discovery.DeltaDiscoveryRequest{
		TypeUrl: xds.WorkloadType, ResourceNamesSubscribe: []string{"c1/default/late"},
	}))
	reg.SetWorkload(xdstest.Pod("c1", "net1", ns, "late", ip("10.0.0.9")))
	r = c.next()
	require.Equal(t, []string{"c1/default/late"}, names(r))
}

// TestSplitHorizon proves a network-1 client never receives a network-2 pod
// address, and does receive one synthetic workload per (service, network 2)
// with network 2's trusted gateways (each with the identities it may
// present and its capacity), the number of ready endpoints behind them and
// the identities those endpoints run as; an ignored gateway candidate is
// never sent; a service with no local endpoint is still reachable.
func TestSplitHorizon(t *testing.T) {
	reg := xdstest.New()
	gw2 := model.NetworkGateway{Network: "net2", Cluster: "c2", Address: ip("10.2.255.1"), HBONEPort: 15008, Source: "istio-system/eastwest",
		ServiceAccounts: []string{"eastwest"}, Capacity: 2}
	gw2b := model.NetworkGateway{Network: "net2", Cluster: "c2", Hostname: "gw.example.com", HBONEPort: 15443, Source: "istio-system/eastwest-b",
		ServiceAccounts: []string{"eastwest-b"}, Capacity: 1}
	tenant := model.NetworkGateway{Network: "net2", Cluster: "c2", Address: ip("10.2.255.66"), HBONEPort: 15008, Source: "aaa/evil",
		ServiceAccounts: []string{"evil"}, Capacity: 9, Ignored: model.GatewayIgnoredUntrustedNamespace}
	reg.SetGateway(gw2)
	reg.SetGateway(gw2b)
	reg.SetGateway(tenant)
	remote := []*model.Workload{
		xdstest.Pod("c2", "net2", ns, "r1", ip("10.2.0.1")),
		xdstest.Pod("c2", "net2", ns, "r2", ip("10.2.0.2")),
		xdstest.Pod("c2", "net2", ns, "r3", ip("10.2.0.3")),
	}
	remote[2].Ready = false
	svc, ws := xdstest.Backing("echo", ns, tcp80, nil, append([]*model.Workload{xdstest.Pod("c1", "net1", ns, "l1", ip("10.1.0.1"))}, remote...)...)
	publish(reg, svc, ws)
	// A service whose endpoints are all on network 2.
	only, ows := xdstest.Backing("remote-only", ns, tcp80, nil, xdstest.Pod("c2", "net2", ns, "ro", ip("10.2.0.9")))
	publish(reg, only, ows)

	e := start(t, reg)
	c := openDelta(t, dial(t, e.addr), wildcard(node("zt-1", "net1", "c1")))
	remoteAddrs := [][]byte{ip("10.2.0.1").AsSlice(), ip("10.2.0.2").AsSlice(), ip("10.2.0.3").AsSlice(), ip("10.2.0.9").AsSlice()}
	noRemote := func(r *discovery.DeltaDiscoveryResponse) {
		for _, res := range r.GetResources() {
			a := &workloadv1.Address{}
			require.NoError(t, res.GetResource().UnmarshalTo(a))
			for _, addr := range a.GetWorkload().GetAddresses() {
				require.NotContains(t, remoteAddrs, addr, "network-2 address leaked in %s", res.GetName())
			}
		}
	}

	r := c.next()
	noRemote(r)
	c.apply(r)
	split := xds.SplitHorizonUID("net2", ns, echoHost)
	onlyHost := model.Hostname("remote-only", ns, "")
	require.ElementsMatch(t, []string{
		"c1/default/l1", echoName, split,
		xds.ServiceResourceName(ns, onlyHost), xds.SplitHorizonUID("net2", ns, onlyHost),
	}, slices.Collect(mapsKeys(c.state)))
	sw := c.resources[split].GetWorkload()
	require.Empty(t, sw.GetAddresses())
	require.Equal(t, uint32(2), sw.GetCapacity())
	require.Equal(t, "net2", sw.GetNetwork())
	gws := sw.GetNetworkGateways()
	require.Len(t, gws, 2, "both trusted gateways, never the tenant's")
	require.Equal(t, "gw.example.com", gws[0].GetHostname(), "sorted by key")
	require.Equal(t, uint32(15443), gws[0].GetHboneMtlsPort())
	require.Equal(t, []string{"spiffe://cluster.local/ns/istio-system/sa/eastwest-b"}, gws[0].GetIdentities())
	require.Equal(t, []byte(gw2.Address.AsSlice()), gws[1].GetAddress())
	require.Equal(t, uint32(15008), gws[1].GetHboneMtlsPort())
	require.Equal(t, []string{"spiffe://cluster.local/ns/istio-system/sa/eastwest"}, gws[1].GetIdentities())
	require.Equal(t, uint32(2), gws[1].GetCapacity())
	require.Equal(t, []string{"spiffe://cluster.local/ns/default/sa/default"}, sw.GetIdentities())
	require.Contains(t, sw.GetServices(), echoName)

	// The third remote pod becomes ready: capacity 3, still no address.
	remote[2] = xdstest.Pod("c2", "net2", ns, "r3", ip("10.2.0.3"))
	svc, ws = xdstest.Backing("echo", ns, tcp80, nil, append([]*model.Workload{xdstest.Pod("c1", "net1", ns, "l1", ip("10.1.0.1"))}, remote...)...)
	publish(reg, svc, ws[3:])
	r = c.next()
	noRemote(r)
	require.Equal(t, []string{split}, names(r))
	c.apply(r)
	require.Equal(t, uint32(3), c.resources[split].GetWorkload().GetCapacity())

	// The network-2 gateways go: no way to reach network 2, split workloads
	// removed (the ignored candidate does not keep them).
	reg.Update(func(tx *xdstest.Tx) { tx.RemoveGateway(gw2); tx.RemoveGateway(gw2b) })
	r = c.next()
	require.ElementsMatch(t, []string{split, xds.SplitHorizonUID("net2", ns, onlyHost)}, r.GetRemovedResources())

	// A network-2 client sees network 2's pods with their addresses.
	c2 := openDelta(t, dial(t, e.addr), wildcard(node("zt-2", "net2", "c2")))
	r = c2.next()
	c2.apply(r)
	require.Equal(t, [][]byte{ip("10.2.0.1").AsSlice()}, c2.resources["c2/default/r1"].GetWorkload().GetAddresses())
	require.NotContains(t, c2.state, "c1/default/l1")
}

// TestReconnectWithoutResend proves a client reconnecting with
// initial_resource_versions gets nothing it already has: only the workload
// that changed while it was away.
func TestReconnectWithoutResend(t *testing.T) {
	reg := xdstest.New()
	svc, ws := xdstest.Backing("echo", ns, tcp80, nil,
		xdstest.Pod("c1", "net1", ns, "a", ip("10.0.0.1")), xdstest.Pod("c1", "net1", ns, "b", ip("10.0.0.2")))
	publish(reg, svc, ws)
	e := start(t, reg)
	cc := dial(t, e.addr)
	c := openDelta(t, cc, wildcard(node("zt-1", "net1", "c1")))
	r := c.next()
	require.Len(t, r.GetResources(), 3)
	c.apply(r)
	c.close()

	moved := *ws[1]
	moved.Addresses = []netip.Addr{ip("10.0.0.22")}
	changed := counter(t, e, "isthmus_xds_resources_changed_total")
	reg.SetWorkload(&moved)
	// Reconnect once the server has the change, so the first answer has it.
	require.Eventually(t, func() bool { return counter(t, e, "isthmus_xds_resources_changed_total") > changed }, waitFor, time.Millisecond)

	req := wildcard(node("zt-1", "net1", "c1"))
	req.InitialResourceVersions = c.state
	c2 := openDelta(t, cc, req)
	r = c2.next()
	require.Equal(t, []string{"c1/default/b"}, names(r))
	require.Empty(t, r.GetRemovedResources())
	c2.apply(r)
	c2.quiet(200 * time.Millisecond)

	// Unchanged state: the reconnect answer is empty.
	c2.close()
	req = wildcard(node("zt-1", "net1", "c1"))
	req.InitialResourceVersions = c2.state
	for k, v := range c.state {
		if _, ok := req.InitialResourceVersions[k]; !ok {
			req.InitialResourceVersions[k] = v
		}
	}
	c3 := openDelta(t, cc, req)
	r = c3.next()
	require.Empty(t, r.GetResources())
	require.Empty(t, r.GetRemovedResources())
}

// TestDeltaLateAck proves a wildcard client that ACKs after several changes
// gets exactly those changes (one update, one removal) in one response, and
// that a client changing its subscription afterwards is still served.
func TestDeltaLateAck(t *testing.T) {
	reg := xdstest.New()
	reg.Update(func(tx *xdstest.Tx) {
		tx.SetWorkload(xdstest.Pod("c1", "net1", ns, "a", ip("10.0.0.1")))
		tx.SetWorkload(xdstest.Pod("c1", "net1", ns, "b", ip("10.0.0.2")))
		tx.SetWorkload(xdstest.Pod("c1", "net1", ns, "c", ip("10.0.0.3")))
	})
	e := start(t, reg)
	c := openDelta(t, dial(t, e.addr), wildcard(node("zt-1", "net1", "c1")))
	first := c.next()
	require.Len(t, first.GetResources(), 3)

	moved := xdstest.Pod("c1", "net1", ns, "a", ip("10.0.0.11"))
	reg.SetWorkload(moved)
	reg.RemoveWorkload("c1/default/b")
	require.EventuallyWithT(t, func(ct *assertT) {
		assertEqual(ct, 2.0, counter(t, e, "isthmus_xds_resources_changed_total"))
	}, waitFor, 10*time.Millisecond)
	c.apply(first)

	r := c.next()
	require.Equal(t, []string{"c1/default/a"}, names(r))
	require.Equal(t, []string{"c1/default/b"}, r.GetRemovedResources())
	c.apply(r)
	require.Equal(t, [][]byte{ip("10.0.0.11").AsSlice()}, c.resources["c1/default/a"].GetWorkload().GetAddresses())
	c.quiet(100 * time.Millisecond)

	// Leaving wildcard for one name: removals for the rest.
	require.NoError(t, c.stream.Send(&discovery.DeltaDiscoveryRequest{
		TypeUrl: xds.WorkloadType, ResourceNamesSubscribe: []string{"c1/default/c"}, ResourceNamesUnsubscribe: []string{"*"},
	}))
	r = c.next()
	require.Equal(t, []string{"c1/default/a"}, r.GetRemovedResources())
	c.apply(r)
	reg.SetWorkload(xdstest.Pod("c1", "net1", ns, "d", ip("10.0.0.4")))
	c.quiet(200 * time.Millisecond)
}

// TestSotwWorkloads proves the workload type is also served over SotW: the
// whole state, then what changed (go-control-plane treats a type it does not
// know as not full-state).
func TestSotwWorkloads(t *testing.T) {
	reg := xdstest.New()
	svc, ws := xdstest.Backing("echo", ns, tcp80, nil,
		xdstest.Pod("c1", "net1", ns, "a", ip("10.0.0.1")), xdstest.Pod("c1", "net1", ns, "b", ip("10.0.0.2")))
	publish(reg, svc, ws)
	e := start(t, reg)
	c := openSotw(t, dial(t, e.addr), node("zt-1", "net1", "c1"))
	c.send(&discovery.DiscoveryRequest{TypeUrl: xds.WorkloadType})
	r := c.next(xds.WorkloadType)
	require.Len(t, r.GetResources(), 3, "two workloads and the service")
	c.ack(r)

	b := *ws[1]
	b.Ready = false
	reg.SetWorkload(&b)
	r = c.next(xds.WorkloadType)
	require.Len(t, r.GetResources(), 1)
	addr := &workloadv1.Address{}
	require.NoError(t, r.GetResources()[0].UnmarshalTo(addr))
	require.Equal(t, "c1/default/b", addr.GetWorkload().GetUid())
	require.Equal(t, workloadv1.WorkloadStatus_UNHEALTHY, addr.GetWorkload().GetStatus())
}

// fakeAlloc allocates addresses from a map, under a lock.
type fakeAlloc struct {
	mu sync.Mutex
	m  map[string][2]netip.Addr
}

func (f *fakeAlloc) Addresses(host string) (v4, v6 netip.Addr) {
	f.mu.Lock()
	defer f.mu.Unlock()
	a := f.m[host]
	return a[0], a[1]
}

// TestAllocatedAddresses: a service that has no address on a client's
// network (it runs only on network 2) is sent there with its allocated
// addresses, marked as such and for the client's network; a client on
// network 2, where it has a VIP, gets them too as it is exported (its
// ServiceImport IP: TestClusterSetIPBesideLocalVIP); a change of allocation
// reaches clients through Refresh; and headless and exported are carried.
func TestAllocatedAddresses(t *testing.T) {
	reg := xdstest.New()
	gw2 := model.NetworkGateway{Network: "net2", Cluster: "c2", Address: ip("10.2.255.1"), HBONEPort: 15008, Source: "istio-system/eastwest", ServiceAccounts: []string{"eastwest"}}
	reg.SetGateway(gw2)
	only, ows := xdstest.Backing("remote-only", ns, tcp80, map[model.ClusterID][]netip.Addr{"c2": {ip("10.96.2.9")}}, xdstest.Pod("c2", "net2", ns, "ro", ip("10.2.0.9")))
	only.VIPNetworks = map[model.ClusterID]model.Network{"c2": "net2"}
	only.Definitions = []*model.ClusterService{{Cluster: "c2", Name: "remote-only", Namespace: ns, Exported: true}}
	publish(reg, only, ows)
	host := model.Hostname("remote-only", ns, "")
	alloc := &fakeAlloc{m: map[string][2]netip.Addr{host: {ip("240.240.0.7"), ip("2001:2::7")}}}
	e := startWith(t, reg, xds.Config{AllowPlaintext: true, Allocations: alloc})

	c := openDelta(t, dial(t, e.addr), wildcard(node("zt-1", "net1", "c1")))
	c.apply(c.next())
	svc := c.resources[xds.ServiceResourceName(ns, host)].GetService()
	require.ElementsMatch(t, [][]byte{ip("240.240.0.7").AsSlice()}, svc.GetAllocatedAddresses(), "the service's families only (IPv4)")
	var onNet1 [][]byte
	for _, a := range svc.GetAddresses() {
		if a.GetNetwork() == "net1" {
			onNet1 = append(onNet1, a.GetAddress())
		}
	}
	require.ElementsMatch(t, svc.GetAllocatedAddresses(), onNet1, "the allocated addresses are valid on the client's network")
	require.True(t, svc.GetExported())
	require.False(t, svc.GetHeadless())

	c2 := openDelta(t, dial(t, e.addr), wildcard(node("zt-2", "net2", "c2")))
	c2.apply(c2.next())
	require.Equal(t, [][]byte{ip("240.240.0.7").AsSlice()}, c2.resources[xds.ServiceResourceName(ns, host)].GetService().GetAllocatedAddresses(),
		"it has a VIP on network 2, and, exported, its ServiceImport IP too")

	alloc.mu.Lock()
	alloc.m[host] = [2]netip.Addr{ip("240.240.0.8")}
	alloc.mu.Unlock()
	e.srv.Refresh(host)
	r := c.next()
	require.Equal(t, []string{xds.ServiceResourceName(ns, host)}, names(r))
	c.apply(r)
	require.Equal(t, [][]byte{ip("240.240.0.8").AsSlice()}, c.resources[xds.ServiceResourceName(ns, host)].GetService().GetAllocatedAddresses())
}

// TestClusterSetIPBesideLocalVIP: an exported service that has a VIP on
// both networks is also sent, on each, its allocated address (its
// ServiceImport IP) beside the local VIP, marked allocated; a service that
// is not exported is not.
func TestClusterSetIPBesideLocalVIP(t *testing.T) {
	reg := xdstest.New()
	both, bws := xdstest.Backing("both", ns, tcp80, map[model.ClusterID][]netip.Addr{"c1": {ip("10.96.1.5")}, "c2": {ip("10.96.2.5")}},
		xdstest.Pod("c1", "net1", ns, "b1", ip("10.1.0.5")), xdstest.Pod("c2", "net2", ns, "b2", ip("10.2.0.5")))
	both.VIPNetworks = map[model.ClusterID]model.Network{"c1": "net1", "c2": "net2"}
	both.Definitions = []*model.ClusterService{{Cluster: "c2", Name: "both", Namespace: ns, Exported: true}, {Cluster: "c1", Name: "both", Namespace: ns}}
	publish(reg, both, bws)
	plain, pws := xdstest.Backing("plain", ns, tcp80, map[model.ClusterID][]netip.Addr{"c1": {ip("10.96.1.6")}},
		xdstest.Pod("c1", "net1", ns, "p1", ip("10.1.0.6")))
	plain.VIPNetworks = map[model.ClusterID]model.Network{"c1": "net1"}
	plain.Definitions = []*model.ClusterService{{Cluster: "c1", Name: "plain", Namespace: ns}}
	publish(reg, plain, pws)
	bothHost, plainHost := model.Hostname("both", ns, ""), model.Hostname("plain", ns, "")
	alloc := &fakeAlloc{m: map[string][2]netip.Addr{bothHost: {ip("240.240.0.9")}, plainHost: {ip("240.240.0.10")}}}
	e := startWith(t, reg, xds.Config{AllowPlaintext: true, Allocations: alloc})

	for _, n := range []struct {
		node    string
		network model.Network
		cluster model.ClusterID
		local   string
	}{
		{"zt-1", "net1", "c1", "10.96.1.5"}, {"zt-2", "net2", "c2", "10.96.2.5"},
	} {
		c := openDelta(t, dial(t, e.addr), wildcard(node(n.node, n.network, n.cluster)))
		c.apply(c.next())
		svc := c.resources[xds.ServiceResourceName(ns, bothHost)].GetService()
		require.Equal(t, [][]byte{ip("240.240.0.9").AsSlice()}, svc.GetAllocatedAddresses(), "the ServiceImport IP on %s", n.network)
		var mine [][]byte
		for _, a := range svc.GetAddresses() {
			if a.GetNetwork() == string(n.network) {
				mine = append(mine, a.GetAddress())
			}
		}
		require.Equal(t, [][]byte{ip(n.local).AsSlice(), ip("240.240.0.9").AsSlice()}, mine, "local VIP first, then the clusterset IP, on %s", n.network)
		require.True(t, svc.GetExported())
		if n.network == "net1" {
			p := c.resources[xds.ServiceResourceName(ns, plainHost)].GetService()
			require.Empty(t, p.GetAllocatedAddresses(), "not exported, VIP on the client's network: no allocated address")
			require.Len(t, p.GetAddresses(), 1)
		}
	}
}
