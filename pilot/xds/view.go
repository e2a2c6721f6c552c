package xds

import (
	"bytes"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync/atomic"

	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/protobuf/proto"

	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// allTypes are the type URLs every view serves.
var allTypes = append([]string{WorkloadType, IstioAddressType}, envoyTypes...)

// direct reports whether type t's resources are kept in its cache's own
// map only (see view.current): the workload types.
func direct(t string) bool { return t == WorkloadType || t == IstioAddressType }

// view holds what one class of clients sees: each type in a typeCache,
// combined by a MuxCache keyed by type URL.
//
// A view builds only the resources its clients ask for: the workload type
// once a client of the class asks for it (ztunnels), Istio's workload type
// once an Istio ztunnel asks for it (encoded from the same built
// resources: istio.go), the four Envoy types
// together once a client asks for any of them (Envoy, proxyless gRPC). A
// class of ztunnels holds no Envoy resources and a class of gRPC clients no
// workloads.
//
// The caches are safe for concurrent use. current and owned are touched only
// by the builder, which holds Server.buildMu, and so is building; ready is
// written under buildMu and read anywhere.
type view struct {
	class class
	// caches are the Envoy types' caches.
	caches map[string]*typeCache
	// building is set per group of types (workloadGroup, envoyGroup) once a
	// client asked for one of them: the builder keeps that group up to date.
	building [3]bool
	// ready is set once a group's resources are in the caches, so that
	// watches may be opened on them.
	ready [3]atomic.Bool
	// workloads serves the workload type, istio Istio's.
	workloads, istio *typeCache
	mux              *cache.MuxCache

	// current are the Envoy types' resources in the caches (raw, see
	// raw.go), per type URL and name. The workload types' are the delta
	// caches' own maps (see stored): at 50,000 endpoints a second map and a
	// holder message per resource cost ~90 B each, per class.
	current map[string]map[string]types.Resource
	// owned are the names each service hostname owns, per type URL.
	owned map[string]map[string][]string
	// visible is the visibility (see visibility) each service was last
	// built with.
	visible map[string]string
}

// Type groups built together.
const (
	workloadGroup = iota
	envoyGroup
	istioGroup
)

func groupOf(typeURL string) int {
	switch typeURL {
	case WorkloadType:
		return workloadGroup
	case IstioAddressType:
		return istioGroup
	}
	return envoyGroup
}

// cache returns the cache serving type t in v.
func (v *view) cache(t string) *typeCache {
	switch t {
	case WorkloadType:
		return v.workloads
	case IstioAddressType:
		return v.istio
	}
	return v.caches[t]
}

// buildsAddresses reports whether v builds the workload discovery
// resources, for either encoding.
func (v *view) buildsAddresses() bool { return v.serves(WorkloadType) || v.serves(IstioAddressType) }

// serves reports whether the builder keeps resources of type t up to date
// in v. The caller holds Server.buildMu. A view of a locality serves EDS
// only: the other Envoy types do not depend on the client's locality, and
// are served from its network and cluster's view (Server.classFor).
func (v *view) serves(t string) bool {
	if v.class.Locality != (model.Locality{}) && t != resource.EndpointType {
		return false
	}
	return v.building[groupOf(t)]
}

// isReady reports whether v's caches hold the resources of type t.
func (v *view) isReady(t string) bool { return v.ready[groupOf(t)].Load() }

func newView(c class, versionPrefix string, logger slogAdapter) *view {
	v := &view{
		class:   c,
		caches:  make(map[string]*typeCache, len(allTypes)),
		current: make(map[string]map[string]types.Resource, len(allTypes)),
		owned:   make(map[string]map[string][]string),
		visible: make(map[string]string),
	}
	muxed := make(map[string]cache.Cache, len(allTypes))
	for _, t := range allTypes {
		if direct(t) {
			continue
		}
		v.current[t] = make(map[string]types.Resource)
		tc := newTypeCache(t, versionPrefix, logger)
		v.caches[t] = tc
		muxed[t] = tc
	}
	v.workloads = newTypeCache(WorkloadType, versionPrefix, logger)
	muxed[WorkloadType] = v.workloads
	v.istio = newTypeCache(IstioAddressType, versionPrefix, logger)
	muxed[IstioAddressType] = v.istio
	byType := func(t string) string { return t }
	v.mux = &cache.MuxCache{
		Classify:      func(r *cache.Request) string { return byType(r.GetTypeUrl()) },
		ClassifyDelta: func(r *cache.DeltaRequest) string { return byType(r.GetTypeUrl()) },
		Caches:        muxed,
	}
	return v
}

// batch collects one view's updates and deletions per type URL before they
// are handed to the caches, one UpdateResources call per type.
type batch struct {
	v       *view
	updated map[string]map[string]types.Resource
	deleted map[string]map[string]struct{}
	// touched, when not nil, records every name put (for a full resync).
	touched map[string]map[string]struct{}
	// err is the first resource that could not be encoded.
	err error
}

func (v *view) newBatch(full bool) *batch {
	b := &batch{v: v, updated: map[string]map[string]types.Resource{}, deleted: map[string]map[string]struct{}{}}
	if full {
		b.touched = map[string]map[string]struct{}{}
	}
	return b
}

// put sets resource name of type t, in its raw form, unless an equal one is
// already there.
func (b *batch) put(t, name string, m proto.Message) {
	if b.touched != nil {
		if b.touched[t] == nil {
			b.touched[t] = map[string]struct{}{}
		}
		b.touched[t][name] = struct{}{}
	}
	r, err := toRaw(m)
	if err != nil {
		if b.err == nil {
			b.err = fmt.Errorf("encode %s %s: %w", t, name, err)
		}
		return
	}
	if cur, ok := b.current(t, name); ok && bytes.Equal(cur, rawBytes(r)) {
		return
	}
	if !direct(t) {
		b.v.current[t][name] = r
	}
	delete(b.deleted[t], name)
	if b.updated[t] == nil {
		b.updated[t] = map[string]types.Resource{}
	}
	b.updated[t][name] = r
}

// current returns the encoding of resource name of type t as it stands
// with this batch so far.
func (b *batch) current(t, name string) ([]byte, bool) {
	if r, ok := b.updated[t][name]; ok {
		return rawBytes(r), true
	}
	if _, ok := b.deleted[t][name]; ok {
		return nil, false
	}
	return b.v.stored(t, name)
}

// stored returns the encoding of resource name of type t in v's caches.
// The caller holds Server.buildMu.
func (v *view) stored(t, name string) ([]byte, bool) {
	if direct(t) {
		// Read without the cache's lock: only the builder, which holds
		// buildMu, writes the map.
		e, ok := v.cache(t).resources[name]
		return e.raw, ok
	}
	r, ok := v.current[t][name]
	if !ok {
		return nil, false
	}
	return rawBytes(r), true
}

// del removes resource name of type t if it is there.
func (b *batch) del(t, name string) {
	if _, ok := b.current(t, name); !ok {
		return
	}
	if !direct(t) {
		delete(b.v.current[t], name)
	}
	delete(b.updated[t], name)
	if b.deleted[t] == nil {
		b.deleted[t] = map[string]struct{}{}
	}
	b.deleted[t][name] = struct{}{}
}

// workload rebuilds the Address of workload uid, in each encoding v
// serves.
func (b *batch) workload(bd *builder, uid string) {
	isthmus, istio := b.v.serves(WorkloadType), b.v.serves(IstioAddressType)
	if !isthmus && !istio {
		return
	}
	w := bd.reg.Workload(uid)
	if w != nil && !bd.reg.OwnsAddresses(uid) {
		w = nil // another workload is served for its address
	}
	if a := buildWorkload(b.v.class, w, bd.td, bd.reg.Service); a != nil {
		if isthmus {
			b.put(WorkloadType, uid, a)
		}
		if istio {
			name, ia := bd.istio.address(uid, a)
			b.put(IstioAddressType, name, ia)
		}
		return
	}
	if !b.ownedByService(uid) {
		b.del(WorkloadType, uid)
		b.del(IstioAddressType, IstioWorkloadUID(uid))
	}
}

// ownedByService reports whether a workload-type name belongs to a service
// (a split-horizon workload), so a workload change must not delete it.
func (b *batch) ownedByService(name string) bool {
	if !strings.HasPrefix(name, workloadv1.SplitHorizonUIDPrefix) {
		return false
	}
	for _, names := range b.v.owned {
		for _, n := range names[WorkloadType] {
			if n == name {
				return true
			}
		}
	}
	return false
}

// service rebuilds every resource the service with hostname owns, and
// deletes those it no longer owns.
func (b *batch) service(bd *builder, hostname string) error {
	fresh := make(map[string]map[string]types.Resource, len(allTypes))
	for _, t := range allTypes {
		fresh[t] = map[string]types.Resource{}
	}
	s := bd.reg.Service(hostname)
	if b.v.buildsAddresses() {
		buildServiceAddresses(b.v.class, s, bd.gws, bd.td, bd.alloc, fresh[WorkloadType])
		if b.v.serves(IstioAddressType) {
			for n, r := range fresh[WorkloadType] {
				if name, ia := bd.istio.address(n, r.(*workloadv1.Address)); ia != nil {
					fresh[IstioAddressType][name] = ia
				}
			}
		}
		// Which clusters' endpoints are visible changed (an export, a
		// cluster-local setting): the service bindings of its workloads
		// change with it, though the workloads themselves did not.
		if vis, was := visibility(s), b.v.visible[hostname]; vis != was {
			if vis == "" {
				delete(b.v.visible, hostname)
			} else {
				b.v.visible[hostname] = vis
			}
			if s != nil {
				for _, shard := range s.Shards {
					for i := range shard {
						b.workload(bd, shard[i].Workload.UID)
					}
				}
			}
		}
	}
	if b.v.serves(resource.EndpointType) {
		if err := bd.envoy.build(b.v.class, s, bd.gws, bd.td, fresh); err != nil {
			return fmt.Errorf("service %s: %w", hostname, err)
		}
	}
	old := b.v.owned[hostname]
	names := make(map[string][]string, len(allTypes))
	for _, t := range allTypes {
		if !b.v.serves(t) {
			continue
		}
		for _, n := range old[t] {
			if _, keep := fresh[t][n]; !keep {
				b.del(t, n)
			}
		}
		for n, r := range fresh[t] {
			b.put(t, n, r)
			names[t] = append(names[t], n)
		}
	}
	if len(names) == 0 {
		delete(b.v.owned, hostname)
	} else {
		b.v.owned[hostname] = names
	}
	return nil
}

// sweep deletes every resource a full resync did not put.
func (b *batch) sweep() {
	for _, t := range allTypes {
		var names []string
		if direct(t) {
			names = slices.Collect(maps.Keys(b.v.cache(t).resources))
		} else {
			names = slices.Collect(maps.Keys(b.v.current[t]))
		}
		for _, name := range names {
			if _, ok := b.touched[t][name]; !ok {
				b.del(t, name)
			}
		}
	}
}

// flush hands the batch to the caches and returns the number of resources
// updated and deleted.
func (b *batch) flush() (int, error) {
	n := 0
	for _, t := range allTypes {
		up, del := b.updated[t], b.deleted[t]
		if len(up) == 0 && len(del) == 0 {
			continue
		}
		n += len(up) + len(del)
		u := b.v.cache(t)
		if err := u.UpdateResources(up, slices.Collect(maps.Keys(del))); err != nil {
			return n, fmt.Errorf("update %s cache of class %s: %w", t, b.v.class, err)
		}
	}
	// A resource that could not be encoded was left out; the others went.
	return n, b.err
}
