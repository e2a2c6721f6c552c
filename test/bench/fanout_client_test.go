package bench_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/isthmus-mesh/isthmus/test/bench/tcpframe"
)

// An Envoy-style client of the fan-out benchmark: one gRPC connection and
// one ADS stream (SotW or delta), CDS wildcard, then EDS for every EDS
// cluster CDS names, ACKing each response as Envoy does. Responses are read
// off the wire with protowire (envelope and resource names only), so the
// clients cost the machine's two cores little; the timed resource's bytes
// are kept and checked after each sample.

// wireResponse is a DiscoveryResponse or DeltaDiscoveryResponse as the
// client reads it.
type wireResponse struct {
	typeURL, version, nonce string
	// resources are each resource's name and encoding (the Any's value).
	resources []wireResource
	removed   []string
}

type wireResource struct {
	name  string
	value []byte
}

// fanCodec marshals requests as protobufs and reads responses into
// wireResponse. Names are copied; values alias the received buffer, which
// gRPC hands over (codec v1) and never reuses.
type fanCodec struct{ delta bool }

func (fanCodec) Name() string { return "proto" }

func (fanCodec) Marshal(v any) ([]byte, error) { return proto.Marshal(v.(proto.Message)) }

func (c fanCodec) Unmarshal(b []byte, v any) error {
	r := v.(*wireResponse)
	*r = wireResponse{}
	return eachField(b, func(num protowire.Number, val []byte) error {
		switch {
		case num == 4: // type_url in both
			r.typeURL = string(val)
		case num == 5: // nonce in both
			r.nonce = string(val)
		case num == 1 && !c.delta: // version_info
			r.version = string(val)
		case num == 1 && c.delta: // system_version_info
			r.version = string(val)
		case num == 2 && !c.delta: // resources: Any
			value, err := anyValue(val)
			if err != nil {
				return err
			}
			name, err := firstString(value)
			r.resources = append(r.resources, wireResource{name: name, value: value})
			return err
		case num == 2 && c.delta: // resources: Resource{name 3, resource 2 (Any)}
			var res wireResource
			err := eachField(val, func(n protowire.Number, v []byte) error {
				switch n {
				case 3:
					res.name = string(v)
				case 2:
					value, err := anyValue(v)
					res.value = value
					return err
				}
				return nil
			})
			r.resources = append(r.resources, res)
			return err
		case num == 6 && c.delta: // removed_resources
			r.removed = append(r.removed, string(val))
		}
		return nil
	})
}

// eachField calls fn with every length-delimited field of b and skips the
// others.
func eachField(b []byte, fn func(protowire.Number, []byte) error) error {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		if typ != protowire.BytesType {
			if n = protowire.ConsumeFieldValue(num, typ, b); n < 0 {
				return protowire.ParseError(n)
			}
			b = b[n:]
			continue
		}
		val, n := protowire.ConsumeBytes(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		if err := fn(num, val); err != nil {
			return err
		}
	}
	return nil
}

func anyValue(b []byte) ([]byte, error) {
	var value []byte
	err := eachField(b, func(n protowire.Number, v []byte) error {
		if n == 2 {
			value = v
		}
		return nil
	})
	return value, err
}

// firstString returns field 1 of a message: the name of a Cluster and the
// cluster_name of a ClusterLoadAssignment.
func firstString(b []byte) (string, error) {
	var s string
	err := eachField(b, func(n protowire.Number, v []byte) error {
		if n == 1 && s == "" {
			s = string(v)
		}
		return nil
	})
	return s, err
}

// countEndpoints counts the lb_endpoints of a ClusterLoadAssignment.
func countEndpoints(cla []byte) (int, error) {
	n := 0
	err := eachField(cla, func(num protowire.Number, loc []byte) error {
		if num != 2 {
			return nil
		}
		return eachField(loc, func(m protowire.Number, _ []byte) error {
			if m == 2 {
				n++
			}
			return nil
		})
	})
	return n, err
}

// fanSample is one timed change: the EDS resource that changes, when the
// write started, and when (and with which bytes) each client got it.
type fanSample struct {
	name    string
	start   time.Time
	arrived []time.Time
	got     [][]byte
	left    atomic.Int64
	done    chan struct{}
}

// fanClientWindow is each client's HTTP/2 receive window, per stream and
// connection.
const fanClientWindow = 16 << 20

// fanClient is one Envoy-style client.
type fanClient struct {
	idx    int
	delta  bool
	node   *corev3.Node
	suffix string    // EDS clusters counted: names ending in it
	conn   io.Closer // the gRPC client or the TCP connection
	stream fanStream
	sample *atomic.Pointer[fanSample]

	mu sync.Mutex
	// eds are the EDS cluster names CDS gave, counts the endpoints held per
	// counted cluster.
	eds    []string
	counts map[string]int
	ready  chan struct{} // closed once want endpoints are held
	want   int
	done   chan struct{}
	err    error
}

// fanStream is what a client needs of its stream: a gRPC stream, or the
// raw-TCP floor's connection (tcpFanStream).
type fanStream interface {
	SendMsg(m any) error
	RecvMsg(m any) error
}

// tcpFanStream is a client's stream to the raw-TCP floor: the same
// messages, each prefixed by its length, on a plain TCP connection.
type tcpFanStream struct {
	*tcpframe.Conn
	codec fanCodec
}

func (s tcpFanStream) SendMsg(m any) error {
	b, err := proto.Marshal(m.(proto.Message))
	if err != nil {
		return err
	}
	return s.Write(b)
}

func (s tcpFanStream) RecvMsg(m any) error {
	b, err := s.Read()
	if err != nil {
		return err
	}
	return s.codec.Unmarshal(b, m)
}

// dialFanClient connects client idx to addr (over gRPC, or plain TCP to
// the raw-TCP floor) and sends its first CDS request.
func dialFanClient(ctx context.Context, addr string, tcp bool, idx int, delta bool, node *corev3.Node, suffix string, want int, sample *atomic.Pointer[fanSample]) (*fanClient, error) {
	c := &fanClient{idx: idx, delta: delta, node: node, suffix: suffix, sample: sample, counts: map[string]int{},
		ready: make(chan struct{}), want: want, done: make(chan struct{})}
	if tcp {
		var d net.Dialer
		conn, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, err
		}
		fc := tcpframe.New(conn)
		c.conn, c.stream = fc, tcpFanStream{fc, fanCodec{delta: delta}}
	} else if err := c.dialGRPC(ctx, addr, delta); err != nil {
		return nil, err
	}
	var err error
	if delta {
		err = c.stream.SendMsg(&discovery.DeltaDiscoveryRequest{Node: node, TypeUrl: resource.ClusterType})
	} else {
		err = c.stream.SendMsg(&discovery.DiscoveryRequest{Node: node, TypeUrl: resource.ClusterType})
	}
	if err != nil {
		_ = c.conn.Close()
		return nil, err
	}
	go c.run()
	return c, nil
}

// dialGRPC opens the client's gRPC connection and ADS stream.
func (c *fanClient) dialGRPC(ctx context.Context, addr string, delta bool) error {
	// Fixed receive windows, as Envoy has (its HTTP/2 defaults are 256 MiB):
	// grpc-go's default would instead answer most responses with a
	// bandwidth-estimation PING that no Envoy or ztunnel sends, and that
	// every server would then have to read and answer.
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithStaticStreamWindowSize(fanClientWindow), grpc.WithStaticConnWindowSize(fanClientWindow))
	if err != nil {
		return err
	}
	c.conn = cc
	method, name := "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources", "StreamAggregatedResources"
	if delta {
		method, name = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources", "DeltaAggregatedResources"
	}
	c.stream, err = cc.NewStream(ctx, &grpc.StreamDesc{StreamName: name, ServerStreams: true, ClientStreams: true}, method,
		grpc.ForceCodec(fanCodec{delta: delta}), grpc.MaxCallRecvMsgSize(64<<20))
	if err != nil {
		_ = cc.Close()
	}
	return err
}

func (c *fanClient) close() {
	_ = c.conn.Close()
	<-c.done
}

func (c *fanClient) run() {
	defer close(c.done)
	for {
		var r wireResponse
		if err := c.stream.RecvMsg(&r); err != nil {
			c.err = err
			return
		}
		now := time.Now()
		var err error
		switch r.typeURL {
		case resource.ClusterType:
			err = c.onClusters(&r)
		case resource.EndpointType:
			err = c.onEndpoints(&r, now)
		default:
			err = fmt.Errorf("unexpected type %s", r.typeURL)
		}
		if err == nil {
			err = c.ack(&r)
		}
		if err != nil {
			c.err = err
			_ = c.conn.Close()
			return
		}
	}
}

// onClusters subscribes EDS to every EDS cluster of a CDS response (Envoy
// sends the EDS request before it ACKs CDS).
func (c *fanClient) onClusters(r *wireResponse) error {
	var eds []string
	for _, res := range r.resources {
		cl := &clusterv3.Cluster{}
		if err := proto.Unmarshal(res.value, cl); err != nil {
			return fmt.Errorf("cluster %s: %w", res.name, err)
		}
		if cl.GetType() == clusterv3.Cluster_EDS {
			eds = append(eds, cmpOr(cl.GetEdsClusterConfig().GetServiceName(), cl.GetName()))
		}
	}
	c.mu.Lock()
	old := c.eds
	added := newNames(old, eds)
	if c.delta {
		// A delta response names only the clusters that changed.
		c.eds = append(slices.Clone(old), added...)
	} else {
		c.eds = eds
	}
	c.mu.Unlock()
	if c.delta {
		if len(added) == 0 {
			return nil
		}
		return c.stream.SendMsg(&discovery.DeltaDiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNamesSubscribe: added})
	}
	return c.stream.SendMsg(&discovery.DiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNames: eds})
}

func newNames(old, cur []string) []string {
	seen := make(map[string]bool, len(old))
	for _, n := range old {
		seen[n] = true
	}
	var out []string
	for _, n := range cur {
		if !seen[n] {
			out = append(out, n)
		}
	}
	return out
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

func (c *fanClient) onEndpoints(r *wireResponse, now time.Time) error {
	s := c.sample.Load()
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, res := range r.resources {
		if s != nil && res.name == s.name && s.arrived[c.idx].IsZero() {
			s.arrived[c.idx] = now
			s.got[c.idx] = res.value
			if s.left.Add(-1) == 0 {
				close(s.done)
			}
		}
		if !strings.HasSuffix(res.name, c.suffix) {
			continue
		}
		n, err := countEndpoints(res.value)
		if err != nil {
			return fmt.Errorf("endpoints %s: %w", res.name, err)
		}
		c.counts[res.name] = n
	}
	for _, name := range r.removed {
		delete(c.counts, name)
	}
	total := 0
	for _, n := range c.counts {
		total += n
	}
	if total == c.want {
		select {
		case <-c.ready:
		default:
			close(c.ready)
		}
	}
	return nil
}

func (c *fanClient) ack(r *wireResponse) error {
	if c.delta {
		return c.stream.SendMsg(&discovery.DeltaDiscoveryRequest{TypeUrl: r.typeURL, ResponseNonce: r.nonce})
	}
	req := &discovery.DiscoveryRequest{TypeUrl: r.typeURL, VersionInfo: r.version, ResponseNonce: r.nonce}
	if r.typeURL == resource.EndpointType {
		c.mu.Lock()
		req.ResourceNames = c.eds
		c.mu.Unlock()
	}
	return c.stream.SendMsg(req)
}

// waitReady waits until the client holds every endpoint, or its stream
// ended, or d passed.
func (c *fanClient) waitReady(d time.Duration) error {
	select {
	case <-c.ready:
		return nil
	case <-c.done:
		return fmt.Errorf("client %d: stream ended: %w", c.idx, c.err)
	case <-time.After(d):
		c.mu.Lock()
		defer c.mu.Unlock()
		total := 0
		for _, n := range c.counts {
			total += n
		}
		return fmt.Errorf("client %d holds %d of %d endpoints (%d EDS clusters) after %v", c.idx, total, c.want, len(c.eds), d)
	}
}

// errStreamEnded reports a client whose stream ended during a sample.
var errStreamEnded = errors.New("stream ended")
