// Package redirect writes the nftables rules that capture an enrolled pod's
// traffic, over netlink (github.com/google/nftables: no nft or iptables
// binary), in two places.
//
// Inside the pod's network namespace, table inet "isthmus-inpod" (Apply):
//
//	chain prerouting { type nat hook prerouting priority dstnat
//	  iif lo return                            # the pod's own loopback
//	  ip saddr 169.254.7.127 return            # kubelet probes (SNAT'd on the node)
//	  ip6 saddr fd16:9254:7127:1337:ffff:ffff:ffff:ffff return
//	  tcp dport 15008 return                   # HBONE reaches ztunnel's 15008 as is
//	  meta l4proto tcp redirect to :15006      # other inbound TCP: ztunnel's plaintext inbound
//	}
//	set ztunnels { type cgroupsv2 }            # Options.ZtunnelCgroups
//	chain output { type nat hook output priority dstnat
//	  meta mark & 0xfff == 0x539 socket cgroupv2 level 0 @ztunnels return
//	  ...                                      # one such rule per level 0..16
//	  meta mark & 0xfff == 0x539 socket cgroupv2 level 16 @ztunnels return
//	  oif lo return                            # loopback, and the pod's own addresses
//	  ip daddr <excluded> return               # e.g. the node's addresses
//	  udp dport 53 redirect to :15053          # only with Options.RedirectDNS
//	  tcp dport 53 redirect to :15053          # only with Options.RedirectDNS
//	  meta l4proto tcp redirect to :15001      # outbound TCP: ztunnel's outbound
//	}
//
// ztunnel's own sockets inside the pod are left alone only when they carry
// its mark (SO_MARK) AND were opened by a process of a ztunnel's cgroup v2
// (or below it). The mark alone proves nothing: since Linux 5.17 SO_MARK
// needs only CAP_NET_RAW, which every container holds by default. ztunnel
// runs in a container and cannot know its cgroup's depth, so the rules
// match its id at every level; cgroup ids are unique (and never reused), so
// "ztunnel's id at some level" is exactly "inside ztunnel's subtree". Since
// Linux 6.11 the kernel counts the levels from the root of the cgroup
// namespace of the process writing the rules, so Apply writes them from
// Options.CgroupNS (the agent passes the node's), where they are absolute;
// written from an agent container's own namespace, a ztunnel shallower than
// the agent would be out of reach. With no ztunnel known the set is absent
// and no socket is exempt (captured traffic fails closed). For a
// ztunnel that reports no cgroup (Istio's, or a cgroup v1-only node)
// Options.MarkOnly writes the single mark rule instead:
//
//	meta mark & 0xfff == 0x539 return        # Options.MarkOnly: any CAP_NET_RAW process can leave
//
// REDIRECT is destination NAT tracked by conntrack, so a listener reads a
// connection's original destination with SO_ORIGINAL_DST (IPv4) or
// IP6T_SO_ORIGINAL_DST (IPv6). Outbound connections are redirected to the
// loopback address of their family (127.0.0.1 or ::1), inbound ones to the
// pod's address on the interface they arrived on: ztunnel's in-pod TCP
// listeners (15001, 15006, 15008) listen on the wildcard address ([::]
// dual-stack, or 0.0.0.0 and [::]); its DNS listener (15053) on loopback only,
// which the output-hook DNS redirect reaches and no other host does.
// NAT chains see only the first packet of a connection, so replies and
// connections that existed before Apply are not affected.
//
// Inside the node's network namespace, table inet "isthmus-node"
// (ApplyNode): connections the node itself opens (source address local to
// the node) over TCP to an enrolled pod's address, as kubelet's probes do,
// are source-NAT'd to the host-probe address, which the pod rules let
// through to the application. The enrolled addresses are two nftables sets
// (probe4, probe6), replaced whole on each ApplyNode. Traffic routed through
// the node between pods keeps its source.
//
//	set probe4 { type ipv4_addr }  set probe6 { type ipv6_addr }
//	chain postrouting { type nat hook postrouting priority srcnat
//	  meta l4proto tcp ip daddr @probe4 fib saddr type local snat to 169.254.7.127
//	  meta l4proto tcp ip6 daddr @probe6 fib saddr type local snat to fd16:9254:7127:1337:ffff:ffff:ffff:ffff
//	}
//	chain antispoof { type filter hook prerouting priority raw
//	  iif != lo ip saddr 169.254.7.127 counter drop
//	  iif != lo ip6 saddr fd16:9254:7127:1337:ffff:ffff:ffff:ffff counter drop
//	}
//
// Because the pod rules trust the probe source, nobody else may send from
// it: the node's SNAT acts on packets it sends, at postrouting, so a packet
// ARRIVING with a probe source (from another pod, or a host on the
// network) is forged, and antispoof drops it before conntrack sees it.
// Pods on one Linux bridge reach each other at layer 2 without the inet
// hooks (unless br_netfilter is loaded), so table bridge
// "isthmus-node-bridge" holds the same drop for bridged frames (frames the
// node itself sends through the bridge do not pass its prerouting):
//
//	chain antispoof { type filter hook prerouting priority -300
//	  meta protocol ip ip saddr 169.254.7.127 counter drop
//	  meta protocol ip6 ip6 saddr fd16:9254:7127:1337:ffff:ffff:ffff:ffff counter drop
//	}
//
// ApplyNode writes both node tables in one transaction; RemoveNode removes
// both.
//
// Each Apply is one netlink transaction that adds, deletes and re-adds the
// table with its whole content, so it converges from any state (absent,
// current, stale) without ever leaving the namespace without rules. Remove
// deletes exactly that table and nothing else; removing an absent table is
// not an error.
package redirect
