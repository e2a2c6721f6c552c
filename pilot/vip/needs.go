package vip

import (
	"slices"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// Needs reports whether svc needs an allocated address for clients in one
// of networks (the networks that have clients): it is not cluster-local
// and one of those networks has none of its VIPs (a headless service has
// none anywhere; its pods on other networks are answered through the
// allocated address). Exported services also need one for their
// clusterset IP; the caller adds those.
func Needs(svc *model.Service, networks []model.Network) bool {
	if svc.Scope == model.ScopeClusterLocal {
		return false
	}
	for _, n := range networks {
		has := false
		for c, vips := range svc.VIPs {
			if len(vips) > 0 && svc.VIPNetworks[c] == n {
				has = true
				break
			}
		}
		if !has {
			return true
		}
	}
	return false
}

// Hostnames returns, sorted, the hostnames of the services that Need an
// address plus those of exported, for Allocator.Sync.
func Hostnames(services []*model.Service, networks []model.Network, exported func(*model.Service) bool) []string {
	var out []string
	for _, s := range services {
		if Needs(s, networks) || (exported != nil && exported(s)) {
			out = append(out, s.Hostname)
		}
	}
	slices.Sort(out)
	return out
}
