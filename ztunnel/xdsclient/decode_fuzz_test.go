package xdsclient

import (
	"encoding/json"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

const fuzzEcho = "default/echo.default.svc.cluster.local"

// fuzzBaseline is what the store holds before the fuzzed resources arrive:
// pods (one dual-stack, one hostNetwork), a split-horizon workload behind a
// gateway, and two services.
func fuzzBaseline() []proto.Message {
	ports := func(sp, tp uint32) map[string]*workloadv1.PortList {
		return map[string]*workloadv1.PortList{fuzzEcho: {Ports: []*workloadv1.Port{{ServicePort: sp, TargetPort: tp}}}}
	}
	wl := func(w *workloadv1.Workload) proto.Message {
		return &workloadv1.Address{Type: &workloadv1.Address_Workload{Workload: w}}
	}
	pod := func(uid string, addrs ...string) *workloadv1.Workload {
		w := &workloadv1.Workload{Uid: uid, Name: uid[strings.LastIndex(uid, "/")+1:], Namespace: "default", Network: "n1", ClusterId: "c1",
			Node: "node-a", ServiceAccount: "echo", TunnelProtocol: workloadv1.TunnelProtocol_HBONE, Services: ports(80, 8080)}
		for _, a := range addrs {
			w.Addresses = append(w.Addresses, netip.MustParseAddr(a).AsSlice())
		}
		return w
	}
	host := pod("c1/kube-system/h1", "192.168.0.1")
	host.Namespace, host.HostNetwork, host.Services = "kube-system", true, nil
	remote := &workloadv1.Workload{Uid: "n2/default/echo", Name: "echo", Namespace: "default", Network: "n2", ClusterId: "c2",
		TunnelProtocol: workloadv1.TunnelProtocol_HBONE, Services: ports(80, 8080),
		Identities: []string{"spiffe://cluster.local/ns/default/sa/echo"},
		NetworkGateways: []*workloadv1.GatewayAddress{{
			Destination:   &workloadv1.GatewayAddress_Address{Address: []byte{172, 16, 0, 1}},
			HboneMtlsPort: 15008, Identities: []string{"spiffe://cluster.local/ns/isthmus-system/sa/eastwest"},
		}}}
	svc := func(name string, vip byte, mod func(*workloadv1.Service)) proto.Message {
		s := &workloadv1.Service{Name: name, Namespace: "default", Ports: []*workloadv1.ServicePort{{ServicePort: 80, TargetPort: 8080}},
			Addresses: []*workloadv1.NetworkAddress{{Network: "n1", Address: []byte{10, 96, 0, vip}}, {Network: "n2", Address: []byte{10, 97, 0, vip}}}}
		if mod != nil {
			mod(s)
		}
		return &workloadv1.Address{Type: &workloadv1.Address_Service{Service: s}}
	}
	return []proto.Message{
		wl(pod("c1/default/b1", "10.0.0.1")), wl(pod("c1/default/b2", "10.0.0.2", "fd00::2")), wl(host), wl(remote),
		svc("echo", 10, nil), svc("db", 11, func(s *workloadv1.Service) { s.Scope = workloadv1.ServiceScope_CLUSTER_LOCAL }),
	}
}

// fuzzBaselineNames are the resource names of fuzzBaseline, in order.
var fuzzBaselineNames = []string{"c1/default/b1", "c1/default/b2", "c1/kube-system/h1", "n2/default/echo", fuzzEcho, "default/db.default.svc.cluster.local"}

func anyResource(name string, value []byte) *discovery.Resource {
	return &discovery.Resource{Name: name, Version: "v1", Resource: &anypb.Any{TypeUrl: workloadv1.TypeURL, Value: value}}
}

// seen collects every key, address, VIP, hostname, cluster and network the
// decoded resources named, to probe the store's indexes for stale entries.
type seen struct {
	addrs      map[netip.Addr]bool
	hosts      map[string]bool
	keys       map[string]bool
	placements map[string]bool // clusters and networks
}

func (s *seen) add(cv converter, rs ...*discovery.Resource) {
	for _, r := range rs {
		res, err := cv.decode(r)
		if err != nil {
			continue
		}
		if w := res.workload; w != nil {
			for _, a := range w.Addresses {
				s.addrs[a] = true
			}
			for k := range w.Services {
				s.keys[k] = true
			}
			s.placements[w.Cluster], s.placements[w.Network] = true, true
		}
		if svc := res.service; svc != nil {
			for _, v := range svc.VIPs {
				s.addrs[v] = true
			}
			s.hosts[svc.Hostname], s.keys[svc.Key()] = true, true
		}
	}
}

// FuzzDecodeApply decodes arbitrary Address resource bytes under arbitrary
// names and applies them, then removals, to a store already holding a
// baseline, through the client's own apply (the Tx calls of a real
// response). After every step the store's indexes must agree with its
// workloads and services, and with what the client believes it holds;
// applying a response twice changes nothing.
func FuzzDecodeApply(f *testing.F) {
	f.Fuzz(func(t *testing.T, name1 string, value1 []byte, name2 string, value2 []byte, removed string) {
		st := state.NewStore()
		c, err := New(Config{Address: "pilot.invalid:15012", NodeID: "fuzz", Network: "n1"}, Deps{Store: st, Credentials: insecure.NewCredentials()})
		if err != nil {
			t.Fatal(err)
		}
		s := &seen{addrs: map[netip.Addr]bool{}, hosts: map[string]bool{}, keys: map[string]bool{}, placements: map[string]bool{}}
		base := &discovery.DeltaDiscoveryResponse{}
		for i, m := range fuzzBaseline() {
			b, err := proto.Marshal(m)
			if err != nil {
				t.Fatal(err)
			}
			base.Resources = append(base.Resources, anyResource(fuzzBaselineNames[i], b))
		}
		s.add(c.conv, base.Resources...)
		if rej := c.apply(base); len(rej) > 0 {
			t.Fatalf("baseline rejected: %v", rej)
		}
		checkStore(t, c, s, "baseline")

		resp := &discovery.DeltaDiscoveryResponse{Resources: []*discovery.Resource{anyResource(name1, value1), anyResource(name2, value2)}}
		s.add(c.conv, resp.Resources...)
		c.apply(resp)
		checkStore(t, c, s, "fuzzed resources")
		before := contents(st.Load())
		c.apply(resp)
		if after := contents(st.Load()); !reflect.DeepEqual(before, after) {
			t.Fatalf("applying the same response twice changed the store:\n%s\n%s", before, after)
		}
		c.apply(&discovery.DeltaDiscoveryResponse{RemovedResources: strings.Split(removed, ",")})
		checkStore(t, c, s, "removals")
	})
}

// contents renders what a snapshot holds, for comparison.
func contents(snap *state.Snapshot) string {
	b, err := json.Marshal(struct {
		Workloads []*state.Workload
		Services  []*state.Service
		Contested map[netip.Addr][]string
	}{snap.Workloads(), snap.Services(), snap.Contested()})
	if err != nil {
		panic(err) // the state types all marshal
	}
	return string(b)
}

// checkStore checks the store's indexes and the client's bookkeeping.
func checkStore(t *testing.T, c *Client, s *seen, step string) {
	t.Helper()
	snap := c.deps.Store.Load()
	fail := func(format string, args ...any) { t.Fatalf(step+": "+format, args...) }
	checkAddresses(snap, s, fail)
	checkServices(snap, s, fail)
	workloads, services := snap.Workloads(), snap.Services()
	for k := range s.keys {
		var want []*state.Workload
		for _, w := range workloads {
			if _, ok := w.Services[k]; ok {
				want = append(want, w)
			}
		}
		if got := snap.Endpoints(k); !slices.Equal(got, want) {
			fail("endpoints of %s: %d workloads, want %d", k, len(got), len(want))
		}
	}
	for p := range s.placements {
		known := slices.ContainsFunc(workloads, func(w *state.Workload) bool { return w.Cluster == p || w.Network == p })
		if p != "" && (snap.KnownCluster(p) || snap.KnownNetwork(p)) != known {
			fail("cluster or network %q known=%v, yet named by a workload=%v", p, !known, known)
		}
	}
	c.heldMu.RLock()
	defer c.heldMu.RUnlock()
	held := 0
	for _, w := range workloads {
		if h, ok := c.held[w.UID]; !ok || h.kind != kindWorkload {
			fail("store holds workload %q the client does not", w.UID)
		}
		held++
	}
	for _, svc := range services {
		if h, ok := c.held[svc.Key()]; !ok || h.kind != kindService {
			fail("store holds service %q the client does not", svc.Key())
		}
		held++
	}
	if held != len(c.held) {
		fail("client holds %d resources, the store %d", len(c.held), held)
	}
}

// checkAddresses: each address a workload claims is owned by a live
// workload that claims it (contested claims list every claimant, owner
// first, sorted by UID); no address nobody claims is indexed.
func checkAddresses(snap *state.Snapshot, s *seen, fail func(string, ...any)) {
	claimants := map[netip.Addr][]string{}
	for _, w := range snap.Workloads() {
		if w.HostNetwork {
			continue
		}
		for _, a := range w.Addresses {
			if !slices.Contains(claimants[a], w.UID) {
				claimants[a] = append(claimants[a], w.UID)
			}
		}
	}
	contested := snap.Contested()
	for a := range s.addrs {
		owner, ok := snap.WorkloadByAddr(a)
		uids := claimants[a]
		switch {
		case len(uids) == 0 && ok:
			fail("address %s is indexed to %q, which no live workload claims it for", a, owner.UID)
		case len(uids) > 0 && !ok:
			fail("address %s claimed by %q is not indexed", a, uids)
		case len(uids) == 0:
		case !slices.Contains(uids, owner.UID) || !isLive(snap, owner):
			fail("address %s is indexed to %q, not one of its claimants %q", a, owner.UID, uids)
		case len(uids) == 1 && len(contested[a]) > 0:
			fail("address %s has one claimant %q, yet is contested by %q", a, uids, contested[a])
		case len(uids) > 1:
			slices.Sort(uids)
			if !slices.Equal(contested[a], uids) || owner.UID != uids[0] {
				fail("address %s: owner %q, contested %q, claimants %q", a, owner.UID, contested[a], uids)
			}
		}
	}
}

func isLive(snap *state.Snapshot, w *state.Workload) bool {
	live, ok := snap.Workload(w.UID)
	return ok && live == w
}

// checkServices: a VIP or hostname is indexed exactly when a live service
// has it, and then to such a service.
func checkServices(snap *state.Snapshot, s *seen, fail func(string, ...any)) {
	services := snap.Services()
	for a := range s.addrs {
		svc, ok := snap.ServiceByVIP(a)
		has := slices.ContainsFunc(services, func(x *state.Service) bool { return slices.Contains(x.VIPs, a) })
		if ok != has || ok && (!slices.Contains(services, svc) || !slices.Contains(svc.VIPs, a)) {
			fail("VIP %s: indexed=%v, held by a live service=%v", a, ok, has)
		}
	}
	for h := range s.hosts {
		svc, ok := snap.ServiceByHostname(h)
		has := slices.ContainsFunc(services, func(x *state.Service) bool { return x.Hostname == h })
		if ok != has || ok && (!slices.Contains(services, svc) || svc.Hostname != h) {
			fail("hostname %q: indexed=%v, held by a live service=%v", h, ok, has)
		}
	}
}
