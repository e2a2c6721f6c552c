package policy

import (
	"cmp"
	"fmt"
	"maps"
	"slices"

	"google.golang.org/protobuf/proto"

	securityv1 "github.com/isthmus-mesh/isthmus/pilot/api/security/v1"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// Snapshot is an immutable, indexed set of converted policies: the
// AuthorizationPolicies and PeerAuthentications of the config cluster at one
// moment. Safe for concurrent use.
type Snapshot struct {
	root string
	// policies are every AuthorizationPolicy, enforced or not, by key.
	policies map[string]*Policy
	// enforced policies by scope: mesh-wide, per namespace (no selector),
	// and selector policies per namespace (the root namespace's apply to
	// every namespace).
	mesh     []*Policy
	byNS     map[string][]*Policy
	selected map[string][]*Policy
	// encoded are the resource encodings of the enforced policies.
	encoded map[string][]byte
	// peerAuths are every PeerAuthentication by key; meshPA, nsPA and selPA
	// index those that apply to some workload (not the Ignored ones) by
	// level, oldest first: mesh (root namespace, no selector), namespace (no
	// selector) and workload (a selector, outside the root namespace).
	peerAuths map[string]*PeerAuth
	meshPA    []*PeerAuth
	nsPA      map[string][]*PeerAuth
	selPA     map[string][]*PeerAuth
}

// NewSnapshot indexes converted policies; rootNS is the mesh's root
// namespace. It encodes each enforced policy once.
func NewSnapshot(rootNS string, aps []*Policy, pas []*PeerAuth) (*Snapshot, error) {
	s := &Snapshot{
		root: rootNS, policies: map[string]*Policy{}, byNS: map[string][]*Policy{}, selected: map[string][]*Policy{},
		encoded: map[string][]byte{}, peerAuths: map[string]*PeerAuth{}, nsPA: map[string][]*PeerAuth{}, selPA: map[string][]*PeerAuth{},
	}
	aps = slices.Clone(aps)
	slices.SortFunc(aps, func(a, b *Policy) int { return cmp.Compare(a.Key(), b.Key()) })
	for _, p := range aps {
		s.policies[p.Key()] = p
		if p.Proto == nil {
			continue
		}
		switch p.Proto.GetScope() {
		case securityv1.Scope_MESH:
			s.mesh = append(s.mesh, p)
		case securityv1.Scope_NAMESPACE:
			s.byNS[p.Namespace] = append(s.byNS[p.Namespace], p)
		default:
			s.selected[p.Namespace] = append(s.selected[p.Namespace], p)
		}
		b, err := proto.MarshalOptions{Deterministic: true}.Marshal(&securityv1.Authorization{Kind: &securityv1.Authorization_Policy{Policy: p.Proto}})
		if err != nil {
			return nil, fmt.Errorf("encode policy %s: %w", p.Key(), err)
		}
		s.encoded[securityv1.PolicyName(p.Namespace, p.Name)] = b
	}
	pas = slices.Clone(pas)
	slices.SortFunc(pas, func(a, b *PeerAuth) int {
		return cmp.Or(a.Created.Compare(b.Created), cmp.Compare(a.Key(), b.Key()))
	})
	for _, pa := range pas {
		s.peerAuths[pa.Key()] = pa
		switch {
		case pa.Ignored:
			// A root-namespace policy with a selector: listed, never applied
			// (see ConvertPeerAuthentication).
		case pa.Selector != nil:
			s.selPA[pa.Namespace] = append(s.selPA[pa.Namespace], pa)
		case pa.Namespace == rootNS:
			s.meshPA = append(s.meshPA, pa)
		default:
			s.nsPA[pa.Namespace] = append(s.nsPA[pa.Namespace], pa)
		}
	}
	return s, nil
}

// RootNamespace returns the mesh's root namespace.
func (s *Snapshot) RootNamespace() string { return s.root }

// Policies returns every AuthorizationPolicy, enforced or not, by key order.
func (s *Snapshot) Policies() []*Policy {
	return slices.SortedFunc(maps.Values(s.policies), func(a, b *Policy) int { return cmp.Compare(a.Key(), b.Key()) })
}

// PeerAuths returns every PeerAuthentication, oldest first.
func (s *Snapshot) PeerAuths() []*PeerAuth {
	return slices.SortedFunc(maps.Values(s.peerAuths), func(a, b *PeerAuth) int {
		return cmp.Or(a.Created.Compare(b.Created), cmp.Compare(a.Key(), b.Key()))
	})
}

// Policy returns the AuthorizationPolicy with key "<namespace>/<name>".
func (s *Snapshot) Policy(key string) *Policy { return s.policies[key] }

// selects reports whether selector selects labels (every label of the
// selector is set to its value).
func selects(selector, labels map[string]string) bool {
	for k, v := range selector {
		if got, ok := labels[k]; !ok || got != v {
			return false
		}
	}
	return true
}

// Applicable returns the enforced policies that apply to a workload of
// namespace ns with labels, in key order: mesh-wide ones, those of ns, and
// the selector policies (of ns, or of the root namespace) that select it.
func (s *Snapshot) Applicable(ns string, labels map[string]string) []*Policy {
	out := slices.Concat(s.mesh, s.byNS[ns])
	out = append(out, s.selectorPolicies(ns, labels)...)
	slices.SortFunc(out, func(a, b *Policy) int { return cmp.Compare(a.Key(), b.Key()) })
	return out
}

func (s *Snapshot) selectorPolicies(ns string, labels map[string]string) []*Policy {
	var out []*Policy
	for _, p := range s.selected[ns] {
		if selects(p.Selector, labels) {
			out = append(out, p)
		}
	}
	if ns != s.root {
		for _, p := range s.selected[s.root] {
			if selects(p.Selector, labels) {
				out = append(out, p)
			}
		}
	}
	return out
}

// PeerAuthentication returns the effective PeerAuthentication of a workload
// of namespace ns with labels: the oldest matching policy of each level
// (mesh, namespace, workload selector), a more specific level's mode
// replacing a broader one's unless UNSET, STRICT when none sets it; port
// modes from the workload-level policy (UNSET ports inherit).
func (s *Snapshot) PeerAuthentication(ns string, labels map[string]string) *securityv1.PeerAuthentication {
	out := &securityv1.PeerAuthentication{Mode: securityv1.MTLSMode_STRICT}
	var levels []*PeerAuth
	if len(s.meshPA) > 0 {
		levels = append(levels, s.meshPA[0])
	}
	if ns != s.root && len(s.nsPA[ns]) > 0 {
		levels = append(levels, s.nsPA[ns][0])
	}
	var wl *PeerAuth
	for _, pa := range s.selPA[ns] {
		if selects(pa.Selector, labels) {
			wl = pa
			break
		}
	}
	if wl != nil {
		levels = append(levels, wl)
	}
	for _, pa := range levels {
		out.Sources = append(out.Sources, pa.Key())
		if pa.ModeSet {
			out.Mode = pa.Mode
		}
	}
	if wl != nil && len(wl.Ports) > 0 {
		out.Ports = maps.Clone(wl.Ports)
	}
	return out
}

// Binding returns the WorkloadPolicies of w.
func (s *Snapshot) Binding(w *model.Workload) *securityv1.WorkloadPolicies {
	b := &securityv1.WorkloadPolicies{Uid: w.UID, Namespace: w.Namespace, PeerAuthentication: s.PeerAuthentication(w.Namespace, w.Labels)}
	for _, p := range s.selectorPolicies(w.Namespace, w.Labels) {
		b.Policies = append(b.Policies, p.Key())
	}
	slices.Sort(b.Policies)
	return b
}

// Enforced reports whether w is a workload whose inbound traffic a node
// ztunnel authorizes: a pod on a node, captured (not hostNetwork).
func Enforced(w *model.Workload) bool {
	return w != nil && w.Placement != nil && w.Node != "" && !w.HostNetwork && !w.FromSlice
}

// NodeResources returns the authorization resources of a node ztunnel
// whose local workloads are locals, name -> deterministic encoding: every
// mesh-wide policy, the namespace policies of the locals' namespaces, the
// selector policies that select a local, and one binding per local. Policy
// encodings are shared between nodes and must not be modified.
func (s *Snapshot) NodeResources(locals []*model.Workload) (map[string][]byte, error) {
	out := make(map[string][]byte, len(s.mesh)+2*len(locals))
	addPolicy := func(p *Policy) {
		name := securityv1.PolicyName(p.Namespace, p.Name)
		out[name] = s.encoded[name]
	}
	for _, p := range s.mesh {
		addPolicy(p)
	}
	seenNS := map[string]bool{}
	for _, w := range locals {
		if !seenNS[w.Namespace] {
			seenNS[w.Namespace] = true
			for _, p := range s.byNS[w.Namespace] {
				addPolicy(p)
			}
		}
		for _, p := range s.selectorPolicies(w.Namespace, w.Labels) {
			addPolicy(p)
		}
		b, err := proto.MarshalOptions{Deterministic: true}.Marshal(&securityv1.Authorization{Kind: &securityv1.Authorization_Workload{Workload: s.Binding(w)}})
		if err != nil {
			return nil, fmt.Errorf("encode binding of %s: %w", w.UID, err)
		}
		out[securityv1.WorkloadName(w.UID)] = b
	}
	return out, nil
}

// ProblemCounts returns, per kind ("AuthorizationPolicy",
// "PeerAuthentication") and reason, how many policies have that problem.
func (s *Snapshot) ProblemCounts() map[[2]string]int {
	out := map[[2]string]int{}
	for _, p := range s.policies {
		for _, r := range reasonsOf(p.Problems) {
			out[[2]string{KindAuthorizationPolicy, r}]++
		}
	}
	for _, p := range s.peerAuths {
		for _, r := range reasonsOf(p.Problems) {
			out[[2]string{KindPeerAuthentication, r}]++
		}
	}
	return out
}

// reasonsOf returns the distinct reasons of problems.
func reasonsOf(ps []*securityv1.Problem) []string {
	var out []string
	for _, p := range ps {
		if !slices.Contains(out, p.GetReason()) {
			out = append(out, p.GetReason())
		}
	}
	return out
}

// Kinds of policy, as reported.
const (
	KindAuthorizationPolicy = "AuthorizationPolicy"
	KindPeerAuthentication  = "PeerAuthentication"
)

func sortedKeys[V any](m map[string]V) []string { return slices.Sorted(maps.Keys(m)) }
