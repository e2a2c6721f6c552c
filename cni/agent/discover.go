//go:build linux

package agent

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"github.com/vishvananda/netlink"
	vnetns "github.com/vishvananda/netns"

	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
)

// errNetnsNotFound: no candidate namespace carries the pod's address.
var errNetnsNotFound = errors.New("no network namespace on this node carries the pod's address")

// discoverer finds the network namespace of a running pod by its address:
// the candidates are the files in the runtime's netns directories and
// /proc/<pid>/ns/net of every process, deduplicated; the pod's is the one
// with a non-loopback interface carrying one of the pod's IPs. It keeps the
// last scan's index and rescans when the index does not answer.
type discoverer struct {
	dirs    []string
	procDir string
	skip    map[netns.ID]bool // the agent's and the node's namespaces
	index   map[netip.Addr]string
}

func newDiscoverer(cfg Config, skip ...*os.File) *discoverer {
	d := &discoverer{procDir: cfg.ProcDir, skip: map[netns.ID]bool{}}
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

// find opens the namespace of the pod with ips. Not safe for concurrent use.
func (d *discoverer) find(ips []netip.Addr) (*os.File, error) {
	if len(ips) == 0 {
		return nil, errors.New("the pod has no address to look for")
	}
	for _, ip := range ips {
		if path, ok := d.index[ip]; ok {
			if f := openIfCarries(path, ips); f != nil {
				return f, nil
			}
		}
	}
	d.scan()
	for _, ip := range ips {
		if path, ok := d.index[ip]; ok {
			if f := openIfCarries(path, ips); f != nil {
				return f, nil
			}
		}
	}
	return nil, fmt.Errorf("%w (%v)", errNetnsNotFound, ips)
}

// openIfCarries opens path and returns it if its namespace still carries
// one of ips (a process may have exited, a name may have been reused).
func openIfCarries(path string, ips []netip.Addr) *os.File {
	f, err := netns.Open(path)
	if err != nil {
		return nil
	}
	addrs, err := addrsOf(f)
	if err != nil || !slices.ContainsFunc(ips, func(ip netip.Addr) bool { return slices.Contains(addrs, ip) }) {
		f.Close()
		return nil
	}
	return f
}

// scan rebuilds the address index from every candidate namespace.
func (d *discoverer) scan() {
	d.index = map[netip.Addr]string{}
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
			if _, dup := d.index[a]; !dup {
				d.index[a] = path
			}
		}
	}
}

// candidates lists runtime netns files first (stable names), then the
// namespaces of processes.
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
	if d.procDir == "" || d.procDir == Disabled {
		return out
	}
	entries, err := os.ReadDir(d.procDir)
	if err != nil {
		return out
	}
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err == nil {
			out = append(out, filepath.Join(d.procDir, e.Name(), "ns", "net"))
		}
	}
	return out
}

// addrsOf lists the addresses on the non-loopback interfaces of ns.
func addrsOf(ns *os.File) ([]netip.Addr, error) {
	h, err := netlink.NewHandleAt(vnetns.NsHandle(int(ns.Fd())))
	if err != nil {
		return nil, err
	}
	defer h.Close()
	list, err := h.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return nil, err
	}
	var out []netip.Addr
	for _, a := range list {
		if a.IP.IsLoopback() {
			continue
		}
		if ip, ok := netip.AddrFromSlice(a.IP); ok {
			out = append(out, ip.Unmap())
		}
	}
	return out, nil
}
