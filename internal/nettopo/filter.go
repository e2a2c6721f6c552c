//go:build linux

package nettopo

import (
	"fmt"
	"net/netip"
	"os"
	"runtime"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// A pass filter is a forward filter in one namespace (a wan joining
// networks) that lets through only what was passed, written over netlink
// (github.com/google/nftables):
//
//	table ip <table> {
//	  chain forward { type filter hook forward priority filter; policy accept
//	    ip daddr <addr> accept                          # PassAddr, one rule each
//	    meta l4proto tcp ip daddr <addr> tcp dport <port> accept   # PassAddrPort
//	    ct state established,related accept
//	    counter reject with icmp admin-prohibited
//	  }
//	}
//
// Everything else is refused at once, so a connection across it fails with
// "no route to host" instead of waiting for a timeout, and the counter
// (Rejected) shows the filter did it. Passes are inserted at the head of the
// chain, so they can be added while traffic flows. IPv4 only.
const passChain = "forward"

// icmpAdminProhibited is ICMP destination unreachable code 13,
// "communication administratively prohibited".
const icmpAdminProhibited = 13

// NewPassFilter writes the table (named table) of a pass filter that passes
// nothing yet but replies of established connections into ns.
func NewPassFilter(ns *os.File, table string) error {
	return withNFT(ns, func(c *nftables.Conn) error {
		t := c.AddTable(&nftables.Table{Name: table, Family: nftables.TableFamilyIPv4})
		accept := nftables.ChainPolicyAccept
		ch := c.AddChain(&nftables.Chain{Name: passChain, Table: t, Type: nftables.ChainTypeFilter,
			Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter, Policy: &accept})
		zero := []byte{0, 0, 0, 0}
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: []expr.Any{
			&expr.Ct{Register: 1, Key: expr.CtKeySTATE},
			&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
				Mask: binaryutil.NativeEndian.PutUint32(expr.CtStateBitESTABLISHED | expr.CtStateBitRELATED), Xor: zero},
			&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: zero},
			&expr.Verdict{Kind: expr.VerdictAccept},
		}})
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: []expr.Any{
			&expr.Counter{},
			&expr.Reject{Type: unix.NFT_REJECT_ICMP_UNREACH, Code: icmpAdminProhibited},
		}})
		return nil
	})
}

// PassAddr lets every packet to addr through the pass filter table in ns.
func PassAddr(ns *os.File, table string, addr netip.Addr) error {
	if !addr.Is4() {
		return fmt.Errorf("nettopo: pass filter: %s is not an IPv4 address", addr)
	}
	return insertPass(ns, table, []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4}, // ip daddr
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: addr.AsSlice()},
		&expr.Verdict{Kind: expr.VerdictAccept},
	})
}

// PassAddrPort lets TCP connections to ap through the pass filter table in
// ns (their replies pass as established).
func PassAddrPort(ns *os.File, table string, ap netip.AddrPort) error {
	if !ap.Addr().Is4() || ap.Port() == 0 {
		return fmt.Errorf("nettopo: pass filter: %s is not an IPv4 address and port", ap)
	}
	return insertPass(ns, table, []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4}, // ip daddr
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: ap.Addr().AsSlice()},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2}, // tcp dport
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(ap.Port())},
		&expr.Verdict{Kind: expr.VerdictAccept},
	})
}

func insertPass(ns *os.File, table string, exprs []expr.Any) error {
	return withNFT(ns, func(c *nftables.Conn) error {
		t := &nftables.Table{Name: table, Family: nftables.TableFamilyIPv4}
		c.InsertRule(&nftables.Rule{Table: t, Chain: &nftables.Chain{Name: passChain, Table: t}, Exprs: exprs})
		return nil
	})
}

// Rejected reads how many packets the pass filter table in ns has refused.
func Rejected(ns *os.File, table string) (uint64, error) {
	c, err := nftables.New(nftables.WithNetNSFd(int(ns.Fd())))
	if err != nil {
		return 0, fmt.Errorf("nettopo: pass filter %s: %w", table, err)
	}
	defer runtime.KeepAlive(ns)
	t := &nftables.Table{Name: table, Family: nftables.TableFamilyIPv4}
	rules, err := c.GetRules(t, &nftables.Chain{Name: passChain, Table: t})
	if err != nil {
		return 0, fmt.Errorf("nettopo: pass filter %s rules: %w", table, err)
	}
	for _, r := range rules {
		for _, e := range r.Exprs {
			if ctr, ok := e.(*expr.Counter); ok {
				return ctr.Packets, nil
			}
		}
	}
	return 0, fmt.Errorf("nettopo: pass filter %s: no counter rule", table)
}

// withNFT runs fn on a netlink connection to ns's nftables and flushes
// what it queued as one batch.
func withNFT(ns *os.File, fn func(c *nftables.Conn) error) error {
	c, err := nftables.New(nftables.WithNetNSFd(int(ns.Fd())))
	if err != nil {
		return fmt.Errorf("nettopo: nftables in %s: %w", ns.Name(), err)
	}
	if err := fn(c); err != nil {
		return err
	}
	err = c.Flush()
	runtime.KeepAlive(ns)
	if err != nil {
		return fmt.Errorf("nettopo: nftables in %s: %w", ns.Name(), err)
	}
	return nil
}
