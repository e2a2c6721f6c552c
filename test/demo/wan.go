//go:build linux

package demo

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

// The wan's forward filter, written over netlink (github.com/google/nftables):
//
//	table ip isthmus-demo-wan {
//	  set gateways { type ipv4_addr; elements = { <gateway addresses> } }
//	  chain forward { type filter hook forward priority filter
//	    ip daddr @gateways accept
//	    ip saddr @gateways accept
//	    counter reject with icmp admin-prohibited
//	  }
//	}
//
// Everything else one network sends to another is refused at once, so a
// connection to a pod of another network fails with "no route to host"
// instead of waiting for a timeout, and the counter shows the filter did it.
const (
	wanTable = "isthmus-demo-wan"
	wanChain = "forward"
	wanSet   = "gateways"
)

// icmpAdminProhibited is ICMP destination unreachable code 13,
// "communication administratively prohibited".
const icmpAdminProhibited = 13

func applyWANFilter(wan *os.File, gateways []netip.Addr) error {
	c, err := nftables.New(nftables.WithNetNSFd(int(wan.Fd())))
	if err != nil {
		return fmt.Errorf("wan filter: %w", err)
	}
	t := c.AddTable(&nftables.Table{Name: wanTable, Family: nftables.TableFamilyIPv4})
	set := &nftables.Set{Table: t, Name: wanSet, KeyType: nftables.TypeIPAddr}
	elems := make([]nftables.SetElement, 0, len(gateways))
	for _, g := range gateways {
		elems = append(elems, nftables.SetElement{Key: g.AsSlice()})
	}
	if err := c.AddSet(set, elems); err != nil {
		return fmt.Errorf("wan filter set: %w", err)
	}
	accept := nftables.ChainPolicyAccept
	ch := c.AddChain(&nftables.Chain{Name: wanChain, Table: t, Type: nftables.ChainTypeFilter,
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
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4}, // ip daddr
		&expr.Lookup{SourceRegister: 1, SetName: set.Name, SetID: set.ID},
		&expr.Verdict{Kind: expr.VerdictAccept},
	}})
	c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: []expr.Any{
		&expr.Counter{},
		&expr.Reject{Type: unix.NFT_REJECT_ICMP_UNREACH, Code: icmpAdminProhibited},
	}})
	err = c.Flush()
	runtime.KeepAlive(wan)
	if err != nil {
		return fmt.Errorf("wan filter: %w", err)
	}
	return nil
}

// wanRejected reads how many packets the wan's filter has refused.
func wanRejected(wan *os.File) (uint64, error) {
	c, err := nftables.New(nftables.WithNetNSFd(int(wan.Fd())))
	if err != nil {
		return 0, err
	}
	defer runtime.KeepAlive(wan)
	t := &nftables.Table{Name: wanTable, Family: nftables.TableFamilyIPv4}
	rules, err := c.GetRules(t, &nftables.Chain{Name: wanChain, Table: t})
	if err != nil {
		return 0, fmt.Errorf("wan filter rules: %w", err)
	}
	for _, r := range rules {
		for _, e := range r.Exprs {
			if ctr, ok := e.(*expr.Counter); ok {
				return ctr.Packets, nil
			}
		}
	}
	return 0, fmt.Errorf("wan filter: no counter rule")
}
