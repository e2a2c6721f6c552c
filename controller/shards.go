package controller

import (
	"net/netip"
	"slices"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// shard is one service's endpoints, sorted by workload uid. Once published
// (handed to the sink) its slice is never written again: the next change
// copies it first, so a burst of changes between two flushes costs one copy.
type shard struct {
	eps    []model.Endpoint
	shared bool
	// fromSlices: the endpoints were made from EndpointSlices (the
	// service has no selector), not from pods.
	fromSlices bool
	// dups are the addresses its slices list more than once (nil: none).
	dups map[netip.Addr]struct{}
}

func (sh *shard) dup(a netip.Addr) bool {
	_, ok := sh.dups[a]
	return ok
}

func (sh *shard) publish() []model.Endpoint {
	sh.shared = true
	return sh.eps
}

func (sh *shard) own() {
	if sh.shared {
		sh.eps = slices.Clone(sh.eps)
		sh.shared = false
	}
}

func (sh *shard) find(uid string) (int, bool) {
	return model.FindEndpoint(sh.eps, uid)
}

// setEndpoint records the endpoint of workload uid in service k's shard
// (nil: none) and marks the shard changed when it did.
func (v *view) setEndpoint(k model.ServiceKey, uid string, ep *model.Endpoint) {
	sh := v.shards[k]
	if sh == nil {
		if ep == nil {
			return
		}
		sh = &shard{}
		v.shards[k] = sh
	}
	i, found := sh.find(uid)
	switch {
	case ep == nil && !found:
		return
	case ep == nil:
		sh.own()
		sh.eps = slices.Delete(sh.eps, i, i+1)
		if len(sh.eps) == 0 {
			delete(v.shards, k)
		}
	case found && sh.eps[i].Workload == ep.Workload && slices.Equal(sh.eps[i].Ports, ep.Ports):
		return
	case found:
		sh.own()
		sh.eps[i] = *ep
	default:
		sh.own()
		sh.eps = slices.Insert(sh.eps, i, *ep)
	}
	v.markShard(k)
}

func (v *view) markShard(k model.ServiceKey) {
	if v.delta.Shards == nil {
		v.delta.Shards = map[model.ServiceKey][]model.Endpoint{}
	}
	v.delta.Shards[k] = nil // filled at flush time
}
