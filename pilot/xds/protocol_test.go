package xds_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/xds"
	"github.com/isthmus-mesh/isthmus/pilot/xds/xdstest"
)

// manyPods returns n ready pods of cluster c1 on net1 (10.x.y.z).
func manyPods(n int, prefix string) []*model.Workload {
	out := make([]*model.Workload, 0, n)
	for i := range n {
		a := netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})
		out = append(out, xdstest.Pod("c1", "net1", ns, fmt.Sprintf("%s-%d", prefix, i), a))
	}
	return out
}

// TestSlowClientDoesNotBlockOthers proves a client that never reads its
// stream (its server-side sender stalls on HTTP/2 flow control, with a watch
// open) does not delay pushes to another client.
func TestSlowClientDoesNotBlockOthers(t *testing.T) {
	reg := xdstest.New()
	svc, ws := xdstest.Backing("echo", ns, tcp80, nil, manyPods(3000, "p")...)
	publish(reg, svc, ws)
	e := start(t, reg)

	// The stuck client: asks for everything (~300 KB, far above the 64 KiB
	// stream window), blindly ACKs nonces so watches are opened for it, and
	// never calls Recv.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stuck, err := discovery.NewAggregatedDiscoveryServiceClient(dial(t, e.addr)).DeltaAggregatedResources(ctx)
	require.NoError(t, err)
	require.NoError(t, stuck.Send(wildcard(node("stuck", "net1", "c1"))))
	for i := 1; i <= 3; i++ {
		require.NoError(t, stuck.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.WorkloadType, ResponseNonce: fmt.Sprint(i)}))
	}

	good := openDelta(t, dial(t, e.addr), wildcard(node("good", "net1", "c1")))
	r := good.next()
	require.Len(t, r.GetResources(), 3001)
	good.apply(r)

	for i := range 30 {
		w := *ws[i]
		w.Ready = !w.Ready
		reg.SetWorkload(&w)
		r := good.next()
		require.Equal(t, []string{w.UID}, names(r))
		good.apply(r)
	}

	// The stuck stream really is stuck: it got nothing like the good
	// client's 31 pushes. (Its blind ACKs may match a nonce it was sent, so
	// whether its last response shows as pending is left open.)
	st := typeStatus(e, "stuck", xds.WorkloadType)
	require.NotNil(t, st)
	require.LessOrEqual(t, st.Pushes, 4)
	require.GreaterOrEqual(t, typeStatus(e, "good", xds.WorkloadType).Pushes, 31)
}

// TestRebuildOnlyChangedKeys proves a change touches only the resources of
// its keys: one workload change among 200 services changes one resource; an
// endpoint shard change of one service changes only that service's
// ClusterLoadAssignment (its other resources are equal and not re-pushed).
func TestRebuildOnlyChangedKeys(t *testing.T) {
	reg := xdstest.New()
	var svcs []*model.Service
	for i := range 200 {
		// Each service's pods at addresses of their own: one workload per address.
		pods := []*model.Workload{
			xdstest.Pod("c1", "net1", ns, fmt.Sprintf("s%d-0", i), netip.AddrFrom4([4]byte{10, 1, byte(i), 0})),
			xdstest.Pod("c1", "net1", ns, fmt.Sprintf("s%d-1", i), netip.AddrFrom4([4]byte{10, 1, byte(i), 1})),
		}
		svc, ws := xdstest.Backing(fmt.Sprintf("s%d", i), ns, tcp80, nil, pods...)
		publish(reg, svc, ws)
		svcs = append(svcs, svc)
	}
	e := start(t, reg)
	c := openDelta(t, dial(t, e.addr), wildcard(node("zt-1", "net1", "c1")))
	c.apply(c.next())
	// An Envoy client of the same class: the Envoy types are built too.
	envoy := openSotw(t, dial(t, e.addr), node("envoy-1", "net1", "c1"))
	envoy.send(&discovery.DiscoveryRequest{TypeUrl: resource.ClusterType})
	envoy.ack(envoy.next(resource.ClusterType))
	base := counter(t, e, "isthmus_xds_resources_changed_total")

	w := *reg.Workload(model.WorkloadUID("c1", ns, "s7-0"))
	moved := *w.Placement // placements are shared: never assign through a workload
	moved.Node = "elsewhere"
	w.Placement = &moved
	reg.SetWorkload(&w)
	r := c.next()
	require.Equal(t, []string{w.UID}, names(r))
	c.apply(r)
	// The counter may be bumped just after the push went out.
	require.EventuallyWithT(t, func(ct *assertT) {
		assertEqual(ct, base+1, counter(t, e, "isthmus_xds_resources_changed_total"))
	}, waitFor, 10*time.Millisecond)

	s := *svcs[3]
	s.Shards = map[model.ClusterID][]model.Endpoint{"c1": s.Shards["c1"][:1]}
	reg.SetService(&s)
	require.EventuallyWithT(t, func(ct *assertT) {
		assertEqual(ct, base+2, counter(t, e, "isthmus_xds_resources_changed_total"))
	}, waitFor, 10*time.Millisecond)
	c.quiet(200 * time.Millisecond)
}

// TestDebugAndMetrics proves /debug/syncz and /debug/config_dump show a
// connected client, and the pushes and connected-clients metrics follow it.
func TestDebugAndMetrics(t *testing.T) {
	reg := xdstest.New()
	svc, ws := xdstest.Backing("echo", ns, tcp80, nil, xdstest.Pod("c1", "net1", ns, "a", ip("10.0.0.1")))
	publish(reg, svc, ws)
	e := start(t, reg)
	c := openDelta(t, dial(t, e.addr), wildcard(node("zt-1", "net1", "c1")))
	r := c.next()
	c.apply(r)
	hs := httptest.NewServer(e.srv.DebugHandler())
	defer hs.Close()
	get := func(path string) (int, string) {
		resp, err := http.Get(hs.URL + path)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, string(b)
	}

	require.EventuallyWithT(t, func(ct *assertT) {
		code, body := get("/debug/syncz")
		assertEqual(ct, http.StatusOK, code)
		var got []xds.ClientStatus
		if !assertNoError(ct, json.Unmarshal([]byte(body), &got)) || !assertEqual(ct, 1, len(got)) {
			return
		}
		assertEqual(ct, "zt-1", got[0].NodeID)
		assertEqual(ct, "net1", got[0].Network)
		assertEqual(ct, "c1", got[0].Cluster)
		assertEqual(ct, "delta", got[0].Protocol)
		if st := got[0].Types[xds.WorkloadType]; assertNotNil(ct, st) {
			assertEqual(ct, r.GetNonce(), st.AckedNonce)
			assertEqual(ct, false, st.Pending)
		}
	}, waitFor, 10*time.Millisecond)

	code, body := get("/debug/config_dump?proxy=zt-1")
	require.Equal(t, http.StatusOK, code)
	var dump struct {
		Resources map[string]map[string]json.RawMessage `json:"resources"`
	}
	require.NoError(t, json.Unmarshal([]byte(body), &dump))
	require.Contains(t, dump.Resources[xds.WorkloadType], "c1/default/a")
	// The dump decodes the cached wire form: the address is there (bytes
	// fields render as base64: 10.0.0.1 is CgAAAQ==).
	require.Contains(t, string(dump.Resources[xds.WorkloadType]["c1/default/a"]), "CgAAAQ==")
	// Only ztunnels are in this class: no Envoy resource was built for it.
	require.Empty(t, dump.Resources[resource.ClusterType])

	// Once an Envoy client of the class connects, they are.
	envoy := openSotw(t, dial(t, e.addr), node("envoy-1", "net1", "c1"))
	envoy.send(&discovery.DiscoveryRequest{TypeUrl: resource.ClusterType})
	envoy.ack(envoy.next(resource.ClusterType))
	// (SotW and delta streams are numbered separately: the first of each
	// is stream 1, and both are tracked.)
	code, body = get("/debug/config_dump?proxy=zt-1")
	require.Equal(t, http.StatusOK, code, body)
	require.NoError(t, json.Unmarshal([]byte(body), &dump))
	require.Contains(t, dump.Resources[resource.ClusterType], xds.ClusterName(svc.Hostname, 80))
	require.Contains(t, string(dump.Resources[resource.ClusterType][xds.ClusterName(svc.Hostname, 80)]), `"EDS"`)
	code, _ = get("/debug/config_dump?proxy=nobody")
	require.Equal(t, http.StatusNotFound, code)
	code, _ = get("/debug/config_dump")
	require.Equal(t, http.StatusBadRequest, code)

	require.Equal(t, 2.0, counter(t, e, "isthmus_xds_connected_clients"))
	require.GreaterOrEqual(t, counter(t, e, "isthmus_xds_pushes_total"), 2.0)
	c.close()
	envoy.cancel()
	<-envoy.done
	require.EventuallyWithT(t, func(ct *assertT) {
		assertEqual(ct, 0.0, counter(t, e, "isthmus_xds_connected_clients"))
	}, waitFor, 10*time.Millisecond)
}

// TestUnsupportedType proves an unknown type URL fails the stream with
// InvalidArgument at the wire.
func TestUnsupportedType(t *testing.T) {
	e := start(t, xdstest.New())
	c := openSotw(t, dial(t, e.addr), node("envoy-1", "net1", "c1"))
	c.send(&discovery.DiscoveryRequest{TypeUrl: resource.SecretType})
	<-c.done
	_, err := c.stream.Recv()
	require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
}
