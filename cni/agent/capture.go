//go:build linux

package agent

import (
	"os"

	"github.com/isthmus-mesh/isthmus/cni/redirect"
	"github.com/isthmus-mesh/isthmus/cni/zds"
)

// setCapture is zds' OnCapture: the connected ztunnels changed what the
// pods' rules exempt, so every enrolled pod's rules are re-written before
// zds sends a new ztunnel its snapshot. New enrolments use it too
// (podOptions). A pod whose rules cannot be re-written is counted
// and logged; its ztunnel sockets stay as its old rules say.
func (a *Agent) setCapture(c zds.Capture) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.capture, a.toldOf = c, true
	a.m.cgroups.Set(float64(len(c.Cgroups)))
	if c.MarkOnly {
		a.m.markOnly.Set(1)
		a.log.Warn("a connected ztunnel reported no cgroup id (Istio's ztunnel, or no cgroup v2): the pods' rules exempt every socket carrying ztunnel's mark, which any pod process with CAP_NET_RAW can set",
			"cgroups", c.Cgroups)
	} else {
		a.m.markOnly.Set(0)
		a.log.Info("the pods' rules exempt the marked sockets of ztunnel's cgroups only", "cgroups", c.Cgroups)
	}
	opts := a.redirectOptions()
	for _, e := range a.pods {
		if err := redirect.Apply(e.netns, opts); err != nil {
			a.fail(failRules)
			a.log.Error("re-write the pod's rules for the connected ztunnels", "pod", e.key, "uid", e.pod.UID, "error", err)
			continue
		}
		e.opts = opts
	}
}

// openCgroupNS opens Config.NodeCgroupNS (nil when disabled or when it
// cannot be opened).
func (a *Agent) openCgroupNS() *os.File {
	if a.cfg.NodeCgroupNS == "" || a.cfg.NodeCgroupNS == Disabled {
		return nil
	}
	f, err := os.Open(a.cfg.NodeCgroupNS)
	if err != nil {
		a.log.Warn("the node's cgroup namespace cannot be opened: the pods' rules are written from the agent's own, where a ztunnel whose cgroup is shallower than the agent's is not exempt from capture",
			"path", a.cfg.NodeCgroupNS, "error", err)
		return nil
	}
	return f
}

// podOptions are the rules for the pod namespace ns (a.mu held). Until a
// ztunnel has said hello to this agent, a pod whose rules an earlier agent
// wrote keeps their exemption: the ztunnel serving it is most likely still
// running and reconnecting, and capturing its sockets meanwhile would loop
// its connections back to itself. The exemption kept is that pod's own
// (what a process in it could change, it could as well remove), never
// spread to other pods, and it is replaced at the first hello.
func (a *Agent) podOptions(ns *os.File) redirect.Options {
	opts := a.redirectOptions()
	if a.toldOf {
		return opts
	}
	cgroups, markOnly, err := redirect.Exemption(ns)
	if err != nil {
		a.log.Warn("read the pod's current rules", "netns", ns.Name(), "error", err)
		return opts
	}
	opts.ZtunnelCgroups, opts.MarkOnly = cgroups, markOnly
	return opts
}
