package state

import (
	"cmp"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
)

// ErrNoEndpoint is returned when a service has no ready endpoint for a port.
var ErrNoEndpoint = errors.New("no ready endpoint")

// Source describes the client side of a connection for endpoint selection.
type Source struct {
	Network  string
	Cluster  string
	Node     string
	Locality Locality
	// Relay is set when the source forwards for a client elsewhere (an
	// east-west gateway): a STRICT preference is that client's to apply,
	// so here it ranks as FAILOVER.
	Relay bool
}

// SourceOf returns the selection source for workload w.
func SourceOf(w *Workload) Source {
	return Source{Network: w.Network, Cluster: w.Cluster, Node: w.Node, Locality: w.Locality}
}

// Endpoint is a chosen destination for a service port.
type Endpoint struct {
	// Workload is the chosen workload; it may be synthetic (no address,
	// reached through Workload.Gateway).
	Workload *Workload
	// TargetPort is the workload port for the requested service port.
	TargetPort uint16
}

// Selector picks endpoints. The zero value uses math/rand/v2.
type Selector struct {
	// Rand returns a uniform integer in [0, n); nil means rand.Uint64N.
	Rand func(n uint64) uint64
}

// Select chooses an endpoint of svc for port as seen from src. Only ready
// workloads qualify. Among them it prefers those of the best tier (see
// score) and picks one at random weighted by capacity. By default the tiers
// are, in order, the same network (synthetic workloads count for the
// remote network they stand for), the same cluster, then the same region,
// zone and subzone; a service's LoadBalancing replaces them.
func (sel Selector) Select(snap *Snapshot, svc *Service, port uint16, src Source) (Endpoint, error) {
	return sel.SelectWhere(snap, svc, port, src, nil)
}

// SelectWhere is Select among the workloads keep accepts (all when nil).
func (sel Selector) SelectWhere(snap *Snapshot, svc *Service, port uint16, src Source, keep func(*Workload) bool) (Endpoint, error) {
	if !svc.HasPort(port) {
		return Endpoint{}, fmt.Errorf("service %s has no port %d: %w", svc.Hostname, port, ErrNoEndpoint)
	}
	key := svc.Key()
	var (
		best      []Endpoint
		bestScore = -1
		total     uint64
	)
	for _, w := range snap.Endpoints(key) {
		if w.Status != StatusReady || (keep != nil && !keep(w)) {
			continue
		}
		if len(w.Addresses) == 0 && len(w.Gateways) == 0 {
			continue
		}
		tp, ok := w.TargetPort(key, port)
		if !ok {
			continue
		}
		sc, ok := score(w, src, svc.LoadBalancing)
		if !ok {
			continue
		}
		switch {
		case sc > bestScore:
			best, bestScore, total = best[:0], sc, 0
		case sc < bestScore:
			continue
		}
		best = append(best, Endpoint{Workload: w, TargetPort: tp})
		total += w.Weight()
	}
	if len(best) == 0 {
		return Endpoint{}, fmt.Errorf("service %s port %d: %w", svc.Hostname, port, ErrNoEndpoint)
	}
	rnd := sel.Rand
	if rnd == nil {
		rnd = rand.Uint64N
	}
	pick := rnd(total)
	for _, ep := range best {
		if pick < ep.Workload.Weight() {
			return ep, nil
		}
		pick -= ep.Workload.Weight()
	}
	return best[len(best)-1], nil
}

// score ranks w for src under preference lb; higher is better, and ok is
// false when lb is STRICT and w does not match all of it. Without a
// preference (nil) it is rank. With one it is the number of leading scopes
// of lb.Preference that w shares with src: a workload in the client's zone
// under [NETWORK, CLUSTER, REGION, ZONE] scores 4, one elsewhere in its
// region 3, and so on. A scope the client does not know (an empty zone,
// node or cluster) matches nothing.
func score(w *Workload, src Source, lb *LoadBalancing) (n int, ok bool) {
	if lb == nil {
		return rank(w, src), true
	}
	for _, sc := range lb.Preference {
		if !shares(sc, w, src) {
			break
		}
		n++
	}
	if lb.Strict && !src.Relay && n < len(lb.Preference) {
		return 0, false
	}
	return n, true
}

// shares reports whether w and src have the same value of scope sc.
func shares(sc Scope, w *Workload, src Source) bool {
	l, s := w.Locality, src.Locality
	switch sc {
	case ScopeNetwork:
		return w.Network == src.Network
	case ScopeCluster:
		return src.Cluster != "" && w.Cluster == src.Cluster
	case ScopeRegion:
		return s.Region != "" && l.Region == s.Region
	case ScopeZone:
		return s.Zone != "" && l.Zone == s.Zone
	case ScopeSubzone:
		return s.Subzone != "" && l.Subzone == s.Subzone
	case ScopeNode:
		return src.Node != "" && w.Node == src.Node
	}
	return false
}

// rank scores w for src; higher is better. Bits, most significant first:
// same network, same cluster, same region, same zone, same subzone.
func rank(w *Workload, src Source) int {
	score := 0
	if w.Network == src.Network {
		score |= 1 << 4
	}
	if w.Cluster == src.Cluster && src.Cluster != "" {
		score |= 1 << 3
	}
	l, s := w.Locality, src.Locality
	if s.Region != "" && l.Region == s.Region {
		score |= 1 << 2
		if s.Zone != "" && l.Zone == s.Zone {
			score |= 1 << 1
			if s.Subzone != "" && l.Subzone == s.Subzone {
				score |= 1
			}
		}
	}
	return score
}

// Rank returns every endpoint of svc for port that keep accepts (all when
// nil), in the order to try them: the tiers of Select's preference (by
// default same network, cluster, region, zone, subzone; else the service's
// LoadBalancing, whose STRICT mode leaves out the endpoints that do not
// match it all), best first, each in a random order weighted by capacity.
// A client tries the next when one cannot be reached.
func (sel Selector) Rank(snap *Snapshot, svc *Service, port uint16, src Source, keep func(*Workload) bool) ([]Endpoint, error) {
	if !svc.HasPort(port) {
		return nil, fmt.Errorf("service %s has no port %d: %w", svc.Hostname, port, ErrNoEndpoint)
	}
	key := svc.Key()
	type ranked struct {
		ep    Endpoint
		score int
	}
	var all []ranked
	for _, w := range snap.Endpoints(key) {
		if w.Status != StatusReady || (keep != nil && !keep(w)) || (len(w.Addresses) == 0 && len(w.Gateways) == 0) {
			continue
		}
		tp, ok := w.TargetPort(key, port)
		if !ok {
			continue
		}
		sc, ok := score(w, src, svc.LoadBalancing)
		if !ok {
			continue
		}
		all = append(all, ranked{Endpoint{Workload: w, TargetPort: tp}, sc})
	}
	if len(all) == 0 {
		return nil, fmt.Errorf("service %s port %d: %w", svc.Hostname, port, ErrNoEndpoint)
	}
	slices.SortStableFunc(all, func(a, b ranked) int { return cmp.Compare(b.score, a.score) })
	rnd := sel.Rand
	if rnd == nil {
		rnd = rand.Uint64N
	}
	out := make([]Endpoint, 0, len(all))
	for start := 0; start < len(all); {
		end := start
		for end < len(all) && all[end].score == all[start].score {
			end++
		}
		tier := make([]Endpoint, 0, end-start)
		for _, r := range all[start:end] {
			tier = append(tier, r.ep)
		}
		out = append(out, WeightedOrder(tier, func(e Endpoint) uint64 { return e.Workload.Weight() }, rnd)...)
		start = end
	}
	return out, nil
}

// WeightedOrder returns items in a random order in which each next item is
// drawn with probability proportional to its weight (at least 1) among
// those left. rnd returns a uniform integer in [0, n).
func WeightedOrder[T any](items []T, weight func(T) uint64, rnd func(n uint64) uint64) []T {
	rest := slices.Clone(items)
	out := make([]T, 0, len(rest))
	for len(rest) > 0 {
		var total uint64
		for _, it := range rest {
			total += max(weight(it), 1)
		}
		pick := rnd(total)
		i := 0
		for ; i < len(rest)-1; i++ {
			w := max(weight(rest[i]), 1)
			if pick < w {
				break
			}
			pick -= w
		}
		out = append(out, rest[i])
		rest = slices.Delete(rest, i, i+1)
	}
	return out
}
