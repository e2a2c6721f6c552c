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
//	chain output { type nat hook output priority dstnat
//	  meta mark & 0xfff == 0x539 return        # ztunnel's own sockets (SO_MARK)
//	  oif lo return                            # loopback, and the pod's own addresses
//	  ip daddr <excluded> return               # e.g. the node's addresses
//	  udp dport 53 redirect to :15053          # only with Options.RedirectDNS
//	  tcp dport 53 redirect to :15053          # only with Options.RedirectDNS
//	  meta l4proto tcp redirect to :15001      # outbound TCP: ztunnel's outbound
//	}
//
// REDIRECT is destination NAT tracked by conntrack, so a listener reads a
// connection's original destination with SO_ORIGINAL_DST (IPv4) or
// IP6T_SO_ORIGINAL_DST (IPv6). Outbound connections are redirected to the
// loopback address of their family (127.0.0.1 or ::1), inbound ones to the
// pod's address on the interface they arrived on: ztunnel's in-pod listeners
// listen on the wildcard address ([::] dual-stack, or 0.0.0.0 and [::]).
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
// Each Apply is one netlink transaction that adds, deletes and re-adds the
// table with its whole content, so it converges from any state (absent,
// current, stale) without ever leaving the namespace without rules. Remove
// deletes exactly that table and nothing else; removing an absent table is
// not an error.
package redirect
