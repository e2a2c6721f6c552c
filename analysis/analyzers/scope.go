package analyzers

import (
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/isthmus-mesh/isthmus/analysis"
	"github.com/isthmus-mesh/isthmus/analysis/msg"
	"github.com/isthmus-mesh/isthmus/controller"
)

// ServiceScopes reports a federated service that is global in some
// clusters and local in others (ISM0018), each cluster's scope decided by
// pilot's own rule (controller.ServiceScope, with the mesh's rules and
// default) from that cluster's Service and Namespace labels. Clusters whose
// Namespaces could not be read are left out (data-completeness says so).
type ServiceScopes struct{}

// Name implements analysis.Analyzer.
func (ServiceScopes) Name() string { return "service-scopes" }

// Analyze implements analysis.Analyzer.
func (ServiceScopes) Analyze(s *analysis.Snapshot) []msg.Message {
	scoper, err := s.Mesh.ServiceScope.Compile()
	if err != nil {
		return nil // pilot refuses such a configuration: nothing is federated by it
	}
	var out []msg.Message
	services := federatedServices(s)
	for _, key := range sortedKeys(services) {
		ns, name, _ := strings.Cut(key, "/")
		var global, local, why []string
		for _, d := range services[key] {
			if !d.c.Readable(analysis.KindNamespaces) {
				continue
			}
			nsLabels := map[string]string(nil)
			if obj := d.c.Namespace(ns); obj != nil {
				nsLabels = obj.Labels
			}
			if !scoper.Local(d.svc.Labels, nsLabels) {
				global = append(global, string(d.c.ID))
				continue
			}
			local = append(local, string(d.c.ID))
			why = append(why, fmt.Sprintf("%s: %s", d.c.ID, scopeReason(d.svc, nsLabels)))
		}
		if len(global) == 0 || len(local) == 0 {
			continue
		}
		res := objectResource(strings.Join(local, ","), "Service", ns, name)
		out = append(out, msg.NewServiceScopeConflict(res, strings.Join(global, ","), strings.Join(local, ","), strings.Join(why, "; ")))
	}
	return out
}

// scopeReason says what made a service local in a cluster.
func scopeReason(svc *corev1.Service, nsLabels map[string]string) string {
	if v := svc.Labels[controller.GlobalLabel]; v == "false" {
		return "Service label " + controller.GlobalLabel + "=false"
	}
	if v := nsLabels[controller.GlobalLabel]; v == "false" {
		return "Namespace label " + controller.GlobalLabel + "=false"
	}
	return "service scope rules or the mesh default"
}
