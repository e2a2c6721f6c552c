//go:build linux

package redirect

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"slices"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"golang.org/x/sys/unix"
)

// Ports of ztunnel's in-pod listeners that the rules redirect to.
const (
	// OutboundPort receives the pod's outbound TCP.
	OutboundPort uint16 = defaults.OutboundPort
	// InboundPlaintextPort receives inbound TCP that is not HBONE.
	InboundPlaintextPort uint16 = defaults.InboundPlaintextPort
	// HBONEPort is left alone: HBONE reaches ztunnel's listener as sent.
	HBONEPort uint16 = defaults.HBONEPort
	// DNSPort receives the pod's DNS (UDP and TCP 53) when enabled.
	DNSPort uint16 = defaults.DNSPort
)

// Mark is the socket mark (SO_MARK) ztunnel sets on every socket it opens
// inside a pod's namespace; the pod rules never capture packets carrying it
// under MarkMask. It is Istio's in-pod mark (1337), so Isthmus' ztunnel and
// Istio's agree.
const (
	Mark     uint32 = 0x539
	MarkMask uint32 = 0xfff
)

// The host-probe addresses: the node source-NATs its own connections to
// enrolled pods (kubelet's probes) to these, and the pod rules let them
// through uncaptured. They are Istio's.
var (
	ProbeAddr4 = netip.MustParseAddr("169.254.7.127")
	ProbeAddr6 = netip.MustParseAddr("fd16:9254:7127:1337:ffff:ffff:ffff:ffff")
)

// Table names owned by this package: family inet, but NodeBridgeTable
// (family bridge).
const (
	PodTable        = "isthmus-inpod"
	NodeTable       = "isthmus-node"
	NodeBridgeTable = "isthmus-node-bridge"
)

// MaxCgroupLevel is the deepest cgroup v2 level (below the root of the
// cgroup namespace the rules are written from, Options.CgroupNS) at which
// the pod rules look for ztunnel's cgroup: one rule per level
// 0..MaxCgroupLevel.
const MaxCgroupLevel = 16

// ztunnelSet is the pod table's set of ztunnel cgroup ids.
const ztunnelSet = "ztunnels"

// Options shape the pod rules.
type Options struct {
	// ZtunnelCgroups are the cgroup v2 ids (the inode numbers of the
	// cgroup directories) of the ztunnels serving the node. A socket is
	// left uncaptured only when it carries Mark AND was opened by a
	// process of one of these cgroups (or below). Empty, and MarkOnly
	// false: no socket is exempt (no ztunnel is known; captured traffic
	// fails closed).
	ZtunnelCgroups []uint64
	// MarkOnly exempts every socket carrying Mark, whatever its cgroup:
	// for a ztunnel that reports no cgroup (Istio's, or a cgroup v1-only
	// node). Any process with CAP_NET_RAW can set that mark, so capture
	// can then be left from inside the pod.
	MarkOnly bool
	// CgroupNS is the cgroup namespace the rules are written from. Since
	// Linux 6.11 the kernel counts a rule's cgroup levels from the root of
	// the writer's cgroup namespace, so an agent in a container of its own
	// could not reach a ztunnel whose cgroup is shallower than the agent's
	// (a Guaranteed pod's is one level above a Burstable one's): writing
	// from the node's (init) cgroup namespace makes the levels absolute.
	// nil: the caller's. Needs CAP_SYS_ADMIN.
	CgroupNS *os.File
	// RedirectDNS sends the pod's UDP and TCP port 53 to DNSPort, where
	// ztunnel's in-pod DNS proxy listens on loopback.
	RedirectDNS bool
	// ExcludeDestinations are never captured on the way out (the node's
	// own addresses, so that a pod's traffic to its node is untouched).
	ExcludeDestinations []netip.Prefix
}

// conn opens an nftables connection into ns (nil: the caller's namespace).
func conn(ns *os.File) (*nftables.Conn, error) {
	if ns == nil {
		return nftables.New()
	}
	return nftables.New(nftables.WithNetNSFd(int(ns.Fd())))
}

func inetTable(name string) *nftables.Table {
	return &nftables.Table{Name: name, Family: nftables.TableFamilyINet}
}

// Apply installs the pod rules in the pod namespace ns, replacing whatever
// table PodTable held, in one transaction.
func Apply(ns *os.File, opts Options) error {
	if opts.CgroupNS != nil && !opts.MarkOnly && len(opts.ZtunnelCgroups) > 0 {
		return inCgroupNS(opts.CgroupNS, func() error { return apply(ns, opts) })
	}
	return apply(ns, opts)
}

// inCgroupNS runs fn on a thread of its own that has entered the cgroup
// namespace cgns (the kernel reads the sender's namespace while it checks
// the rules of a transaction, in the sending system call). Should the
// return to the thread's own namespace fail, the thread is never unlocked
// and dies with the goroutine.
func inCgroupNS(cgns *os.File, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := os.Open("/proc/thread-self/ns/cgroup")
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("redirect: the thread's cgroup namespace: %w", err)
			return
		}
		defer orig.Close()
		if err := unix.Setns(int(cgns.Fd()), unix.CLONE_NEWCGROUP); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("redirect: enter cgroup namespace %s: %w", cgns.Name(), err)
			return
		}
		fnErr := fn()
		if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWCGROUP); err != nil {
			errc <- errors.Join(fnErr, fmt.Errorf("redirect: return from cgroup namespace %s (thread discarded): %w", cgns.Name(), err))
			return
		}
		runtime.UnlockOSThread()
		errc <- fnErr
	}()
	return <-errc
}

func apply(ns *os.File, opts Options) error {
	c, err := conn(ns)
	if err != nil {
		return fmt.Errorf("redirect: nftables in %s: %w", nsName(ns), err)
	}
	t := replaceTable(c, PodTable)
	if !opts.MarkOnly && len(opts.ZtunnelCgroups) > 0 {
		set := &nftables.Set{Table: t, Name: ztunnelSet, KeyType: nftables.TypeCGroupV2}
		var elems []nftables.SetElement
		for _, id := range opts.ZtunnelCgroups {
			elems = append(elems, nftables.SetElement{Key: binaryutil.NativeEndian.PutUint64(id)})
		}
		if err := c.AddSet(set, elems); err != nil {
			return fmt.Errorf("redirect: set %s: %w", ztunnelSet, err)
		}
	}
	pre := c.AddChain(&nftables.Chain{Name: "prerouting", Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityNATDest})
	out := c.AddChain(&nftables.Chain{Name: "output", Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookOutput, Priority: nftables.ChainPriorityNATDest})
	for _, r := range inboundRules() {
		c.AddRule(&nftables.Rule{Table: t, Chain: pre, Exprs: r})
	}
	for _, r := range outboundRules(opts) {
		c.AddRule(&nftables.Rule{Table: t, Chain: out, Exprs: r})
	}
	err = c.Flush()
	runtime.KeepAlive(ns)
	if err != nil {
		return fmt.Errorf("redirect: apply pod rules in %s: %w", nsName(ns), err)
	}
	return nil
}

// replaceTable queues "add table; delete table; add table": whatever the
// table held is gone when the transaction commits, and an absent table is
// not an error.
func replaceTable(c *nftables.Conn, name string) *nftables.Table {
	t := inetTable(name)
	c.AddTable(t)
	c.DelTable(t)
	return c.AddTable(t)
}

const loopbackIndex = 1 // lo is interface 1 in every namespace

func inboundRules() [][]expr.Any {
	return [][]expr.Any{
		append(ifIndex(true, loopbackIndex), ret()),
		append(addrIn(true, netip.PrefixFrom(ProbeAddr4, 32)), ret()),
		append(addrIn(true, netip.PrefixFrom(ProbeAddr6, 128)), ret()),
		concat(l4proto(unix.IPPROTO_TCP), dport(HBONEPort), []expr.Any{ret()}),
		concat(l4proto(unix.IPPROTO_TCP), redirectTo(InboundPlaintextPort)),
	}
}

func outboundRules(opts Options) [][]expr.Any {
	var rules [][]expr.Any
	switch {
	case opts.MarkOnly:
		rules = append(rules, append(markEq(Mark, MarkMask), ret()))
	case len(opts.ZtunnelCgroups) > 0:
		// The level of a socket's cgroup is unknown (ztunnel runs in a
		// container, in its own cgroup namespace); cgroup ids are unique,
		// so "ztunnel's id at some level" is "in ztunnel's subtree".
		for level := uint32(0); level <= MaxCgroupLevel; level++ {
			rules = append(rules, concat(markEq(Mark, MarkMask), socketCgroupIn(level, ztunnelSet), []expr.Any{ret()}))
		}
	}
	rules = append(rules, append(ifIndex(false, loopbackIndex), ret()))
	for _, p := range opts.ExcludeDestinations {
		rules = append(rules, append(addrIn(false, p), ret()))
	}
	if opts.RedirectDNS {
		rules = append(rules,
			concat(l4proto(unix.IPPROTO_UDP), dport(53), redirectTo(DNSPort)),
			concat(l4proto(unix.IPPROTO_TCP), dport(53), redirectTo(DNSPort)))
	}
	return append(rules, concat(l4proto(unix.IPPROTO_TCP), redirectTo(OutboundPort)))
}

// Remove deletes PodTable from ns. An absent table is not an error.
func Remove(ns *os.File) error {
	return removeTable(ns, PodTable)
}

// Present reports whether PodTable exists in ns.
func Present(ns *os.File) (bool, error) {
	return hasTable(ns, PodTable)
}

// RuleCount returns the number of rules in PodTable's chains (0 when the
// table is absent); CHECK and tests use it to see that Apply converged.
func RuleCount(ns *os.File) (int, error) {
	c, err := conn(ns)
	if err != nil {
		return 0, err
	}
	defer runtime.KeepAlive(ns)
	ok, err := hasTable(ns, PodTable)
	if err != nil || !ok {
		return 0, err
	}
	t := inetTable(PodTable)
	n := 0
	for _, name := range []string{"prerouting", "output"} {
		rules, err := c.GetRules(t, &nftables.Chain{Name: name, Table: t})
		if err != nil {
			return 0, fmt.Errorf("redirect: list %s rules: %w", name, err)
		}
		n += len(rules)
	}
	return n, nil
}

// ExpectedRules is the number of rules Apply installs with opts.
func ExpectedRules(opts Options) int {
	return len(inboundRules()) + len(outboundRules(opts))
}

func hasTable(ns *os.File, name string) (bool, error) {
	return hasTableOf(ns, nftables.TableFamilyINet, name)
}

func hasTableOf(ns *os.File, family nftables.TableFamily, name string) (bool, error) {
	c, err := conn(ns)
	if err != nil {
		return false, fmt.Errorf("redirect: nftables in %s: %w", nsName(ns), err)
	}
	tables, err := c.ListTablesOfFamily(family)
	runtime.KeepAlive(ns)
	if err != nil {
		return false, fmt.Errorf("redirect: list tables in %s: %w", nsName(ns), err)
	}
	return slices.ContainsFunc(tables, func(t *nftables.Table) bool { return t.Name == name }), nil
}

func removeTable(ns *os.File, name string) error {
	return removeTableOf(ns, nftables.TableFamilyINet, name)
}

func removeTableOf(ns *os.File, family nftables.TableFamily, name string) error {
	ok, err := hasTableOf(ns, family, name)
	if err != nil || !ok {
		return err
	}
	c, err := conn(ns)
	if err != nil {
		return err
	}
	c.DelTable(&nftables.Table{Name: name, Family: family})
	err = c.Flush()
	runtime.KeepAlive(ns)
	if err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("redirect: delete table %s in %s: %w", name, nsName(ns), err)
	}
	return nil
}

func nsName(ns *os.File) string {
	if ns == nil {
		return "the current namespace"
	}
	return ns.Name()
}

// Exemption reads which marked sockets PodTable in ns leaves uncaptured:
// those of the cgroups in its ztunnel set, or (markOnly) every marked
// socket. Neither means no socket is exempt, or no table.
func Exemption(ns *os.File) (cgroups []uint64, markOnly bool, err error) {
	ok, err := hasTable(ns, PodTable)
	if err != nil || !ok {
		return nil, false, err
	}
	c, err := conn(ns)
	if err != nil {
		return nil, false, err
	}
	defer runtime.KeepAlive(ns)
	t := inetTable(PodTable)
	rules, err := c.GetRules(t, &nftables.Chain{Name: "output", Table: t})
	if err != nil {
		return nil, false, fmt.Errorf("redirect: list output rules: %w", err)
	}
	if len(rules) == 0 {
		return nil, false, nil
	}
	first := rules[0].Exprs
	isMark := slices.ContainsFunc(first, func(e expr.Any) bool { m, ok := e.(*expr.Meta); return ok && m.Key == expr.MetaKeyMARK })
	// (google/nftables v0.3.0 does not decode the socket expression; its
	// lookup in the ztunnel set is what tells the rule apart.)
	isSocket := slices.ContainsFunc(first, func(e expr.Any) bool { l, ok := e.(*expr.Lookup); return ok && l.SetName == ztunnelSet })
	if !isMark {
		return nil, false, nil
	}
	if !isSocket {
		return nil, true, nil
	}
	s, err := c.GetSetByName(t, ztunnelSet)
	if err != nil {
		return nil, false, fmt.Errorf("redirect: set %s: %w", ztunnelSet, err)
	}
	elems, err := c.GetSetElements(s)
	if err != nil {
		return nil, false, fmt.Errorf("redirect: elements of %s: %w", ztunnelSet, err)
	}
	for _, e := range elems {
		if len(e.Key) == 8 {
			cgroups = append(cgroups, binaryutil.NativeEndian.Uint64(e.Key))
		}
	}
	slices.Sort(cgroups)
	return cgroups, false, nil
}
