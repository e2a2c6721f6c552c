package analyzers

import (
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/labels"

	"github.com/isthmus-mesh/isthmus/analysis"
	"github.com/isthmus-mesh/isthmus/analysis/msg"
	"github.com/isthmus-mesh/isthmus/controller"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// gateways returns every gateway candidate of every cluster, resolved by
// pilot's own rule (controller.TrustGateway): trusted, or ignored with the
// reason.
func gateways(s *analysis.Snapshot) []model.NetworkGateway {
	trusted := s.Mesh.TrustedGatewayNamespaces()
	var out []model.NetworkGateway
	for _, c := range s.Clusters {
		for _, svc := range c.Services {
			g := controller.GatewayCandidate(c.ID, svc)
			if g == nil {
				continue
			}
			inTrusted := slices.Contains(trusted, svc.Namespace)
			if sel := s.Mesh.GatewayNamespaceSelector; !inTrusted && sel != nil && !sel.Empty() {
				if ns := c.Namespace(svc.Namespace); ns != nil && sel.Matches(labels.Set(ns.Labels)) {
					inTrusted = true
				}
			}
			var accounts []string
			var ready uint32
			for _, p := range c.SelectedPods(svc) {
				accounts = append(accounts, serviceAccount(p))
				if podReady(p) {
					ready++
				}
			}
			out = append(out, controller.TrustGateway(*g, inTrusted, accounts, ready))
		}
	}
	return out
}

// GatewayCandidates reports gateway candidates pilot ignores: outside the
// trusted gateway namespaces (ISM0006), or without an address or identity
// (ISM0007).
type GatewayCandidates struct{}

// Name implements analysis.Analyzer.
func (GatewayCandidates) Name() string { return "gateway-candidates" }

// Analyze implements analysis.Analyzer.
func (GatewayCandidates) Analyze(s *analysis.Snapshot) []msg.Message {
	var out []msg.Message
	trusted := strings.Join(s.Mesh.TrustedGatewayNamespaces(), ", ")
	if sel := s.Mesh.GatewayNamespaceSelector; sel != nil && !sel.Empty() {
		trusted += " and namespaces labelled " + sel.String()
	}
	for _, g := range gateways(s) {
		ns, name, _ := strings.Cut(g.Source, "/")
		res := objectResource(string(g.Cluster), "Service", ns, name)
		switch g.Ignored {
		case "":
		case model.GatewayIgnoredUntrustedNamespace:
			out = append(out, msg.NewGatewayInUntrustedNamespace(res, string(g.Network), ns, trusted))
		case model.GatewayIgnoredNoAddress:
			out = append(out, msg.NewGatewayCandidateUnusable(res, string(g.Network), "it has no address (no load-balancer ingress or external IP)"))
		case model.GatewayIgnoredNoIdentity:
			out = append(out, msg.NewGatewayCandidateUnusable(res, string(g.Network),
				"its identity is unknown (it selects no pods and has no "+model.GatewayServiceAccountsAnnotation+" annotation)"))
		default:
			out = append(out, msg.NewGatewayCandidateUnusable(res, string(g.Network), g.Ignored))
		}
	}
	return out
}

// NetworkGateways reports a network without a trusted east-west gateway
// whose services have endpoints there while workloads run on other
// networks (ISM0005): those clients cannot reach the endpoints.
type NetworkGateways struct{}

// Name implements analysis.Analyzer.
func (NetworkGateways) Name() string { return "network-gateways" }

// Analyze implements analysis.Analyzer.
func (NetworkGateways) Analyze(s *analysis.Snapshot) []msg.Message {
	withGateway := map[model.Network]bool{}
	for _, g := range gateways(s) {
		if g.Trusted() {
			withGateway[g.Network] = true
		}
	}
	// Every network that has a workload: where clients may run.
	clients := map[string]bool{}
	for _, c := range s.Clusters {
		for _, p := range c.Pods {
			clients[string(c.NetworkOf(p, s.Mesh.Namespace))] = true
		}
	}
	// The services with endpoints on each network without a gateway.
	stranded := map[string][]string{}
	for key, defs := range federatedServices(s) {
		for _, d := range defs {
			for _, p := range d.c.SelectedPods(d.svc) {
				if net := d.c.NetworkOf(p, s.Mesh.Namespace); !withGateway[net] {
					stranded[string(net)] = append(stranded[string(net)], key)
				}
			}
		}
	}
	var out []msg.Message
	for _, net := range sortedKeys(stranded) {
		var others []string
		for n := range clients {
			if n != net {
				others = append(others, networkName(n))
			}
		}
		if len(others) == 0 {
			continue
		}
		out = append(out, msg.NewNetworkWithoutGateway(msg.Resource{Kind: "Network", Name: networkName(net)}, networkName(net), list(stranded[net]), list(others)))
	}
	return out
}

// networkName shows the unnamed network (a cluster without a default
// network) as "".
func networkName(n string) string {
	if n == "" {
		return `""`
	}
	return n
}
