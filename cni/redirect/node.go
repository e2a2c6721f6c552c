//go:build linux

package redirect

import (
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"slices"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
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
	// Anti-spoof: a packet that arrives with a probe address as its source
	// was not made by the node's SNAT (which acts on packets the node
	// sends, after routing), so it is dropped before conntrack sees it.
	pre := c.AddChain(&nftables.Chain{Name: "antispoof", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityRaw})
	for _, r := range antiSpoofRules() {
		c.AddRule(&nftables.Rule{Table: t, Chain: pre, Exprs: r})
	}
	// The same for frames bridged between the node's pods (a CNI bridge):
	// they never reach the inet hooks unless br_netfilter is loaded.
	bt := c.AddTable(&nftables.Table{Name: NodeBridgeTable, Family: nftables.TableFamilyBridge})
	c.DelTable(bt)
	bt = c.AddTable(&nftables.Table{Name: NodeBridgeTable, Family: nftables.TableFamilyBridge})
	bpre := c.AddChain(&nftables.Chain{Name: "antispoof", Table: bt, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityRaw})
	for _, r := range bridgeAntiSpoofRules() {
		c.AddRule(&nftables.Rule{Table: bt, Chain: bpre, Exprs: r})
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

// antiSpoofRules drop packets arriving from outside the node (any
// interface but lo) with a probe address as their source.
func antiSpoofRules() [][]expr.Any {
	notLo := []expr.Any{
		&expr.Meta{Key: expr.MetaKeyIIF, Register: 1},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(loopbackIndex)},
	}
	return [][]expr.Any{
		concat(notLo, addrIn(true, netip.PrefixFrom(ProbeAddr4, 32)), counterDrop()),
		concat(notLo, addrIn(true, netip.PrefixFrom(ProbeAddr6, 128)), counterDrop()),
	}
}

// bridgeAntiSpoofRules drop bridged IPv4 and IPv6 frames with a probe
// address as their source.
func bridgeAntiSpoofRules() [][]expr.Any {
	etherType := func(t uint16) []expr.Any {
		return metaEq(expr.MetaKeyPROTOCOL, binaryutil.BigEndian.PutUint16(t))
	}
	src := func(a netip.Addr) []expr.Any {
		return []expr.Any{
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: addrOffset(a.Is6(), true), Len: uint32(a.BitLen() / 8)},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: a.AsSlice()},
		}
	}
	return [][]expr.Any{
		concat(etherType(unix.ETH_P_IP), src(ProbeAddr4), counterDrop()),
		concat(etherType(unix.ETH_P_IPV6), src(ProbeAddr6), counterDrop()),
	}
}

func counterDrop() []expr.Any {
	return []expr.Any{&expr.Counter{}, &expr.Verdict{Kind: expr.VerdictDrop}}
}

// RemoveNode deletes NodeTable and NodeBridgeTable from ns. Absent tables
// are not an error.
func RemoveNode(ns *os.File) error {
	if err := removeTable(ns, NodeTable); err != nil {
		return err
	}
	return removeTableOf(ns, nftables.TableFamilyBridge, NodeBridgeTable)
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
