//go:build linux

package redirect

import (
	"net/netip"

	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// Small builders for the expressions the rules are made of. Every matcher
// loads into register 1 and compares; a rule is a list of matchers followed
// by an action.

func metaEq(key expr.MetaKey, data []byte) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: key, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: data},
	}
}

func nfproto(family byte) []expr.Any { return metaEq(expr.MetaKeyNFPROTO, []byte{family}) }

func l4proto(proto byte) []expr.Any { return metaEq(expr.MetaKeyL4PROTO, []byte{proto}) }

// ifIndex matches the input (in=true) or output interface index.
func ifIndex(in bool, index uint32) []expr.Any {
	key := expr.MetaKeyOIF
	if in {
		key = expr.MetaKeyIIF
	}
	return metaEq(key, binaryutil.NativeEndian.PutUint32(index))
}

// dport matches the transport destination port (after an l4proto match).
func dport(port uint16) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(port)},
	}
}

// addrOffsets are the network header offsets of the source and destination
// addresses for IPv4 and IPv6.
func addrOffset(v6, src bool) uint32 {
	switch {
	case v6 && src:
		return 8
	case v6:
		return 24
	case src:
		return 12
	default:
		return 16
	}
}

// addrIn matches the source (src) or destination address against prefix p,
// including the family check an inet table needs.
func addrIn(src bool, p netip.Prefix) []expr.Any {
	p = p.Masked()
	v6 := p.Addr().Is6()
	fam := byte(unix.NFPROTO_IPV4)
	size := uint32(4)
	if v6 {
		fam, size = unix.NFPROTO_IPV6, 16
	}
	out := nfproto(fam)
	out = append(out, &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: addrOffset(v6, src), Len: size})
	if p.Bits() < int(size*8) {
		mask := netip.PrefixFrom(p.Addr(), p.Bits())
		out = append(out, &expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: size,
			Mask: prefixMask(mask), Xor: make([]byte, size)})
	}
	return append(out, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: p.Addr().AsSlice()})
}

func prefixMask(p netip.Prefix) []byte {
	n := p.Addr().BitLen() / 8
	m := make([]byte, n)
	for i := 0; i < p.Bits(); i++ {
		m[i/8] |= 0x80 >> (i % 8)
	}
	return m
}

// markEq matches (meta mark & mask) == mark.
func markEq(mark, mask uint32) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyMARK, Register: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
			Mask: binaryutil.NativeEndian.PutUint32(mask), Xor: binaryutil.NativeEndian.PutUint32(0)},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(mark)},
	}
}

// socketCgroupIn matches packets whose socket's cgroup v2 ancestor at level
// (counted from the root of the rule writer's cgroup namespace) has an id
// in set. A packet without a full socket, or whose socket's cgroup is
// shallower than level, does not match.
func socketCgroupIn(level uint32, set string) []expr.Any {
	return []expr.Any{
		&expr.Socket{Key: expr.SocketKeyCgroupv2, Level: level, Register: 1},
		&expr.Lookup{SourceRegister: 1, SetName: set},
	}
}

// natProtoSpecified is NF_NAT_RANGE_PROTO_SPECIFIED: the port is given.
const natProtoSpecified = 0x2

func ret() expr.Any { return &expr.Verdict{Kind: expr.VerdictReturn} }

// redirectTo redirects to port on the local host (REDIRECT).
func redirectTo(port uint16) []expr.Any {
	return []expr.Any{
		&expr.Immediate{Register: 1, Data: binaryutil.BigEndian.PutUint16(port)},
		&expr.Redir{RegisterProtoMin: 1, Flags: natProtoSpecified},
	}
}

// lookup matches the source (src) or destination address against a set
// (after the family match).
func lookup(src, v6 bool, set string) []expr.Any {
	size := uint32(4)
	if v6 {
		size = 16
	}
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: addrOffset(v6, src), Len: size},
		&expr.Lookup{SourceRegister: 1, SetName: set},
	}
}

// saddrLocal matches packets whose source address is an address of this
// namespace (fib saddr type local): what the node itself sends.
func saddrLocal() []expr.Any {
	return []expr.Any{
		&expr.Fib{Register: 1, ResultADDRTYPE: true, FlagSADDR: true},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(unix.RTN_LOCAL)},
	}
}

// snatTo source-NATs to addr (the family must have been matched).
func snatTo(addr netip.Addr) []expr.Any {
	fam := uint32(unix.NFPROTO_IPV4)
	if addr.Is6() {
		fam = unix.NFPROTO_IPV6
	}
	return []expr.Any{
		&expr.Immediate{Register: 1, Data: addr.AsSlice()},
		&expr.NAT{Type: expr.NATTypeSourceNAT, Family: fam, RegAddrMin: 1},
	}
}

func concat(parts ...[]expr.Any) []expr.Any {
	var out []expr.Any
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}
