package agent

import (
	"bufio"
	"bytes"
	"path"
	"strings"
)

// The kubelet puts every process of a pod into the pod's cgroup, which it
// names after the pod's UID; a tenant cannot move its processes out of its
// own cgroup or create one named after another pod outside its own subtree.
// So the cgroup of a process says which pod it belongs to, where an address
// a tenant can put on any interface of its own does not.
//
// The layouts (kubelet's pod_container_manager, both drivers, cgroup v1
// and v2 alike; <root> is one of Config.PodCgroupRoots):
//
//	cgroupfs: <root>/pod<uid>/<container> or <root>/{burstable,besteffort}/pod<uid>/<container>
//	systemd:  <root>/<p>-pod<uid_>.slice/<scope> or
//	          <root>/<p>-{burstable,besteffort}.slice/<p>-{burstable,besteffort}-pod<uid_>.slice/<scope>
//
// where uid_ is the UID with '_' for '-' (a '-' separates systemd slice
// levels) and <p> is the root's slice name without ".slice" (kubepods for
// /kubepods.slice). A process in a cgroup namespace of its own sees paths relative to
// it; the agent (privileged, or in the node's cgroup namespace) sees them
// from the root. A path seen from a cgroup namespace of the agent's own
// starts with ".." segments and lost its root: then only what follows the
// "..", a QoS segment and the pod segment, is checked.

// qosClasses are the kubelet's QoS cgroups below the root (guaranteed pods
// sit directly under it).
var qosClasses = []string{"burstable", "besteffort"}

// podUIDOfCgroups returns the pod UID of the process whose /proc/<pid>/cgroup
// is data: the UID of the kubelet pod cgroup each line's path lies in, when
// every line that lies in one names the same pod; "" when none does or lines
// disagree.
func podUIDOfCgroups(data []byte, roots []string) string {
	uid := ""
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		// hierarchy-ID:controller-list:cgroup-path (v2: "0::path"); the
		// path may itself hold ':'.
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		u := podUIDOfPath(parts[2], roots)
		if u == "" {
			continue
		}
		if uid != "" && u != uid {
			return ""
		}
		uid = u
	}
	return uid
}

// podUIDOfPath returns the UID of the kubelet pod cgroup that path lies in
// (see the layouts above), or "".
func podUIDOfPath(p string, roots []string) string {
	if !strings.HasPrefix(p, "/") {
		return ""
	}
	segs := strings.Split(strings.Trim(p, "/"), "/")
	rel := false
	for len(segs) > 0 && segs[0] == ".." {
		segs, rel = segs[1:], true
	}
	if rel {
		prefixes := []string{"kubepods"}
		for _, root := range roots {
			prefixes = append(prefixes, slicePrefix(root))
		}
		// The QoS parent may be part of what the view lost.
		for _, pre := range prefixes {
			for _, q := range qosClasses {
				if len(segs) == 0 {
					break
				}
				if uid, ok := podSegment(segs[0], pre, q); ok {
					return uid
				}
			}
		}
		return podUIDAfterRoot(segs, prefixes)
	}
	for _, root := range roots {
		rs := strings.Split(strings.Trim(root, "/"), "/")
		if len(segs) <= len(rs) || !equalSegs(segs[:len(rs)], rs) {
			continue
		}
		if uid := podUIDAfterRoot(segs[len(rs):], []string{slicePrefix(root)}); uid != "" {
			return uid
		}
	}
	return ""
}

// slicePrefix is the name systemd slices below root start with:
// kubelet-kubepods for /kubelet.slice/kubelet-kubepods.slice; kubepods for
// a cgroupfs root.
func slicePrefix(root string) string {
	if p, ok := strings.CutSuffix(path.Base(root), ".slice"); ok {
		return p
	}
	return "kubepods"
}

// podUIDAfterRoot reads [qos/]pod-segment[/...] and returns the pod's UID;
// prefixes are the names systemd slices below the root may start with.
func podUIDAfterRoot(segs []string, prefixes []string) string {
	if len(segs) == 0 {
		return ""
	}
	for _, pre := range prefixes {
		if uid, ok := podSegment(segs[0], pre, ""); ok {
			return uid
		}
		if len(segs) < 2 {
			continue
		}
		for _, q := range qosClasses {
			if segs[0] == q || segs[0] == pre+"-"+q+".slice" {
				if uid, ok := podSegment(segs[1], pre, q); ok {
					return uid
				}
			}
		}
	}
	return ""
}

// podSegment parses a pod cgroup's name: pod<uid> (cgroupfs) or
// <prefix>[-<qos>]-pod<uid_>.slice (systemd), qos being the class of the
// parent segment ("" directly under the root).
func podSegment(seg, prefix, qos string) (string, bool) {
	if uid, ok := strings.CutPrefix(seg, "pod"); ok {
		return validUID(uid, '-')
	}
	if qos != "" {
		prefix += "-" + qos
	}
	rest, ok := strings.CutPrefix(seg, prefix+"-pod")
	if !ok {
		return "", false
	}
	rest, ok = strings.CutSuffix(rest, ".slice")
	if !ok {
		return "", false
	}
	uid, ok := validUID(rest, '_')
	return strings.ReplaceAll(uid, "_", "-"), ok
}

// validUID accepts what the kubelet writes: a UUID, or the hex hash of a
// static pod; sep is the separator the driver uses in place of '-'.
func validUID(s string, sep byte) (string, bool) {
	if len(s) < 8 || len(s) > 64 {
		return "", false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= '0' && c <= '9', c >= 'a' && c <= 'f', c == sep:
		default:
			return "", false
		}
	}
	return s, true
}

func equalSegs(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
