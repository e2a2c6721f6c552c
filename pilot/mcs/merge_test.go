package mcs_test

import (
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	mcsv1beta1 "sigs.k8s.io/mcs-api/pkg/apis/v1beta1"

	"github.com/isthmus-mesh/isthmus/pilot/mcs"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// TestMerge proves the KEP's rules: the oldest export's type and port
// definitions win, ports are the union by name, a port number reused under
// another name is a conflict, ties in age go to the first cluster name, and
// every overruled cluster is named.
func TestMerge(t *testing.T) {
	http := mcs.Port{Name: "http", Port: 80}
	ips := []netip.Addr{netip.MustParseAddr("2001:2::7"), netip.MustParseAddr("240.240.0.7"), netip.MustParseAddr("240.240.0.8")}
	cases := []struct {
		name      string
		exports   []mcs.ClusterExport
		typ       mcsv1beta1.ServiceImportType
		ports     []mcs.Port
		conflicts map[string][]string
	}{
		{"agree", []mcs.ClusterExport{
			{Cluster: "c2", Created: t0, Ports: []mcs.Port{http}},
			{Cluster: "c1", Created: t0.Add(time.Hour), Ports: []mcs.Port{{Name: "http", Port: 80, Protocol: "TCP"}}},
		}, mcsv1beta1.ClusterSetIP, []mcs.Port{http}, nil},
		{"union by name", []mcs.ClusterExport{
			{Cluster: "c1", Created: t0, Ports: []mcs.Port{http}},
			{Cluster: "c2", Created: t0.Add(time.Hour), Ports: []mcs.Port{http, {Name: "grpc", Port: 9090}}},
		}, mcsv1beta1.ClusterSetIP, []mcs.Port{http, {Name: "grpc", Port: 9090}}, nil},
		{"port conflict: oldest wins", []mcs.ClusterExport{
			{Cluster: "c2", Created: t0.Add(time.Hour), Ports: []mcs.Port{{Name: "http", Port: 8080}}},
			{Cluster: "c1", Created: t0, Ports: []mcs.Port{http}},
			{Cluster: "c3", Created: t0.Add(2 * time.Hour), Ports: []mcs.Port{{Name: "web", Port: 80}}},
		}, mcsv1beta1.ClusterSetIP, []mcs.Port{http}, map[string][]string{mcs.ReasonPortConflict: {"c2", "c3"}}},
		{"appProtocol differs", []mcs.ClusterExport{
			{Cluster: "c1", Created: t0, Ports: []mcs.Port{http}},
			{Cluster: "c2", Created: t0, Ports: []mcs.Port{{Name: "http", Port: 80, AppProtocol: "kubernetes.io/h2c"}}},
		}, mcsv1beta1.ClusterSetIP, []mcs.Port{http}, map[string][]string{mcs.ReasonPortConflict: {"c2"}}},
		{"type conflict: oldest wins", []mcs.ClusterExport{
			{Cluster: "c1", Created: t0.Add(time.Hour), Ports: []mcs.Port{http}},
			{Cluster: "c2", Created: t0, Headless: true, Ports: []mcs.Port{http}},
		}, mcsv1beta1.Headless, []mcs.Port{http}, map[string][]string{mcs.ReasonTypeConflict: {"c1"}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			imp := mcs.Merge(mcs.Service{Namespace: "demo", Name: "echo", IPs: ips, Exports: c.exports})
			require.Equal(t, c.typ, imp.Type)
			require.Equal(t, c.ports, imp.Ports)
			got := map[string][]string{}
			for _, cf := range imp.Conflicts {
				got[cf.Reason] = cf.Clusters
				require.NotEmpty(t, cf.Message)
			}
			if c.conflicts == nil {
				c.conflicts = map[string][]string{}
			}
			require.Equal(t, c.conflicts, got)
			if c.typ == mcsv1beta1.Headless {
				require.Empty(t, imp.IPs, "a headless import has no clusterset IP")
			} else {
				require.Equal(t, []netip.Addr{ips[1], ips[0]}, imp.IPs, "one per family, IPv4 first")
			}
			require.IsIncreasing(t, imp.Clusters)
		})
	}
}
