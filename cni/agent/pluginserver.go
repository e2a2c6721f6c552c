//go:build linux

package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"github.com/isthmus-mesh/isthmus/cni/plugin"
	"github.com/isthmus-mesh/isthmus/cni/zds"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
)

func listenPlugin(path string) (*net.UnixListener, error) {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("agent: remove stale plugin socket: %w", err)
	}
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return nil, fmt.Errorf("agent: plugin socket: %w", err)
	}
	ln.SetUnlinkOnClose(true)
	return ln, nil
}

// servePlugin answers one plugin event per connection until ctx ends.
func (a *Agent) servePlugin(ctx context.Context, ln *net.UnixListener) error {
	var wg sync.WaitGroup
	defer wg.Wait()
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	for {
		uc, err := ln.AcceptUnix()
		if err != nil {
			ln.Close()
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("agent: plugin socket: %w", err)
		}
		wg.Go(func() {
			defer uc.Close()
			a.answer(ctx, uc)
		})
	}
}

func (a *Agent) answer(ctx context.Context, uc *net.UnixConn) {
	// Answer within the plugin's own wait, or the answer is lost.
	ctx, cancel := context.WithTimeout(ctx, a.cfg.PluginTimeout*9/10)
	defer cancel()
	dl, _ := ctx.Deadline()
	_ = uc.SetDeadline(dl)
	var ev plugin.Event
	ns, err := zds.Read(uc, &ev)
	if err != nil {
		a.log.Warn("bad plugin request", "error", err)
		return
	}
	enrolled, err := a.handle(ctx, &ev, ns)
	result := "ok"
	reply := plugin.Reply{Enrolled: enrolled}
	if err != nil {
		result, reply.Error = "error", err.Error()
		a.log.Warn("plugin event failed", "command", ev.Command, "pod", ev.PodNamespace+"/"+ev.PodName, "error", err)
	}
	command := ev.Command
	switch command {
	case plugin.CommandAdd, plugin.CommandDel, plugin.CommandCheck:
	default:
		command = "unknown" // request data never becomes a label value
	}
	a.m.pluginEvents.WithLabelValues(command, result).Inc()
	if err := zds.Write(uc, reply, nil); err != nil {
		a.log.Warn("reply to the plugin", "error", err)
	}
}

// handle runs one plugin event; it owns ns.
func (a *Agent) handle(ctx context.Context, ev *plugin.Event, ns *os.File) (bool, error) {
	owned := ns
	defer func() {
		if owned != nil {
			owned.Close()
		}
	}()
	switch ev.Command {
	case plugin.CommandAdd:
		owned = nil // add owns it from here
		return a.handleAdd(ctx, ev, ns)
	case plugin.CommandDel:
		a.handleDel(ctx, ev)
		return false, nil
	case plugin.CommandCheck:
		return a.handleCheck(ctx, ev)
	default:
		return false, fmt.Errorf("unknown command %q", ev.Command)
	}
}

func (a *Agent) handleAdd(ctx context.Context, ev *plugin.Event, ns *os.File) (bool, error) {
	closeNS := func() {
		if ns != nil {
			ns.Close()
		}
	}
	if ev.PodName != "" && ev.PodNamespace != "" && ev.PodUID != "" {
		// Every pod's sandbox, enrolled or not: a pod may be enrolled
		// later (a label, another configuration) from this record.
		a.recordSandbox(ev, ev.PodUID, ns)
	}
	if ev.PodName == "" || ev.PodNamespace == "" || a.cfg.selection().Excluded(ev.PodNamespace) {
		// Not a Kubernetes pod, or one never enrolled: answered without
		// the API server, so system pods start while it is away.
		closeNS()
		return false, nil
	}
	pod, err := a.lookupPod(ctx, ev.PodNamespace, ev.PodName, ev.PodUID)
	if err != nil {
		closeNS()
		a.fail(failPodLookup)
		return false, err
	}
	if ev.PodUID == "" {
		a.recordSandbox(ev, string(pod.UID), ns)
	}
	pns, err := a.lookupNamespace(ctx, pod.Namespace)
	if err != nil {
		closeNS()
		a.fail(failPodLookup)
		return false, err
	}
	want, reason := a.cfg.selection().Decide(pod, pns)
	if !want {
		closeNS()
		a.log.Debug("pod not enrolled", "pod", ev.PodNamespace+"/"+ev.PodName, "reason", reason)
		return false, nil
	}
	if ns == nil {
		a.fail(failNetns)
		return false, errors.New("the pod should be enrolled but the plugin sent no network namespace")
	}
	if err := netns.Check(ns); err != nil {
		ns.Close()
		a.fail(failNetns)
		return false, err
	}
	ips := ev.IPs
	if len(ips) == 0 {
		ips = podIPs(pod)
	}
	if len(ips) == 0 {
		a.log.Warn("enrolling a pod without known addresses: the node cannot tell its probes apart", "pod", ev.PodNamespace+"/"+ev.PodName)
	}
	key := pod.Namespace + "/" + pod.Name
	if err := a.enrol(ctx, zdsPod(pod, ips), key, ev.ContainerID, ns, failClosedAndReport); err != nil {
		return false, fmt.Errorf("enrol pod %s: %w", key, err)
	}
	return true, nil
}

// recordSandbox keeps the runtime's word on the sandbox of an ADD: pod uid
// is in the namespace ns, at ev.Netns. Without a record the pod is still
// found after a restart, by its cgroup; so a failure is counted and logged,
// and the ADD goes on.
func (a *Agent) recordSandbox(ev *plugin.Event, uid string, ns *os.File) {
	if a.store == nil || ns == nil {
		return
	}
	log := a.log.With("pod", ev.PodNamespace+"/"+ev.PodName, "uid", uid)
	if err := netns.Check(ns); err != nil {
		return // refused below, if the pod is to be enrolled
	}
	id, err := netns.IDOf(ns)
	if err == nil {
		err = a.store.put(&sandboxRecord{
			ContainerID: ev.ContainerID, PodNamespace: ev.PodNamespace, PodName: ev.PodName, PodUID: uid,
			Netns: ev.Netns, Dev: id.Dev, Ino: id.Ino, Recorded: time.Now().UTC(),
		})
	}
	if err != nil {
		a.fail(failRecord)
		log.Warn("sandbox not recorded: after a restart the pod is found by its cgroup only", "error", err)
	}
}

func (a *Agent) handleDel(ctx context.Context, ev *plugin.Event) {
	if a.store != nil && ev.ContainerID != "" {
		a.store.remove(ev.ContainerID)
	}
	// The sandbox goes; so do its rules. Match by pod UID, else by the
	// container (the runtime may omit the pod arguments on DEL).
	a.releaseWhere(ctx, func(e *enrolment) bool {
		return (ev.PodUID != "" && e.pod.UID == ev.PodUID) ||
			(ev.ContainerID != "" && e.containerID == ev.ContainerID)
	}, "CNI DEL")
}

func (a *Agent) handleCheck(ctx context.Context, ev *plugin.Event) (bool, error) {
	if ev.PodName == "" || ev.PodNamespace == "" || a.cfg.selection().Excluded(ev.PodNamespace) {
		return false, nil
	}
	pod, err := a.lookupPod(ctx, ev.PodNamespace, ev.PodName, ev.PodUID)
	if err != nil {
		return false, err
	}
	if a.enrolled(string(pod.UID)) != nil {
		return true, a.checkRules(string(pod.UID))
	}
	pns, err := a.lookupNamespace(ctx, pod.Namespace)
	if err != nil {
		return false, err
	}
	if want, _ := a.cfg.selection().Decide(pod, pns); want {
		return false, fmt.Errorf("pod %s/%s should be enrolled but is not", pod.Namespace, pod.Name)
	}
	return false, nil
}
