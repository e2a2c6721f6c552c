//go:build linux

package agent

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
	vnetns "github.com/vishvananda/netns"

	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
)

// Reasons a running pod's sandbox is not trusted, or is suspicious: the
// reason of the Event on the pod and the label of
// isthmus_cni_sandbox_problems_total. A fixed set: request data never
// becomes a label.
const (
	// ReasonSandboxNotFound: no record of the pod's CNI ADD and no process
	// in the pod's cgroup; the pod is not enrolled.
	ReasonSandboxNotFound = "SandboxNotFound"
	// ReasonSandboxAddressMismatch: the pod's sandbox does not carry the
	// pod's address on a non-loopback interface; the pod is not enrolled.
	ReasonSandboxAddressMismatch = "SandboxAddressMismatch"
	// ReasonDuplicateAddress: another network namespace carries the pod's
	// address, or the pod's processes sit in several; the pod is enrolled
	// through its own sandbox only.
	ReasonDuplicateAddress = "DuplicateAddress"
	// ReasonSandboxRecordMismatch: the recorded path of the pod's sandbox
	// names another namespace than the runtime reported; the record is
	// refused (and dropped).
	ReasonSandboxRecordMismatch = "SandboxRecordMismatch"
)

// sandboxReasons lists the reasons, for the metric's initial series.
var sandboxReasons = []string{ReasonSandboxNotFound, ReasonSandboxAddressMismatch, ReasonDuplicateAddress, ReasonSandboxRecordMismatch}

// sandboxError is a pod whose sandbox is not enrolled, with its reason.
type sandboxError struct {
	reason string
	msg    string
}

func (e *sandboxError) Error() string { return e.reason + ": " + e.msg }

// indexMaxAge is how long one scan of the node's processes (or namespaces)
// answers for: the reconciles of one burst (the agent's start, a namespace
// labelled) share it; a pod it does not answer for triggers a new one.
const indexMaxAge = time.Second

// located is a running pod's sandbox.
type located struct {
	ns          *os.File // owned by the caller
	containerID string   // "" when found by cgroup
	via         string   // "record" or "cgroup"
	notes       []*sandboxError
}

// discoverer finds the network namespace of a pod that is already running:
// from the runtime's record of its CNI ADD (sandboxStore), else from the
// kubelet's cgroup of its processes, never from an address (which any
// tenant with NET_ADMIN can put on an interface). The namespace found must
// carry the pod's address on a non-loopback interface; other namespaces
// carrying it are reported. Not safe for concurrent use.
type discoverer struct {
	dirs    []string
	procDir string
	roots   []string
	store   *sandboxStore     // nil: no records
	skip    map[netns.ID]bool // the agent's and the node's namespaces

	cgAt    time.Time
	cgIndex map[string][]int // pod UID -> pids
	addrAt  time.Time
	addrIdx map[netip.Addr][]netns.ID
}

func newDiscoverer(cfg Config, store *sandboxStore, skip ...*os.File) *discoverer {
	d := &discoverer{procDir: cfg.ProcDir, roots: cfg.PodCgroupRoots, store: store, skip: map[netns.ID]bool{}}
	if d.procDir == Disabled {
		d.procDir = ""
	}
	for _, dir := range cfg.NetnsDirs {
		if dir != Disabled && dir != "" {
			d.dirs = append(d.dirs, dir)
		}
	}
	for _, f := range skip {
		if f == nil {
			continue
		}
		if id, err := netns.IDOf(f); err == nil {
			d.skip[id] = true
		}
	}
	return d
}

// locate opens the sandbox of pod uid, whose addresses are ips, or says
// why not (a *sandboxError). Notes on the way (a refused record, another
// namespace with the pod's address) come back in located.notes, or joined
// to the error.
func (d *discoverer) locate(uid string, ips []netip.Addr) (*located, error) {
	var notes []*sandboxError
	fail := func(e *sandboxError) (*located, error) {
		errs := []error{e}
		for _, n := range notes {
			errs = append(errs, n)
		}
		return nil, errors.Join(errs...)
	}
	if len(ips) == 0 {
		return fail(&sandboxError{ReasonSandboxAddressMismatch, "the pod has no address to check its sandbox against"})
	}
	loc, refused := d.fromRecords(uid)
	notes = append(notes, refused...)
	if loc == nil {
		var err *sandboxError
		if loc, err = d.fromCgroup(uid, ips); err != nil {
			return fail(err)
		}
	} else if !carries(loc.ns, ips) {
		loc.ns.Close()
		return fail(&sandboxError{ReasonSandboxAddressMismatch, fmt.Sprintf(
			"the network namespace the runtime reported for this pod's sandbox does not carry the pod's address %v on a non-loopback interface", ips)})
	}
	id, err := netns.IDOf(loc.ns)
	if err != nil {
		loc.ns.Close()
		return nil, err
	}
	if others := d.othersWith(ips, id); others > 0 {
		notes = append(notes, &sandboxError{ReasonDuplicateAddress, fmt.Sprintf(
			"%d other network namespace(s) on this node carry the pod's address %v on a non-loopback interface; the pod is enrolled through its own sandbox (found by %s) only", others, ips, loc.via)})
	}
	loc.notes = append(notes, loc.notes...)
	return loc, nil
}

// fromRecords opens the newest record of uid whose namespace is still the
// one recorded. Records whose namespace is gone are dropped; records whose
// path names another namespace are dropped and reported.
func (d *discoverer) fromRecords(uid string) (*located, []*sandboxError) {
	if d.store == nil {
		return nil, nil
	}
	var refused []*sandboxError
	for _, rec := range d.store.byUID(uid) {
		f, err := d.store.reopen(rec)
		if err == nil {
			return &located{ns: f, containerID: rec.ContainerID, via: "record"}, refused
		}
		if errors.Is(err, errRecordMismatch) {
			refused = append(refused, &sandboxError{ReasonSandboxRecordMismatch, fmt.Sprintf(
				"the record of sandbox %s names a network namespace that is not the one the runtime reported at CNI ADD; the record is refused", rec.ContainerID)})
		}
		// Gone (or not a namespace any more): the sandbox ended while
		// no agent saw its DEL.
		d.store.remove(rec.ContainerID)
	}
	return nil, refused
}

// cgroupProc is one process of the pod, in namespace id.
type cgroupProc struct {
	ns    *os.File
	id    netns.ID
	start uint64 // clock ticks after boot
}

// fromCgroup finds the pod's processes by the kubelet's cgroup of the pod
// and opens the namespace of the earliest-started one that carries the
// pod's address: the sandbox's (its first process); the namespaces of the
// pod's other processes are reported.
func (d *discoverer) fromCgroup(uid string, ips []netip.Addr) (*located, *sandboxError) {
	if d.procDir == "" {
		return nil, &sandboxError{ReasonSandboxNotFound, "no runtime record of this pod's sandbox, and the node's processes are not visible to the agent"}
	}
	procs := d.podProcs(uid, false)
	if len(procs) == 0 {
		procs = d.podProcs(uid, true)
	}
	defer func() {
		for _, p := range procs {
			if p.ns != nil {
				p.ns.Close()
			}
		}
	}()
	if len(procs) == 0 {
		return nil, &sandboxError{ReasonSandboxNotFound, "no runtime record of this pod's sandbox and no process in the kubelet's cgroup of the pod on this node"}
	}
	namespaces := map[netns.ID]bool{}
	var best *cgroupProc
	for i := range procs {
		p := &procs[i]
		namespaces[p.id] = true
		if (best == nil || p.start < best.start) && carries(p.ns, ips) {
			best = p
		}
	}
	if best == nil {
		return nil, &sandboxError{ReasonSandboxAddressMismatch, fmt.Sprintf(
			"no network namespace of this pod's processes carries the pod's address %v on a non-loopback interface", ips)}
	}
	loc := &located{ns: best.ns, via: "cgroup"}
	best.ns = nil // the caller's now
	if len(namespaces) > 1 {
		loc.notes = append(loc.notes, &sandboxError{ReasonDuplicateAddress, fmt.Sprintf(
			"the pod's processes sit in %d network namespaces; the pod is enrolled through the one of its first process", len(namespaces))})
	}
	return loc, nil
}

// podProcs opens the namespaces of the processes in the cgroup of pod uid.
// Each process is checked after its namespace is open (a pid reused in
// between is not the pod's). rescan forces a new scan of the node's
// processes.
func (d *discoverer) podProcs(uid string, rescan bool) []cgroupProc {
	if rescan || d.cgIndex == nil || time.Since(d.cgAt) > indexMaxAge {
		d.scanCgroups()
	}
	var out []cgroupProc
	for _, pid := range d.cgIndex[uid] {
		dir := filepath.Join(d.procDir, strconv.Itoa(pid))
		f, err := netns.Open(filepath.Join(dir, "ns", "net"))
		if err != nil {
			continue
		}
		id, err1 := netns.IDOf(f)
		cg, err2 := os.ReadFile(filepath.Join(dir, "cgroup"))
		start, err3 := startTime(dir)
		if err1 != nil || err2 != nil || err3 != nil || podUIDOfCgroups(cg, d.roots) != uid || d.skip[id] {
			f.Close()
			continue
		}
		out = append(out, cgroupProc{ns: f, id: id, start: start})
	}
	return out
}

// scanCgroups indexes the node's processes by the pod cgroup they are in.
func (d *discoverer) scanCgroups() {
	d.cgIndex, d.cgAt = map[string][]int{}, time.Now()
	for _, pid := range d.pids() {
		cg, err := os.ReadFile(filepath.Join(d.procDir, strconv.Itoa(pid), "cgroup"))
		if err != nil {
			continue
		}
		if uid := podUIDOfCgroups(cg, d.roots); uid != "" {
			d.cgIndex[uid] = append(d.cgIndex[uid], pid)
		}
	}
}

func (d *discoverer) pids() []int {
	if d.procDir == "" {
		return nil
	}
	entries, err := os.ReadDir(d.procDir)
	if err != nil {
		return nil
	}
	var out []int
	for _, e := range entries {
		if pid, err := strconv.Atoi(e.Name()); err == nil && pid > 0 {
			out = append(out, pid)
		}
	}
	return out
}

// startTime reads a process' start time (field 22 of /proc/<pid>/stat,
// counted after the command name, which may hold spaces and parentheses).
func startTime(procPidDir string) (uint64, error) {
	b, err := os.ReadFile(filepath.Join(procPidDir, "stat"))
	if err != nil {
		return 0, err
	}
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0, errors.New("malformed stat")
	}
	fields := strings.Fields(string(b[i+1:]))
	// fields[0] is field 3 (state); starttime is field 22.
	if len(fields) < 20 {
		return 0, errors.New("malformed stat")
	}
	return strconv.ParseUint(fields[19], 10, 64)
}

// othersWith counts the namespaces other than own (and the agent's and
// the node's) that carry one of ips on a non-loopback interface.
func (d *discoverer) othersWith(ips []netip.Addr, own netns.ID) int {
	if d.addrIdx == nil || time.Since(d.addrAt) > indexMaxAge {
		d.scanAddrs()
	}
	seen := map[netns.ID]bool{}
	for _, ip := range ips {
		for _, id := range d.addrIdx[ip] {
			if id != own {
				seen[id] = true
			}
		}
	}
	return len(seen)
}

// scanAddrs indexes the addresses on the non-loopback interfaces of every
// namespace of the node.
func (d *discoverer) scanAddrs() {
	d.addrIdx, d.addrAt = map[netip.Addr][]netns.ID{}, time.Now()
	seen := map[netns.ID]bool{}
	for _, path := range d.candidates() {
		f, err := netns.Open(path)
		if err != nil {
			continue
		}
		id, err := netns.IDOf(f)
		if err != nil || seen[id] || d.skip[id] {
			f.Close()
			continue
		}
		seen[id] = true
		addrs, err := addrsOf(f)
		f.Close()
		if err != nil {
			continue
		}
		for _, a := range addrs {
			d.addrIdx[a] = append(d.addrIdx[a], id)
		}
	}
}

// candidates lists the node's network namespaces, with repeats: runtime
// netns files first, then the namespaces of processes.
func (d *discoverer) candidates() []string {
	var out []string
	for _, dir := range d.dirs {
		entries, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		for _, e := range entries {
			if !e.IsDir() {
				out = append(out, filepath.Join(dir, e.Name()))
			}
		}
	}
	for _, pid := range d.pids() {
		out = append(out, filepath.Join(d.procDir, strconv.Itoa(pid), "ns", "net"))
	}
	return out
}

// carries reports whether ns has one of ips on a non-loopback interface.
func carries(ns *os.File, ips []netip.Addr) bool {
	addrs, err := addrsOf(ns)
	return err == nil && slices.ContainsFunc(ips, func(ip netip.Addr) bool { return slices.Contains(addrs, ip) })
}

// addrsOf lists the addresses on the non-loopback interfaces of ns (an
// address on lo, whatever it is, does not count: any process may put one
// there).
func addrsOf(ns *os.File) ([]netip.Addr, error) {
	h, err := netlink.NewHandleAt(vnetns.NsHandle(int(ns.Fd())))
	if err != nil {
		return nil, err
	}
	defer h.Close()
	links, err := h.LinkList()
	if err != nil {
		return nil, err
	}
	loopback := map[int]bool{}
	for _, l := range links {
		if l.Attrs().Flags&net.FlagLoopback != 0 {
			loopback[l.Attrs().Index] = true
		}
	}
	list, err := h.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return nil, err
	}
	var out []netip.Addr
	for _, a := range list {
		if loopback[a.LinkIndex] || a.IP.IsLoopback() {
			continue
		}
		if ip, ok := netip.AddrFromSlice(a.IP); ok {
			out = append(out, ip.Unmap())
		}
	}
	return out, nil
}
