//go:build linux

package redirect

import (
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"slices"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// Names of the node table's sets of enrolled pod addresses.
const (
	probeSet4 = "probe4"
	probeSet6 = "probe6"
)

// ApplyNode installs the node's probe rules in ns (nil: the caller's
// namespace, the node's for a hostNetwork agent) with pods as the enrolled
// addresses, replacing the table in one transaction. An empty pods keeps
// the table with empty sets.
func ApplyNode(ns *os.File, pods []netip.Addr) error {
	c, err := conn(ns)
	if err != nil {
		return fmt.Errorf("redirect: nftables in %s: %w", nsName(ns), err)
	}
	t := replaceTable(c, NodeTable)
	s4 := &nftables.Set{Table: t, Name: probeSet4, KeyType: nftables.TypeIPAddr}
	s6 := &nftables.Set{Table: t, Name: probeSet6, KeyType: nftables.TypeIP6Addr}
	var e4, e6 []nftables.SetElement
	for _, a := range pods {
		a = a.Unmap()
		if a.Is4() {
			e4 = append(e4, nftables.SetElement{Key: a.AsSlice()})
		} else if a.Is6() {
			e6 = append(e6, nftables.SetElement{Key: a.AsSlice()})
		}
	}
	if err := c.AddSet(s4, e4); err != nil {
		return fmt.Errorf("redirect: set %s: %w", probeSet4, err)
	}
	if err := c.AddSet(s6, e6); err != nil {
		return fmt.Errorf("redirect: set %s: %w", probeSet6, err)
	}
	post := c.AddChain(&nftables.Chain{Name: "postrouting", Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource})
	for _, r := range probeRules() {
		c.AddRule(&nftables.Rule{Table: t, Chain: post, Exprs: r})
	}
	err = c.Flush()
	runtime.KeepAlive(ns)
	if err != nil {
		return fmt.Errorf("redirect: apply node rules in %s: %w", nsName(ns), err)
	}
	return nil
}

func probeRules() [][]expr.Any {
	return [][]expr.Any{
		concat(nfproto(unix.NFPROTO_IPV4), l4proto(unix.IPPROTO_TCP), lookup(false, false, probeSet4),
			saddrLocal(), snatTo(ProbeAddr4)),
		concat(nfproto(unix.NFPROTO_IPV6), l4proto(unix.IPPROTO_TCP), lookup(false, true, probeSet6),
			saddrLocal(), snatTo(ProbeAddr6)),
	}
}

// RemoveNode deletes NodeTable from ns. An absent table is not an error.
func RemoveNode(ns *os.File) error {
	return removeTable(ns, NodeTable)
}

// NodeAddrs returns the enrolled addresses in the node table of ns, sorted
// (none when the table is absent).
func NodeAddrs(ns *os.File) ([]netip.Addr, error) {
	ok, err := hasTable(ns, NodeTable)
	if err != nil || !ok {
		return nil, err
	}
	c, err := conn(ns)
	if err != nil {
		return nil, err
	}
	defer runtime.KeepAlive(ns)
	t := inetTable(NodeTable)
	var out []netip.Addr
	for _, name := range []string{probeSet4, probeSet6} {
		s, err := c.GetSetByName(t, name)
		if err != nil {
			return nil, fmt.Errorf("redirect: set %s: %w", name, err)
		}
		elems, err := c.GetSetElements(s)
		if err != nil {
			return nil, fmt.Errorf("redirect: elements of %s: %w", name, err)
		}
		for _, e := range elems {
			if a, ok := netip.AddrFromSlice(e.Key); ok {
				out = append(out, a)
			}
		}
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return out, nil
}
