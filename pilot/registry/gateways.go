package registry

import (
	"cmp"
	"maps"
	"slices"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

func gatewaysEqual(a, b []model.NetworkGateway) bool {
	return slices.EqualFunc(a, b, model.NetworkGateway.Equal)
}

// logIgnoredGateways logs each candidate that becomes ignored, or ignored
// for another reason, as the registry takes in next.
func (r *Registry) logIgnoredGateways(next []model.NetworkGateway) {
	was := map[string]string{}
	for _, g := range r.gateways {
		was[g.Key()] = g.Ignored
	}
	for _, g := range next {
		if g.Ignored != "" && was[g.Key()] != g.Ignored {
			r.log.Warn("ignoring east-west gateway candidate", "cluster", g.Cluster, "service", g.Source,
				"network", g.Network, "reason", g.Ignored)
		}
	}
}

// rebuildGateways recomputes the gateway list and reports the networks
// whose gateways changed.
func (r *Registry) rebuildGateways(changes []model.Change) []model.Change {
	var all []model.NetworkGateway
	for _, cs := range r.clusters {
		all = append(all, cs.gateways...)
	}
	slices.SortFunc(all, func(a, b model.NetworkGateway) int { return cmp.Compare(a.Key(), b.Key()) })
	before := map[model.Network][]model.NetworkGateway{}
	for _, g := range r.gateways {
		before[g.Network] = append(before[g.Network], g)
	}
	after := map[model.Network][]model.NetworkGateway{}
	for _, g := range all {
		after[g.Network] = append(after[g.Network], g)
	}
	r.logIgnoredGateways(all)
	r.gateways = all
	nets := map[model.Network]bool{}
	for n := range before {
		nets[n] = true
	}
	for n := range after {
		nets[n] = true
	}
	for _, n := range slices.Sorted(maps.Keys(nets)) {
		b, a := before[n], after[n]
		switch {
		case gatewaysEqual(b, a):
		case len(a) == 0:
			changes = append(changes, model.Change{Kind: model.GatewayChange, Op: model.Removed, Key: string(n)})
		case len(b) == 0:
			changes = append(changes, model.Change{Kind: model.GatewayChange, Op: model.Added, Key: string(n)})
		default:
			changes = append(changes, model.Change{Kind: model.GatewayChange, Op: model.Updated, Key: string(n)})
		}
	}
	return changes
}
