package server

import (
	"cmp"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// gatewayLister is what the gateway collector reads.
type gatewayLister interface {
	Gateways() []model.NetworkGateway
}

// gatewayCollector exports isthmus_gateway_candidates: the east-west gateway
// candidates per cluster and status ("trusted", or why one is ignored). The
// network a candidate claims is tenant data (a Service label) and is not a
// label here; /debug/registryz lists the candidates in full.
type gatewayCollector struct {
	reg  gatewayLister
	desc *prometheus.Desc
}

func newGatewayCollector(reg gatewayLister) *gatewayCollector {
	return &gatewayCollector{reg: reg, desc: prometheus.NewDesc("isthmus_gateway_candidates",
		"East-west gateway candidates by cluster and status: trusted, or the reason one is ignored.",
		[]string{"cluster", "status"}, nil)}
}

// Describe implements prometheus.Collector.
func (g *gatewayCollector) Describe(ch chan<- *prometheus.Desc) { ch <- g.desc }

// Collect implements prometheus.Collector.
func (g *gatewayCollector) Collect(ch chan<- prometheus.Metric) {
	type key struct{ cluster, status string }
	counts := map[key]int{}
	for _, gw := range g.reg.Gateways() {
		counts[key{string(gw.Cluster), cmp.Or(gw.Ignored, "trusted")}]++
	}
	for k, n := range counts {
		ch <- prometheus.MustNewConstMetric(g.desc, prometheus.GaugeValue, float64(n), k.cluster, k.status)
	}
}
