//go:build linux

// Package inpodtest has a PodHandler for tests that does what ztunnel does
// with an enrolled pod's namespace, minus the proxying: it opens listeners
// (by default 15001, 15006 and 15008) inside the namespace, and each answers
// a connection with one line "<pod uid> <port>" and records where the
// connection came from and was going (its original destination).
package inpodtest

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/ztunnel/inpod"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
)

// Accepted is one connection a pod listener accepted.
type Accepted struct {
	UID     string
	Port    uint16
	Remote  netip.AddrPort
	OrigDst netip.AddrPort
}

// Handler implements inpod.PodHandler. The zero value is not usable: use New.
type Handler struct {
	ports    []uint16
	accepted chan Accepted

	mu     sync.Mutex
	pods   map[string]*pod
	refuse map[string]bool
	calls  []string
}

type pod struct {
	netns *os.File
	lns   []net.Listener
	wg    sync.WaitGroup
}

var _ inpod.PodHandler = (*Handler)(nil)

// New returns a handler listening on ports in each pod (default 15001,
// 15006, 15008); it closes every pod when the test ends.
func New(tb testing.TB, ports ...uint16) *Handler {
	if len(ports) == 0 {
		ports = []uint16{defaults.OutboundPort, defaults.InboundPlaintextPort, defaults.HBONEPort}
	}
	h := &Handler{ports: ports, accepted: make(chan Accepted, 256), pods: map[string]*pod{}, refuse: map[string]bool{}}
	tb.Cleanup(h.Close)
	return h
}

// Refuse makes AddPod of uid fail.
func (h *Handler) Refuse(uid string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.refuse[uid] = true
}

// AddPod opens the listeners in netns.
func (h *Handler) AddPod(ctx context.Context, p inpod.Pod, ns *os.File) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.calls = append(h.calls, "add "+p.UID)
	if h.refuse[p.UID] {
		return fmt.Errorf("refused %s", p.UID)
	}
	if _, ok := h.pods[p.UID]; ok {
		ns.Close() // already served: keep the listeners we have
		return nil
	}
	st := &pod{netns: ns}
	for _, port := range h.ports {
		ln, err := netns.Listen(ctx, ns, "tcp", fmt.Sprintf("[::]:%d", port), nil)
		if err != nil {
			st.close()
			return err
		}
		st.lns = append(st.lns, ln)
		st.wg.Go(func() { h.serve(p.UID, port, ln) })
	}
	h.pods[p.UID] = st
	return nil
}

func (h *Handler) serve(uid string, port uint16, ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		dst, _, _ := netns.OriginalDst(c)
		remote := c.RemoteAddr().(*net.TCPAddr).AddrPort()
		select {
		case h.accepted <- Accepted{UID: uid, Port: port, Remote: unmap(remote), OrigDst: dst}:
		default:
		}
		_, _ = fmt.Fprintf(c, "%s %d\n", uid, port)
		c.Close()
	}
}

func unmap(a netip.AddrPort) netip.AddrPort { return netip.AddrPortFrom(a.Addr().Unmap(), a.Port()) }

func (p *pod) close() {
	for _, ln := range p.lns {
		ln.Close()
	}
	p.wg.Wait()
	p.netns.Close()
}

// DelPod closes the pod's listeners and namespace file.
func (h *Handler) DelPod(_ context.Context, uid string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.calls = append(h.calls, "del "+uid)
	h.dropLocked(uid)
	return nil
}

func (h *Handler) dropLocked(uid string) {
	if p, ok := h.pods[uid]; ok {
		p.close()
		delete(h.pods, uid)
	}
}

// Snapshot drops every pod not in uids.
func (h *Handler) Snapshot(_ context.Context, uids []string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	sorted := slices.Sorted(slices.Values(uids))
	h.calls = append(h.calls, fmt.Sprintf("snapshot %v", sorted))
	for uid := range h.pods {
		if !slices.Contains(uids, uid) {
			h.dropLocked(uid)
		}
	}
	return nil
}

// Close drops every pod, as a ztunnel that dies loses its listeners.
func (h *Handler) Close() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for uid := range h.pods {
		h.dropLocked(uid)
	}
}

// Pods returns the UIDs served, sorted.
func (h *Handler) Pods() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]string, 0, len(h.pods))
	for uid := range h.pods {
		out = append(out, uid)
	}
	slices.Sort(out)
	return out
}

// Calls returns the calls received so far ("add <uid>", "del <uid>",
// "snapshot [<uids>]").
func (h *Handler) Calls() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.calls)
}

// Next returns the next accepted connection, failing the test after 10s.
func (h *Handler) Next(tb testing.TB) Accepted {
	tb.Helper()
	select {
	case a := <-h.accepted:
		return a
	case <-time.After(10 * time.Second):
		tb.Fatalf("no pod listener accepted a connection")
		return Accepted{}
	}
}

// Idle reports whether no accepted connection is waiting to be read.
func (h *Handler) Idle() bool { return len(h.accepted) == 0 }
