package server

import (
	"context"
	"log/slog"
	"slices"
	"time"

	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/registry"
	"github.com/isthmus-mesh/isthmus/pilot/vip"
)

// vipSync keeps the table of allocated virtual addresses in line with the
// services that need one (those with no address on some network that has
// clients, and exported ones), each time the registry's services change.
// It calls Sync only when that set changes: the table lives in a
// ConfigMap, and every Sync reads it.
type vipSync struct {
	alloc *vip.Allocator
	reg   *registry.Registry
	log   *slog.Logger
	retry time.Duration
}

// Run syncs until ctx ends.
func (v *vipSync) Run(ctx context.Context) error {
	kick := make(chan struct{}, 1)
	poke := func() {
		select {
		case kick <- struct{}{}:
		default:
		}
	}
	stop := v.reg.Subscribe(func(cs model.ChangeSet) {
		if slices.ContainsFunc(cs.Changes, func(c model.Change) bool { return c.Kind == model.ServiceChange }) {
			poke()
		}
	})
	defer stop()
	select {
	case <-ctx.Done():
		return nil
	case <-v.alloc.Synced():
	}
	poke()
	var last []string
	var synced bool
	for {
		var retry <-chan time.Time
		if !synced {
			retry = time.After(v.retry)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-kick:
		case <-retry:
		}
		services := v.reg.Services()
		hosts := vip.Hostnames(services, clientNetworks(services), (*model.Service).HasExport)
		if synced && slices.Equal(hosts, last) {
			continue
		}
		if err := v.alloc.Sync(ctx, hosts); err != nil && ctx.Err() == nil {
			v.log.Error("virtual address allocation failed; retrying", "services", len(hosts), "err", err)
			synced = false
			continue
		}
		last, synced = hosts, true
	}
}

// clientNetworks returns the networks with workloads or service addresses:
// those whose clients may need an address for a service that is elsewhere.
func clientNetworks(services []*model.Service) []model.Network {
	seen := map[model.Network]bool{}
	for _, s := range services {
		for _, n := range s.VIPNetworks {
			seen[n] = true
		}
		for _, shard := range s.Shards {
			for i := range shard {
				seen[shard[i].Network()] = true
			}
		}
	}
	out := make([]model.Network, 0, len(seen))
	for n := range seen {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}
