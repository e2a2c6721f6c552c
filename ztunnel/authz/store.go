package authz

import (
	"errors"
	"fmt"
	"maps"
	"sync"
	"sync/atomic"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/protobuf/proto"

	securityv1 "github.com/isthmus-mesh/isthmus/pilot/api/security/v1"
)

// Store holds the authorization resources pilot sent this ztunnel and
// publishes them as immutable Snapshots. It is the xDS client's handler of
// the securityv1.TypeURL type (it implements xdsclient.TypeHandler): each
// response is applied as one swap, so a check never sees a workload
// binding without the policies sent with it. Safe for concurrent use;
// readers never lock.
type Store struct {
	mu   sync.Mutex // serialises Apply
	held map[string]heldResource
	cur  atomic.Pointer[published]
}

type heldResource struct {
	version string
	policy  *policy
	binding *boundSource
}

// published is one snapshot and the channel closed when it is replaced.
type published struct {
	snap   *Snapshot
	stale  chan struct{}
	synced bool
}

// NewStore returns an empty Store: until the first response is applied it
// knows no workload, and every check is refused as unknown.
func NewStore() *Store {
	s := &Store{held: map[string]heldResource{}}
	s.cur.Store(&published{snap: emptySnapshot, stale: make(chan struct{})})
	return s
}

// TypeURL returns securityv1.TypeURL.
func (s *Store) TypeURL() string { return securityv1.TypeURL }

// Load returns the current snapshot.
func (s *Store) Load() *Snapshot { return s.cur.Load().snap }

// Current returns the current snapshot and a channel closed when it is
// replaced.
func (s *Store) Current() (*Snapshot, <-chan struct{}) {
	p := s.cur.Load()
	return p.snap, p.stale
}

// Synced reports whether a response from pilot has been applied.
func (s *Store) Synced() bool { return s.cur.Load().synced }

// Versions returns the resources held, name -> version, for a stream's
// initial_resource_versions.
func (s *Store) Versions() map[string]string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]string, len(s.held))
	for n, h := range s.held {
		out[n] = h.version
	}
	return out
}

// Apply applies one delta response: the resources that decode and compile
// replace those of their names, removed names go, and the result is
// published as one snapshot. It returns the errors of the rejected
// resources, which keep their last good version. Errors never include a
// resource's bytes.
func (s *Store) Apply(resources []*discovery.Resource, removed []string) []error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var rejected []error
	next := maps.Clone(s.held)
	for _, name := range removed {
		delete(next, name)
	}
	for _, r := range resources {
		h, err := decode(r)
		if err != nil {
			rejected = append(rejected, err)
			continue
		}
		next[r.GetName()] = h
	}
	s.held = next
	pols := map[string]*policy{}
	wls := map[string]*boundSource{}
	for _, h := range next {
		switch {
		case h.policy != nil:
			pols[h.policy.key()] = h.policy
		case h.binding != nil:
			wls[h.binding.src.GetUid()] = h.binding
		}
	}
	old := s.cur.Load()
	s.cur.Store(&published{snap: build(pols, wls), stale: make(chan struct{}), synced: true})
	close(old.stale)
	return rejected
}

// decode unmarshals, checks and compiles one resource.
func decode(r *discovery.Resource) (heldResource, error) {
	name := r.GetName()
	if name == "" {
		return heldResource{}, errors.New("authorization resource without a name")
	}
	if t := r.GetResource().GetTypeUrl(); t != securityv1.TypeURL {
		return heldResource{}, fmt.Errorf("resource %q: type %q, want %q", name, t, securityv1.TypeURL)
	}
	a := &securityv1.Authorization{}
	if err := proto.Unmarshal(r.GetResource().GetValue(), a); err != nil {
		return heldResource{}, fmt.Errorf("resource %q: unmarshal: %w", name, err)
	}
	h := heldResource{version: r.GetVersion()}
	switch k := a.GetKind().(type) {
	case *securityv1.Authorization_Policy:
		p, err := compilePolicy(k.Policy)
		if err != nil {
			return heldResource{}, fmt.Errorf("resource %q: %w", name, err)
		}
		if want := securityv1.PolicyName(p.namespace, p.name); want != name {
			return heldResource{}, fmt.Errorf("resource %q: a policy named %q", name, want)
		}
		h.policy = p
	case *securityv1.Authorization_Workload:
		b, err := compileBinding(k.Workload)
		if err != nil {
			return heldResource{}, fmt.Errorf("resource %q: %w", name, err)
		}
		if want := securityv1.WorkloadName(b.src.GetUid()); want != name {
			return heldResource{}, fmt.Errorf("resource %q: a binding named %q", name, want)
		}
		h.binding = b
	default:
		return heldResource{}, fmt.Errorf("resource %q: %w: no kind", name, errInvalid)
	}
	return h, nil
}
