package vip

import (
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"maps"
	"math/big"
	"net/netip"
	"slices"
	"time"
)

// tableVersion is the format of the persisted table.
const tableVersion = 1

// entry is one hostname's allocation. Freed, when set, is when the
// hostname stopped being asked for; its addresses stay reserved for the
// grace period after it.
type entry struct {
	V4    netip.Addr `json:"v4,omitzero"`
	V6    netip.Addr `json:"v6,omitzero"`
	Freed *time.Time `json:"freed,omitempty"`
}

// table is the allocation table, by hostname. Values are never modified
// after publication: plan works on a copy.
type table map[string]entry

type persisted struct {
	Version int   `json:"version"`
	Entries table `json:"entries"`
}

// ErrMalformed marks a persisted table that cannot be read; nothing is
// written over it.
var ErrMalformed = errors.New("malformed allocation table")

// ErrExhausted marks a range with no free address.
var ErrExhausted = errors.New("address range exhausted")

// decode parses a persisted table and checks that no address is given to
// two hostnames.
func decode(b []byte) (table, error) {
	var p persisted
	if err := json.Unmarshal(b, &p); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrMalformed, err)
	}
	if p.Version != tableVersion {
		return nil, fmt.Errorf("%w: version %d, want %d", ErrMalformed, p.Version, tableVersion)
	}
	owner := map[netip.Addr]string{}
	for _, h := range slices.Sorted(maps.Keys(p.Entries)) {
		e := p.Entries[h]
		for _, a := range []netip.Addr{e.V4, e.V6} {
			if !a.IsValid() {
				continue
			}
			if o, dup := owner[a]; dup {
				return nil, fmt.Errorf("%w: address %s given to both %s and %s", ErrMalformed, a, o, h)
			}
			owner[a] = h
		}
		if (e.V4.IsValid() && !e.V4.Is4()) || (e.V6.IsValid() && (!e.V6.Is6() || e.V6.Is4In6())) {
			return nil, fmt.Errorf("%w: %s: address of the wrong family", ErrMalformed, h)
		}
	}
	if p.Entries == nil {
		p.Entries = table{}
	}
	return p.Entries, nil
}

func (t table) encode() ([]byte, error) {
	return json.Marshal(persisted{Version: tableVersion, Entries: t})
}

// pool is one family's range: slots 0..n-1 map to addresses after the
// range's first one (the first and last are left out for ranges larger
// than /31 or /127, as they read like network and broadcast addresses).
type pool struct {
	prefix netip.Prefix
	first  *big.Int
	n      uint64
}

func newPool(p netip.Prefix) pool {
	p = p.Masked()
	hostBits := p.Addr().BitLen() - p.Bits()
	size := uint64(1) << min(hostBits, 62)
	pl := pool{prefix: p, first: new(big.Int).SetBytes(p.Addr().AsSlice()), n: size}
	if hostBits > 1 {
		pl.first.Add(pl.first, big.NewInt(1))
		if hostBits <= 62 {
			pl.n = size - 2
		} else {
			pl.n = size - 1
		}
	}
	return pl
}

func (p pool) addr(slot uint64) netip.Addr {
	v := new(big.Int).Add(p.first, new(big.Int).SetUint64(slot))
	b := make([]byte, p.prefix.Addr().BitLen()/8)
	v.FillBytes(b)
	a, _ := netip.AddrFromSlice(b)
	return a
}

// contains reports whether a is an address the pool hands out.
func (p pool) contains(a netip.Addr) bool {
	if !a.IsValid() || !p.prefix.Contains(a) {
		return false
	}
	off := new(big.Int).Sub(new(big.Int).SetBytes(a.AsSlice()), p.first)
	return off.Sign() >= 0 && off.Cmp(new(big.Int).SetUint64(p.n)) < 0
}

// preferred is the slot a hostname tries first: FNV-1a of the hostname
// (salted per family, so the two families probe independently).
func preferred(host string, family byte, n uint64) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte{family})
	_, _ = h.Write([]byte(host))
	return h.Sum64() % n
}

// allocate returns the first free address from host's preferred slot on,
// probing linearly.
func (p pool) allocate(host string, family byte, used map[netip.Addr]bool) (netip.Addr, bool) {
	start := preferred(host, family, p.n)
	// Probing visits every slot only in small ranges; in a large one the
	// number of used addresses bounds the probes.
	limit := min(p.n, uint64(len(used))+1)
	for i := range limit {
		a := p.addr((start + i) % p.n)
		if !used[a] {
			return a, true
		}
	}
	return netip.Addr{}, false
}

// plan returns the table after asking for exactly hosts at now: new
// hostnames get addresses, hostnames no longer asked for are marked freed,
// freed entries older than grace are dropped, and addresses outside the
// pools are replaced. It is a pure function of its inputs, so replicas that
// read the same table agree. Hostnames that could not get an address are
// reported in the error (ErrExhausted); the rest of the plan stands.
func plan(old table, hosts []string, now time.Time, grace time.Duration, v4, v6 pool) (table, error) {
	want := make(map[string]bool, len(hosts))
	for _, h := range hosts {
		want[h] = true
	}
	next := make(table, len(old)+len(hosts))
	used := map[netip.Addr]bool{}
	for h, e := range old {
		switch {
		case want[h]:
			e.Freed = nil
		case e.Freed == nil:
			t := now.UTC()
			e.Freed = &t
		case now.Sub(*e.Freed) >= grace:
			continue // reserved long enough: reusable
		}
		if !v4.contains(e.V4) {
			e.V4 = netip.Addr{}
		}
		if !v6.contains(e.V6) {
			e.V6 = netip.Addr{}
		}
		used[e.V4], used[e.V6] = e.V4.IsValid(), e.V6.IsValid()
		next[h] = e
	}
	delete(used, netip.Addr{})
	var short []string
	for _, h := range slices.Sorted(maps.Keys(want)) {
		e := next[h]
		ok4, ok6 := true, true
		if !e.V4.IsValid() {
			if e.V4, ok4 = v4.allocate(h, 4, used); ok4 {
				used[e.V4] = true
			}
		}
		if !e.V6.IsValid() {
			if e.V6, ok6 = v6.allocate(h, 6, used); ok6 {
				used[e.V6] = true
			}
		}
		if !ok4 {
			short = append(short, fmt.Sprintf("%s (IPv4 %s)", h, v4.prefix))
		}
		if !ok6 {
			short = append(short, fmt.Sprintf("%s (IPv6 %s)", h, v6.prefix))
		}
		next[h] = e
	}
	if len(short) > 0 {
		return next, fmt.Errorf("%w: every address is allocated or reserved for the grace period; no address for %d hostname(s): %v",
			ErrExhausted, len(short), short)
	}
	return next, nil
}
