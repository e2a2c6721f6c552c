package analyzers

import (
	"fmt"
	"strings"

	"github.com/isthmus-mesh/isthmus/analysis"
	"github.com/isthmus-mesh/isthmus/analysis/msg"
	"github.com/isthmus-mesh/isthmus/controller"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// TrafficDistribution reports, by pilot's own rule
// (controller.ServiceLoadBalancing), a Service whose routing-preference or
// traffic-distribution annotation pilot ignores (ISM0019), and a federated
// service whose clusters set different routing preferences (ISM0020).
// Clusters whose Namespaces could not be read are judged without their
// Namespace's annotation.
type TrafficDistribution struct{}

// Name implements analysis.Analyzer.
func (TrafficDistribution) Name() string { return "traffic-distribution" }

// Analyze implements analysis.Analyzer.
func (TrafficDistribution) Analyze(s *analysis.Snapshot) []msg.Message {
	var out []msg.Message
	services := federatedServices(s)
	for _, key := range sortedKeys(services) {
		ns, name, _ := strings.Cut(key, "/")
		var per []string
		var first *model.LoadBalancing
		differ := false
		for i, d := range services[key] {
			var nsAnn map[string]string
			if obj := d.c.Namespace(ns); obj != nil {
				nsAnn = obj.Annotations
			}
			lb, err := controller.ServiceLoadBalancing(d.svc, nsAnn)
			if err != nil {
				out = append(out, msg.NewRoutingPreferenceIgnored(objectResource(string(d.c.ID), "Service", ns, name),
					strings.ReplaceAll(err.Error(), "\n", "; "), describe(lb)))
			}
			per = append(per, fmt.Sprintf("%s: %s", d.c.ID, describe(lb)))
			if i == 0 {
				first = lb
			} else if !lb.Equal(first) {
				differ = true
			}
		}
		if differ {
			defs := services[key]
			out = append(out, msg.NewRoutingPreferenceConflict(objectResource(string(defs[0].c.ID), "Service", ns, name),
				strings.Join(per, "; "), string(defs[0].c.ID)))
		}
	}
	return out
}

// describe renders a routing preference for a message.
func describe(lb *model.LoadBalancing) string {
	switch {
	case lb == nil:
		return "the default order"
	case len(lb.Preference) == 0:
		return "no preference"
	}
	return lb.String()
}
