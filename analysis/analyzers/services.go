package analyzers

import (
	"cmp"
	"fmt"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/isthmus-mesh/isthmus/analysis"
	"github.com/isthmus-mesh/isthmus/analysis/msg"
)

// ServicePorts reports a port name of a federated service defined with
// another number or protocol in some cluster than in the oldest Service,
// whose definition the registry keeps (ISM0008).
type ServicePorts struct{}

// Name implements analysis.Analyzer.
func (ServicePorts) Name() string { return "service-ports" }

// Analyze implements analysis.Analyzer.
func (ServicePorts) Analyze(s *analysis.Snapshot) []msg.Message {
	var out []msg.Message
	for key, defs := range federatedServices(s) {
		ns, name, _ := strings.Cut(key, "/")
		type used struct {
			port    corev1.ServicePort
			cluster string
		}
		byName := map[string]used{}
		for _, d := range defs {
			for _, p := range d.svc.Spec.Ports {
				u, seen := byName[p.Name]
				if !seen {
					byName[p.Name] = used{p, string(d.c.ID)}
					continue
				}
				if p.Port != u.port.Port || protocol(p) != protocol(u.port) {
					out = append(out, msg.NewServicePortConflict(objectResource(string(d.c.ID), "Service", ns, name),
						cmp.Or(p.Name, `""`), portString(p), string(d.c.ID), portString(u.port), u.cluster))
				}
			}
		}
	}
	return out
}

func protocol(p corev1.ServicePort) corev1.Protocol { return cmp.Or(p.Protocol, corev1.ProtocolTCP) }

func portString(p corev1.ServicePort) string { return fmt.Sprintf("%d/%s", p.Port, protocol(p)) }

// ServiceIdentities reports a federated service whose pods run under
// other service accounts in one cluster than in another (ISM0009). Each
// cluster is compared with the first one (by ID) that runs pods of it.
type ServiceIdentities struct{}

// Name implements analysis.Analyzer.
func (ServiceIdentities) Name() string { return "service-identities" }

// Analyze implements analysis.Analyzer.
func (ServiceIdentities) Analyze(s *analysis.Snapshot) []msg.Message {
	var out []msg.Message
	for key, defs := range federatedServices(s) {
		ns, name, _ := strings.Cut(key, "/")
		type accounts struct {
			cluster string
			names   []string
		}
		var per []accounts
		for _, d := range defs {
			var names []string
			for _, p := range d.c.SelectedPods(d.svc) {
				names = append(names, serviceAccount(p))
			}
			if len(names) > 0 {
				per = append(per, accounts{string(d.c.ID), slices.Compact(slices.Sorted(slices.Values(names)))})
			}
		}
		slices.SortFunc(per, func(a, b accounts) int { return cmp.Compare(a.cluster, b.cluster) })
		for _, a := range per[min(1, len(per)):] {
			if ref := per[0]; !slices.Equal(a.names, ref.names) {
				out = append(out, msg.NewServiceIdentitySplit(objectResource(a.cluster, "Service", ns, name),
					strings.Join(a.names, ", "), a.cluster, strings.Join(ref.names, ", "), ref.cluster))
			}
		}
	}
	return out
}
