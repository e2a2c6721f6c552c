//go:build linux

package demo

import (
	"fmt"
	"net/netip"
)

// Names and addresses shared by both modes.
const (
	// EchoHost is the federated service sleep calls.
	EchoHost = "echo.demo.svc.cluster.local"
	// ns is the control plane's namespace in every cluster.
	ns = "isthmus-system"
	// appNS is the namespace of the demo's workloads (enrolled: ambient).
	appNS = "demo"
	// pilotIP is pilot's address, on the host's loopback.
	pilotIP = "127.0.50.1"
	// pilotSAN is the DNS name in pilot's serving certificate that
	// processes in network namespaces verify (they reach pilot through a
	// forwarder on their own loopback).
	pilotSAN = "isthmusd.isthmus-system.svc"
	// nameserver is the DNS server in the pods' resolv.conf: any address
	// does, the pods' rules send port 53 to ztunnel.
	nameserver = "10.96.0.10:53"
)

// site is one cluster on its own network, with one node and an east-west
// gateway.
type site struct {
	index            int // 1 or 2: the second octet of the network's addresses
	cluster, network string
	node             string
	nodeIP           netip.Addr
	gatewayIP        netip.Addr
}

// podSpec is one application pod in namespace demo.
type podSpec struct {
	name, app string
	site      *site
	ip        netip.Addr
}

// who is how the pod's application introduces itself in replies.
func (p podSpec) who() string {
	return fmt.Sprintf("%s (%s, %s, %s)", p.name, p.site.cluster, p.site.network, p.ip)
}

// plan is where everything sits in one mode.
type plan struct {
	sites                  [2]*site
	sleep, echo, localEcho podSpec
}

// loopbackPlan gives every pod, node proxy and gateway its own loopback
// address: the networks are a matter of policy only.
func loopbackPlan() *plan {
	s1 := &site{index: 1, cluster: "cluster-1", network: "network-1", node: "node-1a",
		nodeIP: mustAddr("127.10.0.1"), gatewayIP: mustAddr("127.10.255.1")}
	s2 := &site{index: 2, cluster: "cluster-2", network: "network-2", node: "node-2a",
		nodeIP: mustAddr("127.20.0.1"), gatewayIP: mustAddr("127.20.255.1")}
	return &plan{sites: [2]*site{s1, s2},
		sleep:     podSpec{name: "sleep-0", app: "sleep", site: s1, ip: mustAddr("127.10.0.10")},
		echo:      podSpec{name: "echo-0", app: "echo", site: s2, ip: mustAddr("127.20.0.10")},
		localEcho: podSpec{name: "echo-local", app: "echo", site: s1, ip: mustAddr("127.10.0.20")},
	}
}

// isolatedPlan puts network i in 10.i.0.0/16: its node on 10.i.0.11, the
// node's pods on the bridge 10.i.1.0/24, its gateway on 10.i.255.1.
func isolatedPlan() *plan {
	s1 := &site{index: 1, cluster: "cluster-1", network: "network-1", node: "node-1a",
		nodeIP: mustAddr("10.1.0.11"), gatewayIP: mustAddr("10.1.255.1")}
	s2 := &site{index: 2, cluster: "cluster-2", network: "network-2", node: "node-2a",
		nodeIP: mustAddr("10.2.0.11"), gatewayIP: mustAddr("10.2.255.1")}
	return &plan{sites: [2]*site{s1, s2},
		sleep:     podSpec{name: "sleep-0", app: "sleep", site: s1, ip: mustAddr("10.1.1.10")},
		echo:      podSpec{name: "echo-0", app: "echo", site: s2, ip: mustAddr("10.2.1.10")},
		localEcho: podSpec{name: "echo-local", app: "echo", site: s1, ip: mustAddr("10.1.1.20")},
	}
}

// Addresses of the isolated plan derived from a site's index.
func (s *site) netPrefix() netip.Prefix { return pfx(fmt.Sprintf("10.%d.0.0/16", s.index)) }

// wanSide and routerWAN are the two ends of the router's link to the wan.
func (s *site) wanSide() netip.Prefix   { return pfx(fmt.Sprintf("10.255.%d.1/24", s.index)) }
func (s *site) routerWAN() netip.Prefix { return pfx(fmt.Sprintf("10.255.%d.2/24", s.index)) }

// routerNode is the router's end of its link to the node (the node's end
// is nodeIP/24); routerGateway its end of the link to the gateway.
func (s *site) routerNode() netip.Prefix    { return pfx(fmt.Sprintf("10.%d.0.1/24", s.index)) }
func (s *site) routerGateway() netip.Prefix { return pfx(fmt.Sprintf("10.%d.255.254/24", s.index)) }

// bridge is the node's pod bridge (the pods' default gateway).
func (s *site) bridge() netip.Prefix { return pfx(fmt.Sprintf("10.%d.1.1/24", s.index)) }

func mustAddr(s string) netip.Addr { return netip.MustParseAddr(s) }

func pfx(s string) netip.Prefix { return netip.MustParsePrefix(s) }
