package controller

import (
	"cmp"
	"slices"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

func (v *view) gatewaysChanged() {
	v.delta.GatewaysChanged = true
	v.delta.Gateways = v.gatewayList()
}

// gatewayList returns every gateway candidate of the cluster, resolved:
// trusted or ignored (with the reason), with its identities and capacity.
func (v *view) gatewayList() []model.NetworkGateway {
	var out []model.NetworkGateway
	for k, s := range v.services {
		if s.gateway != nil {
			out = append(out, v.resolveGateway(k, *s.gateway))
		}
	}
	slices.SortFunc(out, func(a, b model.NetworkGateway) int { return cmp.Compare(a.Key(), b.Key()) })
	return out
}

// resolveGateway decides whether the candidate g of Service k is trusted:
// only Services in the operator's gateway namespaces qualify (any tenant can
// label a Service and give it external IPs), and only with an address and a
// known identity. The identities are the annotated service accounts, else
// those of the pods the Service selects; the capacity is its ready pods.
func (v *view) resolveGateway(k model.ServiceKey, g model.NetworkGateway) model.NetworkGateway {
	var ready uint32
	var podAccounts []string
	if sh := v.shards[k]; sh != nil {
		for i := range sh.eps {
			e := &sh.eps[i]
			if e.Ready() && !e.Terminating() {
				ready++
			}
			podAccounts = append(podAccounts, cmp.Or(e.ServiceAccount(), "default"))
		}
	}
	return TrustGateway(g, v.gatewayNS[k.Namespace] || v.selectedNS[k.Namespace], podAccounts, ready)
}

// TrustGateway decides whether the candidate g (from GatewayCandidate) is a
// gateway: trustedNamespace says whether its Service's namespace is one of
// the operator's gateway namespaces; podAccounts are the service accounts
// of the pods the Service selects ("default" for none named) and ready
// counts the ready ones. Without annotated accounts the pods' are its
// identities; the capacity is its ready pods, at least 1. An untrusted
// candidate gets its reason in Ignored.
func TrustGateway(g model.NetworkGateway, trustedNamespace bool, podAccounts []string, ready uint32) model.NetworkGateway {
	if len(g.ServiceAccounts) == 0 {
		accounts := slices.Clone(podAccounts)
		slices.Sort(accounts)
		g.ServiceAccounts = slices.Compact(accounts)
	}
	g.Capacity = max(ready, 1)
	switch {
	case !trustedNamespace:
		g.Ignored = model.GatewayIgnoredUntrustedNamespace
	case !g.Address.IsValid() && g.Hostname == "":
		g.Ignored = model.GatewayIgnoredNoAddress
	case len(g.ServiceAccounts) == 0:
		g.Ignored = model.GatewayIgnoredNoIdentity
	}
	return g
}

// setGatewayNamespaceSelected records whether namespace ns matches the
// operator's gateway namespace selector.
func (v *view) setGatewayNamespaceSelected(ns string, selected bool) {
	if v.selectedNS[ns] == selected {
		return
	}
	if selected {
		v.selectedNS[ns] = true
	} else {
		delete(v.selectedNS, ns)
	}
	for k, s := range v.services {
		if k.Namespace == ns && s.gateway != nil {
			v.gatewaysChanged()
			return
		}
	}
}
