package proxy

import (
	"fmt"
	"net"
	"net/netip"
	"slices"
	"sync"

	"github.com/isthmus-mesh/isthmus/ztunnel/hbone"
)

// SelfConfig says what is ztunnel itself besides the listeners a Self
// records as they open.
type SelfConfig struct {
	// NodeIPs are the node's addresses: ztunnel, whatever the port.
	NodeIPs []netip.Addr
	// Local reports whether an address other than loopback is local to the
	// network namespace of the recorded listeners: for an in-pod proxy, the
	// pod's own addresses. Nil: loopback only (a node's namespace, whose
	// own addresses are NodeIPs).
	Local func(netip.Addr) bool
	// Ports are ztunnel's on every local address (loopback and Local),
	// whether or not a listener is recorded on them: for an in-pod proxy
	// 15001, 15006, 15008 and 15053.
	Ports []uint16
	// HBONEPort is, among Ports, the one HBONE hops are meant to reach (see
	// CheckTunnel).
	HBONEPort uint16
}

// Self knows every address that is ztunnel itself: the node's addresses
// (any port), ztunnel's listeners (recorded as they open, dropped as they
// close) and, for an in-pod proxy, the pod's own addresses at ztunnel's
// in-pod ports. A connection ztunnel made to any of them would come back
// into ztunnel, which would dial again for it: one client connection would
// turn into connections without end. Every dial path asks Check (or, for
// the hop of an HBONE tunnel, CheckTunnel) before it dials. One Self is
// shared by the proxies of one namespace (the node's, or one pod's). Safe
// for concurrent use.
type Self struct {
	cfg SelfConfig

	mu  sync.RWMutex
	lns map[netip.AddrPort]bool // ztunnel's listeners; true: an HBONE one
}

// NewSelf returns a Self recording no listener yet.
func NewSelf(cfg SelfConfig) *Self {
	return &Self{cfg: cfg, lns: map[netip.AddrPort]bool{}}
}

// Add records addr as one of ztunnel's listeners.
func (s *Self) Add(addr net.Addr) { s.add(addr, false) }

// AddHBONE records addr as one of ztunnel's HBONE listeners: CheckTunnel
// lets HBONE hops reach it.
func (s *Self) AddHBONE(addr net.Addr) { s.add(addr, true) }

func (s *Self) add(addr net.Addr, hboneLn bool) {
	ap, ok := hbone.AddrPortOf(addr)
	if !ok {
		return
	}
	s.mu.Lock()
	s.lns[netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())] = hboneLn
	s.mu.Unlock()
}

// Remove forgets a listener recorded by Add or AddHBONE (it was closed).
func (s *Self) Remove(addr net.Addr) {
	ap, ok := hbone.AddrPortOf(addr)
	if !ok {
		return
	}
	s.mu.Lock()
	delete(s.lns, netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()))
	s.mu.Unlock()
}

// Is reports whether a connection to ap would reach this node or ztunnel:
// a node address, a listener's address, a local address (loopback, or
// SelfConfig.Local) with the port of a listener bound to all addresses, or
// a local address with one of SelfConfig.Ports.
func (s *Self) Is(ap netip.AddrPort) bool {
	_, self := s.match(ap)
	return self
}

// match reports whether ap is ztunnel and, if so, whether it is only as an
// HBONE listener.
func (s *Self) match(ap netip.AddrPort) (hboneOnly, self bool) {
	a, port := ap.Addr().Unmap(), ap.Port()
	if !a.IsValid() {
		return false, false
	}
	if slices.Contains(s.cfg.NodeIPs, a) {
		return false, true
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	if h, ok := s.lns[netip.AddrPortFrom(a, port)]; ok {
		return h, true
	}
	local := a.IsLoopback() || a.IsUnspecified() || (s.cfg.Local != nil && s.cfg.Local(a))
	if !local {
		return false, false
	}
	for _, any := range []netip.Addr{netip.IPv4Unspecified(), netip.IPv6Unspecified()} {
		if h, ok := s.lns[netip.AddrPortFrom(any, port)]; ok {
			return h, true
		}
	}
	if slices.Contains(s.cfg.Ports, port) {
		return port == s.cfg.HBONEPort, true
	}
	return false, false
}

// Check refuses (ErrSelfDestination) a destination that is this node or
// ztunnel itself: what a client connection is finally connected to (an
// application's address, the CONNECT target of a tunnel).
func (s *Self) Check(ap netip.AddrPort) error {
	if s.Is(ap) {
		return fmt.Errorf("%w: %s", ErrSelfDestination, ap)
	}
	return nil
}

// CheckTunnel is Check for the hop of an HBONE tunnel, which is meant to
// reach an HBONE listener, possibly ztunnel's own (a pod reaching its own
// service, a node's workloads reaching each other): that listener checks
// the tunnel's CONNECT target in turn. Every other part of ztunnel, and the
// node's addresses, are refused.
func (s *Self) CheckTunnel(ap netip.AddrPort) error {
	if hboneOnly, self := s.match(ap); self && !hboneOnly {
		return fmt.Errorf("%w: %s", ErrSelfDestination, ap)
	}
	return nil
}
