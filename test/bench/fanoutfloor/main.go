// Command fanoutfloor is the floor of the xDS fan-out benchmark: a gRPC
// server (grpc-go, with pilot's flow-control settings) that serves the
// benchmark's CDS and EDS resources from memory and pushes each change to
// every stream as bytes encoded once, reading and discarding the clients'
// ACKs. It does nothing an xDS server must do beyond that (no decoding, no
// per-client state, no Kubernetes), so what it costs per client is what
// grpc-go and the kernel cost on the machine.
//
// With --tcp it serves the same exchange over plain TCP instead, each
// message prefixed by its length (package tcpframe): no HTTP/2 and no gRPC,
// so what it costs per client is what the kernel and Go's network poller
// cost, the part no transport can save.
//
// POST /flip?service=S&endpoint=J flips the readiness of endpoint J of
// service S (0-based) and pushes the service's ClusterLoadAssignment; it
// answers with the endpoint's address and new readiness ("10.200.3.7
// false"). /metrics serves the Go runtime's metrics, /debug/pprof/ the
// profiles.
package main

import (
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	_ "net/http/pprof" // the benchmark collects garbage through it
	"net/netip"
	"strconv"
	"sync"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/isthmus-mesh/isthmus/test/bench/tcpframe"
)

func main() {
	xdsAddr := flag.String("xds-addr", "127.0.0.1:15010", "gRPC (plaintext) address")
	httpAddr := flag.String("http-addr", "127.0.0.1:8080", "control, metrics and pprof address")
	services := flag.Int("services", 100, "services (EDS clusters)")
	endpoints := flag.Int("endpoints", 100, "endpoints per service")
	suffix := flag.String("suffix", ".fan.svc.cluster.local", "service host suffix")
	tcp := flag.Bool("tcp", false, "serve length-prefixed messages over plain TCP, not gRPC")
	flag.Parse()

	f := newFloor(*services, *endpoints, *suffix)
	lis, err := net.Listen("tcp", *xdsAddr)
	if err != nil {
		log.Fatal(err)
	}
	http.Handle("/metrics", promhttp.Handler())
	http.HandleFunc("/flip", f.flip)
	go func() { log.Fatal(http.ListenAndServe(*httpAddr, nil)) }()
	if *tcp {
		log.Fatal(f.serveTCP(lis))
	}
	gs := grpc.NewServer(grpc.ForceServerCodecV2(rawCodec{}),
		grpc.StaticStreamWindowSize(1<<20), grpc.StaticConnWindowSize(1<<20), grpc.HeaderTableSize(0))
	gs.RegisterService(&grpc.ServiceDesc{
		ServiceName: "envoy.service.discovery.v3.AggregatedDiscoveryService",
		HandlerType: (*any)(nil),
		Streams: []grpc.StreamDesc{{
			StreamName: "StreamAggregatedResources", ServerStreams: true, ClientStreams: true,
			Handler: func(_ any, st grpc.ServerStream) error { return f.serve(st) },
		}},
	}, nil)
	log.Fatal(gs.Serve(lis))
}

// floor holds the resources and the open streams.
type floor struct {
	suffix string
	cds    []byte // the CDS response
	eds    []byte // the EDS response with every ClusterLoadAssignment

	mu      sync.Mutex
	ready   [][]bool // per service and endpoint
	version int
	streams map[chan []byte]struct{}
}

func newFloor(services, endpoints int, suffix string) *floor {
	f := &floor{suffix: suffix, streams: map[chan []byte]struct{}{}}
	var clusters, clas []proto.Message
	for s := range services {
		f.ready = append(f.ready, make([]bool, endpoints))
		for j := range endpoints {
			f.ready[s][j] = true
		}
		clusters = append(clusters, &clusterv3.Cluster{
			Name:                 f.clusterName(s),
			ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_EDS},
			EdsClusterConfig: &clusterv3.Cluster_EdsClusterConfig{EdsConfig: &corev3.ConfigSource{
				ConfigSourceSpecifier: &corev3.ConfigSource_Ads{Ads: &corev3.AggregatedConfigSource{}},
			}},
		})
		clas = append(clas, f.cla(s))
	}
	f.cds = response(resource.ClusterType, "0", clusters...)
	f.eds = response(resource.EndpointType, "0", clas...)
	return f
}

func (f *floor) clusterName(s int) string {
	return "outbound|80||svc-" + strconv.Itoa(s) + f.suffix
}

func address(s, j int) string { return netip.AddrFrom4([4]byte{10, 200, byte(s), byte(j)}).String() }

// cla is service s's ClusterLoadAssignment; f.mu held or not yet shared.
func (f *floor) cla(s int) *endpointv3.ClusterLoadAssignment {
	var lbs []*endpointv3.LbEndpoint
	for j, ready := range f.ready[s] {
		hs := corev3.HealthStatus_HEALTHY
		if !ready {
			hs = corev3.HealthStatus_UNHEALTHY
		}
		lbs = append(lbs, &endpointv3.LbEndpoint{
			HealthStatus: hs,
			HostIdentifier: &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{Address: &corev3.Address{
				Address: &corev3.Address_SocketAddress{SocketAddress: &corev3.SocketAddress{
					Address: address(s, j), PortSpecifier: &corev3.SocketAddress_PortValue{PortValue: 8080},
				}},
			}}},
		})
	}
	return &endpointv3.ClusterLoadAssignment{ClusterName: f.clusterName(s), Endpoints: []*endpointv3.LocalityLbEndpoints{{LbEndpoints: lbs}}}
}

// response encodes a DiscoveryResponse of typeURL at version (its nonce
// too) holding ms.
func response(typeURL, version string, ms ...proto.Message) []byte {
	r := &discovery.DiscoveryResponse{TypeUrl: typeURL, VersionInfo: version, Nonce: version}
	for _, m := range ms {
		a, err := anypb.New(m)
		if err != nil {
			log.Fatal(err)
		}
		r.Resources = append(r.Resources, a)
	}
	b, err := proto.Marshal(r)
	if err != nil {
		log.Fatal(err)
	}
	return b
}

// stream is what serve needs of a gRPC stream or a TCP connection.
type stream interface {
	SendMsg(m any) error
	RecvMsg(m any) error
}

// serve answers a stream's first request (CDS) and second (EDS), then
// sends every push; a second goroutine reads and discards the ACKs.
func (f *floor) serve(st stream) error {
	var req struct{}
	for _, resp := range [][]byte{f.cds, f.eds} {
		if err := st.RecvMsg(&req); err != nil {
			return err
		}
		if err := st.SendMsg(resp); err != nil {
			return err
		}
	}
	pushes := make(chan []byte, 16)
	f.mu.Lock()
	f.streams[pushes] = struct{}{}
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		delete(f.streams, pushes)
		f.mu.Unlock()
	}()
	ended := make(chan error, 1)
	go func() {
		var ack struct{}
		for {
			if err := st.RecvMsg(&ack); err != nil {
				ended <- err
				return
			}
		}
	}()
	for {
		select {
		case err := <-ended:
			return err
		case b := <-pushes:
			if err := st.SendMsg(b); err != nil {
				return err
			}
		}
	}
}

// flip flips one endpoint's readiness and pushes its service's
// ClusterLoadAssignment to every stream.
func (f *floor) flip(w http.ResponseWriter, r *http.Request) {
	s, err1 := strconv.Atoi(r.URL.Query().Get("service"))
	j, err2 := strconv.Atoi(r.URL.Query().Get("endpoint"))
	if err1 != nil || err2 != nil || s < 0 || s >= len(f.ready) || j < 0 || j >= len(f.ready[s]) {
		http.Error(w, "service and endpoint: indexes", http.StatusBadRequest)
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ready[s][j] = !f.ready[s][j]
	f.version++
	b := response(resource.EndpointType, strconv.Itoa(f.version), f.cla(s))
	for ch := range f.streams {
		select {
		case ch <- b:
		default: // a stream 16 pushes behind: the benchmark sees it miss one
		}
	}
	fmt.Fprintf(w, "%s %t", address(s, j), f.ready[s][j])
}

// serveTCP serves every connection lis accepts as one stream.
func (f *floor) serveTCP(lis net.Listener) error {
	for {
		c, err := lis.Accept()
		if err != nil {
			return err
		}
		go func() {
			conn := tcpStream{tcpframe.New(c)}
			defer conn.Close()
			_ = f.serve(conn)
		}()
	}
}

// tcpStream is a stream over a TCP connection: it sends responses as
// encoded and reads requests undecoded.
type tcpStream struct{ *tcpframe.Conn }

func (s tcpStream) SendMsg(m any) error { return s.Write(m.([]byte)) }

func (s tcpStream) RecvMsg(any) error {
	_, err := s.Read()
	return err
}

// rawCodec sends responses as encoded and discards requests undecoded.
type rawCodec struct{}

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	return mem.BufferSlice{mem.SliceBuffer(v.([]byte))}, nil
}

// Unmarshal reads nothing: the floor only needs requests to have arrived.
func (rawCodec) Unmarshal(mem.BufferSlice, any) error { return nil }

func (rawCodec) Name() string { return "proto" }
