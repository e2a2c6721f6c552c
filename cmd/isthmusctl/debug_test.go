package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/yaml"

	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/registry"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

// fakeStatuses and fakeServices are what pilot's /debug/clusterz and
// /debug/registryz serve, built with the real types.
func fakeStatuses() []multicluster.Status {
	return []multicluster.Status{
		{ID: "primary", State: multicluster.StateSynced, Reason: multicluster.ReasonSynced, Generation: 1,
			LastTransitionTime: t0, LastSynced: t0.Add(-90 * time.Second), SyncDuration: time.Second},
		{ID: "remote-1", Secret: "isthmus-system/istio-remote-secret-remote-1", State: multicluster.StateSynced,
			Reason: multicluster.ReasonSynced, Generation: 2, LastTransitionTime: t0, LastSynced: t0.Add(-10 * time.Minute),
			Pending: &multicluster.Status{ID: "remote-1", State: multicluster.StateSyncing, Reason: multicluster.ReasonSyncing, Generation: 3}},
		{ID: "remote-2", Secret: "isthmus-system/istio-remote-secret-remote-2", State: multicluster.StateTimeout,
			Reason: multicluster.ReasonSyncTimeout, Message: "not synced after 30s", Generation: 1, LastTransitionTime: t0},
	}
}

func fakeServices() []registry.ServiceSummary {
	return []registry.ServiceSummary{
		{Hostname: "echo.demo.svc.cluster.local", Scope: "global", Clusters: []model.ClusterID{"primary", "remote-1"},
			Ports:     []model.Port{{Name: "http", Port: 80, TargetPort: 8080, Protocol: model.TCP}, {Name: "dns", Port: 53, Protocol: model.UDP}},
			VIPs:      map[model.ClusterID][]string{"primary": {"10.0.0.1"}, "remote-1": {"10.1.0.1"}},
			Endpoints: map[model.ClusterID]int{"primary": 2, "remote-1": 3}},
		{Hostname: "only.demo.svc.cluster.local", Scope: "global", Clusters: []model.ClusterID{"remote-1"},
			Ports: []model.Port{{Port: 9000, Protocol: model.TCP}}, Endpoints: map[model.ClusterID]int{"remote-1": 1}},
		{Hostname: "kube-dns.kube-system.svc.cluster.local", Scope: "cluster-local", Clusters: []model.ClusterID{"primary"},
			Ports: []model.Port{{Name: "dns", Port: 53, Protocol: model.UDP}}, Endpoints: map[model.ClusterID]int{"primary": 4}},
	}
}

func fakeWorkloads() []*model.Workload {
	return []*model.Workload{
		{UID: "primary/demo/echo-1", Name: "echo-1", Addresses: []netip.Addr{netip.MustParseAddr("127.1.0.1")},
			Placement: &model.Placement{Namespace: "demo", ServiceAccount: "echo", Node: "node-a", Cluster: "primary", Network: "net-1"}, Ready: true,
			Services: map[string][]model.PortMapping{"echo.demo.svc.cluster.local": {{ServicePort: 80, TargetPort: 8080}}}},
		{UID: "remote-1/demo/echo-2", Name: "echo-2", Addresses: []netip.Addr{netip.MustParseAddr("127.2.0.1")},
			Placement: &model.Placement{Namespace: "demo", ServiceAccount: "echo", Node: "node-b", Cluster: "remote-1", Network: "net-2"}, Terminating: true},
	}
}

// syncz is /debug/syncz as pilot serves it, with a field isthmusctl does
// not know (future_field) and one stream that has not identified itself.
const syncz = `[
  {"streamId": 1, "nodeId": "ztunnel~node-a", "cluster": "primary", "network": "net-1", "protocol": "delta",
   "connected": "2026-03-01T11:00:00Z", "future_field": {"x": 1},
   "types": {
     "type.googleapis.com/istio.workload.Address": {"sentVersion": "v7", "sentNonce": "n7", "sentResources": 3,
        "ackedVersion": "v7", "ackedNonce": "n7", "pushes": 7, "pending": false},
     "type.googleapis.com/istio.security.Authorization": {"sentVersion": "v2", "sentNonce": "n2", "sentResources": 0,
        "ackedVersion": "v1", "ackedNonce": "n1", "pushes": 2, "pending": false,
        "lastNack": {"nonce": "n2", "message": "bad policy", "at": "2026-03-01T11:59:00Z"}}
   }},
  {"streamId": 2, "nodeId": "envoy~10.0.0.9", "cluster": "remote-1", "network": "net-2", "protocol": "sotw",
   "connected": "2026-03-01T11:30:00Z",
   "types": {"type.googleapis.com/envoy.config.cluster.v3.Cluster": {"sentVersion": "v3", "sentNonce": "n3", "pending": true, "pushes": 1}}},
  {"streamId": 3, "nodeId": "", "cluster": "", "network": "", "protocol": "delta", "connected": "2026-03-01T11:59:59Z", "types": {}}
]`

// fakePilot serves the debug endpoints; withWorkloadz adds /debug/workloadz.
func fakePilot(t *testing.T, withWorkloadz bool) string {
	t.Helper()
	mux := http.NewServeMux()
	writeJSON := func(w http.ResponseWriter, v any) {
		w.Header().Set("Content-Type", "application/json")
		require.NoError(t, json.NewEncoder(w).Encode(v))
	}
	mux.HandleFunc("GET /debug/clusterz", func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, fakeStatuses()) })
	mux.HandleFunc("GET /debug/registryz", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, map[string]any{"services": fakeServices(), "gateways": []model.NetworkGateway{},
			"clusters": map[model.ClusterID]uint64{"primary": 1, "remote-1": 2}, "staleClusters": map[model.ClusterID]int64{}})
	})
	mux.HandleFunc("GET /debug/syncz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(syncz))
	})
	if withWorkloadz {
		mux.HandleFunc("GET /debug/workloadz", func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, fakeWorkloads()) })
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := httptest.NewUnstartedServer(mux)
	srv.Listener = ln
	srv.Start()
	t.Cleanup(srv.Close)
	return srv.URL
}

var columns = regexp.MustCompile(`\s{2,}`)

// parseTable splits a table into its header and rows of cells.
func parseTable(t *testing.T, out string) ([]string, [][]string) {
	t.Helper()
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	require.NotEmpty(t, lines)
	var rows [][]string
	for _, l := range lines[1:] {
		rows = append(rows, columns.Split(strings.TrimSpace(l), -1))
	}
	return columns.Split(strings.TrimSpace(lines[0]), -1), rows
}

// TestRemoteClustersTable checks every column of remote-clusters: state
// and reason from /debug/clusterz, the pending generation of a
// make-before-break swap, the age of the last sync, and service and
// endpoint counts per cluster from /debug/registryz.
func TestRemoteClustersTable(t *testing.T) {
	url := fakePilot(t, false)
	var out strings.Builder
	cfg := remoteClustersConfig{Output: outputTable, Now: func() time.Time { return t0 }}
	require.NoError(t, remoteClusters(t.Context(), newPilotClient(url, 5*time.Second), cfg, &out))
	header, rows := parseTable(t, out.String())
	require.Equal(t, []string{"ID", "STATE", "REASON", "SECRET", "GENERATION", "LAST SYNC", "SERVICES", "ENDPOINTS"}, header)
	require.Equal(t, [][]string{
		{"primary", "synced", "Synced", "-", "1", "90s ago", "2", "6"},
		{"remote-1", "synced", "Synced", "isthmus-system/istio-remote-secret-remote-1", "2 (3 syncing)", "10m ago", "2", "4"},
		{"remote-2", "timeout", "SyncTimeout", "isthmus-system/istio-remote-secret-remote-2", "1", "-", "0", "0"},
	}, rows)

	// Through the command line, with --pilot.
	stdout, _, err := runCtl(t, "--pilot", url, "remote-clusters")
	require.NoError(t, err)
	_, rows = parseTable(t, stdout)
	require.Len(t, rows, 3)
}

// TestRemoteClustersJSON checks that -o json and -o yaml carry the full
// statuses with the counts, and round-trip.
func TestRemoteClustersJSON(t *testing.T) {
	url := fakePilot(t, false)
	want := []clusterRow{
		{Status: fakeStatuses()[0], Services: 2, Endpoints: 6},
		{Status: fakeStatuses()[1], Services: 2, Endpoints: 4},
		{Status: fakeStatuses()[2], Services: 0, Endpoints: 0},
	}
	stdout, _, err := runCtl(t, "--pilot", url, "remote-clusters", "-o", "json")
	require.NoError(t, err)
	var got []clusterRow
	require.NoError(t, json.Unmarshal([]byte(stdout), &got))
	require.Equal(t, want, got)

	stdout, _, err = runCtl(t, "--pilot", url, "remote-clusters", "-o", "yaml")
	require.NoError(t, err)
	got = nil
	require.NoError(t, yaml.Unmarshal([]byte(stdout), &got))
	require.Equal(t, want, got)
}

// TestRegistryServices checks the services table, the --cluster filter and
// that -o json and -o yaml round-trip to the registry's own type.
func TestRegistryServices(t *testing.T) {
	url := fakePilot(t, false)
	stdout, _, err := runCtl(t, "--pilot", url, "registry", "services")
	require.NoError(t, err)
	header, rows := parseTable(t, stdout)
	require.Equal(t, []string{"HOSTNAME", "SCOPE", "CLUSTERS", "PORTS", "ENDPOINTS"}, header)
	require.Equal(t, [][]string{
		{"echo.demo.svc.cluster.local", "global", "primary,remote-1", "http:80,dns:53/UDP", "primary=2,remote-1=3"},
		{"only.demo.svc.cluster.local", "global", "remote-1", "9000", "remote-1=1"},
		{"kube-dns.kube-system.svc.cluster.local", "cluster-local", "primary", "dns:53/UDP", "primary=4"},
	}, rows)

	stdout, _, err = runCtl(t, "--pilot", url, "registry", "services", "--cluster", "remote-1")
	require.NoError(t, err)
	_, rows = parseTable(t, stdout)
	require.Equal(t, [][]string{
		{"echo.demo.svc.cluster.local", "global", "primary,remote-1", "http:80,dns:53/UDP", "3"},
		{"only.demo.svc.cluster.local", "global", "remote-1", "9000", "1"},
	}, rows)

	stdout, _, err = runCtl(t, "--pilot", url, "registry", "services", "-o", "json")
	require.NoError(t, err)
	var got []registry.ServiceSummary
	require.NoError(t, json.Unmarshal([]byte(stdout), &got))
	require.Equal(t, fakeServices(), got)

	stdout, _, err = runCtl(t, "--pilot", url, "registry", "services", "--cluster", "primary", "-o", "yaml")
	require.NoError(t, err)
	got = nil
	require.NoError(t, yaml.Unmarshal([]byte(stdout), &got))
	require.Equal(t, []registry.ServiceSummary{fakeServices()[0], fakeServices()[2]}, got)

	_, _, err = runCtl(t, "--pilot", url, "registry", "services", "-o", "xml")
	require.ErrorContains(t, err, `unknown output format "xml"`)
}

// TestRegistryWorkloads checks the workloads table and JSON from
// /debug/workloadz, and the explanation when pilot does not serve it.
func TestRegistryWorkloads(t *testing.T) {
	url := fakePilot(t, true)
	stdout, _, err := runCtl(t, "--pilot", url, "registry", "workloads")
	require.NoError(t, err)
	header, rows := parseTable(t, stdout)
	require.Equal(t, []string{"UID", "CLUSTER", "NETWORK", "NODE", "ADDRESSES", "SERVICE ACCOUNT", "READY", "SERVICES"}, header)
	require.Equal(t, [][]string{
		{"primary/demo/echo-1", "primary", "net-1", "node-a", "127.1.0.1", "echo", "true", "echo.demo.svc.cluster.local"},
		{"remote-1/demo/echo-2", "remote-1", "net-2", "node-b", "127.2.0.1", "echo", "terminating", "-"},
	}, rows)

	stdout, _, err = runCtl(t, "--pilot", url, "registry", "workloads", "--cluster", "remote-1", "-o", "json")
	require.NoError(t, err)
	var got []*model.Workload
	require.NoError(t, json.Unmarshal([]byte(stdout), &got))
	require.Equal(t, fakeWorkloads()[1:], got)

	_, _, err = runCtl(t, "--pilot", fakePilot(t, false), "registry", "workloads")
	require.ErrorIs(t, err, errNoWorkloadz)
	require.ErrorContains(t, err, "/debug/workloadz")
}

// TestProxyStatus checks the per-client, per-type table decoded from a
// /debug/syncz document with unknown fields: synced, NACKed, pending and
// not-yet-identified streams.
func TestProxyStatus(t *testing.T) {
	url := fakePilot(t, false)
	stdout, _, err := runCtl(t, "--pilot", url, "proxy-status")
	require.NoError(t, err)
	header, rows := parseTable(t, stdout)
	// Rows are sorted by node id, then by type URL.
	require.Equal(t, []string{"NODE ID", "CLUSTER", "NETWORK", "PROTOCOL", "TYPE", "SENT", "ACKED", "STATUS"}, header)
	require.Equal(t, [][]string{
		{"-", "-", "-", "delta", "-", "-", "-", "CONNECTED"},
		{"envoy~10.0.0.9", "remote-1", "net-2", "sotw", "Cluster", "v3", "-", "STALE"},
		{"ztunnel~node-a", "primary", "net-1", "delta", "Authorization", "v2", "v1", "NACKED"},
		{"ztunnel~node-a", "primary", "net-1", "delta", "Address", "v7", "v7", "SYNCED"},
	}, rows)

	stdout, _, err = runCtl(t, "--pilot", url, "proxy-status", "-o", "json")
	require.NoError(t, err)
	var got, want []map[string]any
	require.NoError(t, json.Unmarshal([]byte(stdout), &got))
	require.NoError(t, json.Unmarshal([]byte(syncz), &want))
	require.Equal(t, want, got, "-o json passes the document through, unknown fields included")
}

// TestPilotErrors checks the messages when pilot is unreachable or fails.
func TestPilotErrors(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	closed := "http://" + ln.Addr().String()
	require.NoError(t, ln.Close())
	_, _, err = runCtl(t, "--pilot", closed, "remote-clusters")
	require.ErrorContains(t, err, "is pilot's debug server reachable")

	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "registry not ready", http.StatusServiceUnavailable)
	}))
	defer srv.Close()
	_, _, err = runCtl(t, "--pilot", srv.URL, "registry", "services")
	require.ErrorContains(t, err, "503 Service Unavailable: registry not ready")
}

// mapDialer reaches each pod at its own address (pod name -> host:port), in
// place of the port-forward; a pod it has no address for is refused.
type mapDialer map[string]string

func (m mapDialer) open(ctx context.Context, pod *corev1.Pod, port uint16) (func(context.Context) (net.Conn, error), func(), error) {
	addr, ok := m[pod.Name]
	if !ok {
		return nil, nil, fmt.Errorf("port-forward to pod %s/%s port %d: refused", pod.Namespace, pod.Name, port)
	}
	return directDialer{addr}.open(ctx, pod, port)
}

// TestProxyStatusPilotPods: with --kubeconfig, proxy-status finds the
// pilot pods through a real API server, reads each one's /debug/syncz and
// says which replica each client streams from; a replica it cannot reach
// is named in the error while the others are still printed.
func TestProxyStatusPilotPods(t *testing.T) {
	const ns = "ps-pods"
	ctx := t.Context()
	c := clusters.Cluster("primary")
	require.NoError(t, c.EnsureNamespace(ctx, ns, nil))
	for _, name := range []string{"isthmusd-a", "isthmusd-b", "isthmusd-c"} {
		_, err := c.CreatePod(ctx, framework.PodOptions{Namespace: ns, Name: name, Labels: map[string]string{"app": "isthmusd"},
			Node: "node-1", IP: netip.MustParseAddr("127.30.0.2"), Ready: true})
		require.NoError(t, err)
	}
	serve := func(doc string) string {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/debug/syncz" {
				http.NotFound(w, r)
				return
			}
			_, _ = w.Write([]byte(doc))
		}))
		t.Cleanup(srv.Close)
		return strings.TrimPrefix(srv.URL, "http://")
	}
	a := serve(`[{"streamId": 4, "nodeId": "ztunnel~node-a", "cluster": "primary", "network": "net-1", "protocol": "delta",
	  "types": {"type.googleapis.com/istio.workload.Address": {"sentVersion": "v9", "ackedVersion": "v9"}}}]`)
	b := serve(`[{"streamId": 1, "nodeId": "ztunnel~node-b", "cluster": "remote", "network": "net-2", "protocol": "delta", "types": {}}]`)
	kc := writeKubeconfig(t, "primary", c.Config)
	run := func(d mapDialer, args ...string) (string, error) {
		var out, errOut bytes.Buffer
		cmd := newProxyStatusCommand(func() *pilotClient { return newPilotClient("http://127.0.0.1:1", time.Second) },
			func() *slog.Logger { return slog.New(slog.NewTextHandler(&errOut, nil)) },
			func(*rest.Config) podDialer { return d }, func() time.Duration { return 5 * time.Second })
		cmd.SetOut(&out)
		cmd.SetErr(&errOut)
		cmd.SilenceUsage, cmd.SilenceErrors = true, true
		cmd.SetArgs(append(args, "--kubeconfig", kc, "-n", ns))
		err := cmd.ExecuteContext(ctx)
		return out.String(), err
	}

	out, err := run(mapDialer{"isthmusd-a": a, "isthmusd-b": b, "isthmusd-c": b})
	require.NoError(t, err)
	header, rows := parseTable(t, out)
	require.Equal(t, []string{"NODE ID", "PILOT", "CLUSTER", "NETWORK", "PROTOCOL", "TYPE", "SENT", "ACKED", "STATUS"}, header)
	require.Equal(t, [][]string{
		{"ztunnel~node-a", "isthmusd-a", "primary", "net-1", "delta", "Address", "v9", "v9", "SYNCED"},
		{"ztunnel~node-b", "isthmusd-b", "remote", "net-2", "delta", "-", "-", "-", "CONNECTED"},
		{"ztunnel~node-b", "isthmusd-c", "remote", "net-2", "delta", "-", "-", "-", "CONNECTED"},
	}, rows)

	out, err = run(mapDialer{"isthmusd-a": a, "isthmusd-b": b}, "-o", "json")
	require.ErrorContains(t, err, "pilot pod "+ns+"/isthmusd-c: port-forward to pod "+ns+"/isthmusd-c port 8080: refused")
	var got []map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &got), "the readable replicas are printed")
	require.Len(t, got, 2)
	require.Equal(t, "isthmusd-a", got[0]["pilot"])
	require.Equal(t, "ztunnel~node-a", got[0]["nodeId"])
	require.Equal(t, "isthmusd-b", got[1]["pilot"])

	_, err = run(mapDialer{}, "-l", "app=nothing")
	require.ErrorContains(t, err, "no running pilot pod (app=nothing) in namespace "+ns)
}
