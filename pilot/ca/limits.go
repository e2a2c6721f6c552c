package ca

import (
	"net"
	"net/netip"
	"sync"
	"time"

	"golang.org/x/time/rate"
	"k8s.io/utils/lru"
)

// limiterSet is a bounded set of token buckets, one per key (a source address, a
// ServiceAccount, a cluster), all with one rate and burst. When more than size keys are live,
// the least recently used bucket is dropped: memory stays bounded under a flood of distinct
// keys, and a dropped key starts again with a full bucket, as a new key would. Safe for
// concurrent use.
type limiterSet struct {
	mu    sync.Mutex // makes get-or-create atomic
	cache *lru.Cache // key string -> *rate.Limiter
	limit rate.Limit
	burst int
}

func newLimiterSet(r float64, burst, size int) *limiterSet {
	return &limiterSet{cache: lru.New(size), limit: rate.Limit(r), burst: burst}
}

// get returns key's bucket, creating it full.
func (s *limiterSet) get(key string) *rate.Limiter {
	s.mu.Lock()
	defer s.mu.Unlock()
	if v, ok := s.cache.Get(key); ok {
		return v.(*rate.Limiter)
	}
	l := rate.NewLimiter(s.limit, s.burst)
	s.cache.Add(key, l)
	return l
}

// len is the number of buckets held.
func (s *limiterSet) len() int { return s.cache.Len() }

// takeAll takes one token from each bucket, in order, or from none: it returns the index of
// the first bucket that is empty (and gives back what it took from the others), or -1.
func takeAll(now time.Time, buckets ...*rate.Limiter) int {
	var taken [4]*rate.Reservation
	for i, b := range buckets {
		r := b.ReserveN(now, 1)
		if !r.OK() || r.DelayFrom(now) > 0 {
			r.CancelAt(now)
			for _, t := range taken[:i] {
				t.CancelAt(now)
			}
			return i
		}
		taken[i] = r
	}
	return -1
}

// sourceKey is the key of a caller's address for the per-source limit: its IP, or its /64 for
// IPv6 (one host usually holds a whole /64), or "unknown" when there is none.
func sourceKey(addr net.Addr) string {
	var ip netip.Addr
	switch a := addr.(type) {
	case *net.TCPAddr:
		ip, _ = netip.AddrFromSlice(a.IP)
	case nil:
	default:
		if ap, err := netip.ParseAddrPort(a.String()); err == nil {
			ip = ap.Addr()
		}
	}
	if !ip.IsValid() {
		return "unknown"
	}
	ip = ip.Unmap()
	if ip.Is6() {
		p, _ := ip.Prefix(64)
		return p.String()
	}
	return ip.String()
}
