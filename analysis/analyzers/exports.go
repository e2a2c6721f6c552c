package analyzers

import (
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/isthmus-mesh/isthmus/analysis"
	"github.com/isthmus-mesh/isthmus/analysis/msg"
	"github.com/isthmus-mesh/isthmus/pilot/mcs"
)

// ServiceExports reports MCS ServiceExports whose clusters disagree on the
// exported service's type or ports (ISM0011), settled by the KEP's rules
// exactly as pilot settles them (mcs.Merge). An export is the cluster's
// ServiceExport and its Service of the same name; a ServiceExport without
// a Service exports nothing.
type ServiceExports struct{}

// Name implements analysis.Analyzer.
func (ServiceExports) Name() string { return "service-exports" }

// Analyze implements analysis.Analyzer.
func (ServiceExports) Analyze(s *analysis.Snapshot) []msg.Message {
	services := map[string]*mcs.Service{}
	for _, c := range s.Clusters {
		for _, exp := range c.ServiceExports {
			svc := findService(c, exp.Namespace, exp.Name)
			if svc == nil {
				continue
			}
			k := exp.Namespace + "/" + exp.Name
			if services[k] == nil {
				services[k] = &mcs.Service{Namespace: exp.Namespace, Name: exp.Name}
			}
			services[k].Exports = append(services[k].Exports, mcs.ClusterExport{
				Cluster: string(c.ID), Created: exp.CreationTimestamp.Time,
				Headless: svc.Spec.ClusterIP == corev1.ClusterIPNone, Ports: exportPorts(svc),
			})
		}
	}
	var out []msg.Message
	for _, k := range sortedKeys(services) {
		ns, name, _ := strings.Cut(k, "/")
		for _, conflict := range mcs.Merge(*services[k]).Conflicts {
			res := objectResource(strings.Join(conflict.Clusters, ","), "ServiceExport", ns, name)
			out = append(out, msg.NewServiceExportConflict(res, conflict.Reason, conflict.Message))
		}
	}
	return out
}

func findService(c *analysis.Cluster, ns, name string) *corev1.Service {
	for _, svc := range c.Services {
		if svc.Namespace == ns && svc.Name == name {
			return svc
		}
	}
	return nil
}

func exportPorts(svc *corev1.Service) []mcs.Port {
	var out []mcs.Port
	for _, p := range svc.Spec.Ports {
		port := mcs.Port{Name: p.Name, Protocol: p.Protocol, Port: p.Port}
		if p.AppProtocol != nil {
			port.AppProtocol = *p.AppProtocol
		}
		out = append(out, port)
	}
	return out
}
