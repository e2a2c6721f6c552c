package xds

import (
	"context"
	"errors"
	"io"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// SotW streams (ADS and the per-type services) are served here, not by
// go-control-plane's server (delta streams: deltaserver.go). Per request,
// its server handed each request from a receiving goroutine to the stream's
// goroutine, rebuilt the subscription's map from the request's names, and
// picked the next event with a reflect.Select over a channel per watch. Here
// the receiving goroutine handles its requests itself: it decodes them
// against the previous ones (request.go), keeps the subscription's map while
// the names stay the same, and opens the watch. The stream's own goroutine
// sends what the watches deliver, in order, from one queue.
//
// The protocol is go-control-plane's: a request of a type whose nonce is
// not the last one sent for the type is stale and ignored (the client
// sends another); an ADS request must name its type; a request without a
// node has the stream's. One difference: a response is numbered when the
// cache delivers it, not when it is sent, and is never dropped. The caches
// count a client as in sync once they deliver to it, so a response dropped
// because a request overtook it (go-control-plane drops the pending
// response of a watch it replaces) would lose the changes it carried; here
// the overtaking request carries an older nonce and is ignored instead.

// sotwServer serves the SotW streams of a Server.
type sotwServer struct {
	// ctx ends every stream (Server.Run's end).
	ctx   context.Context
	stats *tracker
	// watch opens a watch (Server.sotwWatch).
	watch func(req *cache.Request, sub cache.Subscription, deliver func(cache.Response)) (func(), error)
	// intern replaces new names by the server's copies (Server.internNames).
	intern func(node *corev3.Node, typeURL string, names []string)
	// subs are the streams' subscriptions, shared.
	subs *subscriptions
	ids  atomic.Int64
}

// sotwServices registers pilot's SotW and delta streams in front of
// go-control-plane's server, which is left to refuse REST fetches.
type sotwServices struct {
	xdsServer
	sotw  *sotwServer
	delta *deltaServer
}

// StreamAggregatedResources serves a SotW ADS stream.
func (x sotwServices) StreamAggregatedResources(st discovery.AggregatedDiscoveryService_StreamAggregatedResourcesServer) error {
	return x.sotw.serve(st, resource.AnyType)
}

// StreamClusters serves a SotW CDS stream.
func (x sotwServices) StreamClusters(st clusterStream) error {
	return x.sotw.serve(st, resource.ClusterType)
}

// StreamEndpoints serves a SotW EDS stream.
func (x sotwServices) StreamEndpoints(st endpointStream) error {
	return x.sotw.serve(st, resource.EndpointType)
}

// StreamListeners serves a SotW LDS stream.
func (x sotwServices) StreamListeners(st listenerStream) error {
	return x.sotw.serve(st, resource.ListenerType)
}

// StreamRoutes serves a SotW RDS stream.
func (x sotwServices) StreamRoutes(st routeStream) error {
	return x.sotw.serve(st, resource.RouteType)
}

// sotwStream is one SotW stream.
type sotwStream struct {
	x           *sotwServer
	st          grpc.ServerStream
	id          int64
	defaultType string
	dec         *requestDecoder

	// mu guards the watches: the receiving goroutine opens them, the
	// stream's goroutine closes them all when the stream ends.
	mu      sync.Mutex
	watches byType[*sotwTypeWatch]
	closed  bool
	// node is the node of the last request handled.
	node *corev3.Node

	out outbox
}

// sotwTypeWatch is the stream's watch of one type.
type sotwTypeWatch struct {
	sub    *sotwSubscription
	cancel func()
}

// outbox queues the responses the caches deliver until the stream's
// goroutine sends them, and tells it when the stream is to end. deliver
// never blocks: the caches call it holding their lock. The stream's
// goroutine waits on wake alone: a select that also waited on the server's
// context would lock a channel all streams wait on, for every response.
type outbox struct {
	mu     sync.Mutex
	queue  []queued
	spare  []queued
	nonce  uint64
	nonces byType[string] // last nonce per type URL
	wake   chan struct{}
	// ended is set, with err (nil: the stream ends cleanly), once the
	// requests ended or the server stops.
	ended bool
	err   error
}

type queued struct {
	resp  cache.Response
	nonce string
}

// deliver queues resp and numbers it.
func (o *outbox) deliver(resp cache.Response) {
	o.mu.Lock()
	o.nonce++
	n := strconv.FormatUint(o.nonce, 10)
	o.nonces.set(resp.GetRequest().GetTypeUrl(), n)
	o.queue = append(o.queue, queued{resp: resp, nonce: n})
	o.mu.Unlock()
	o.signal()
}

func (o *outbox) signal() {
	select {
	case o.wake <- struct{}{}:
	default:
	}
}

// end tells the stream's goroutine to end the stream with err, once it
// sent what is queued; the first end counts.
func (o *outbox) end(err error) {
	o.mu.Lock()
	if !o.ended {
		o.ended, o.err = true, err
	}
	o.mu.Unlock()
	o.signal()
}

// lastNonce is the nonce of the last response of typeURL delivered.
func (o *outbox) lastNonce(typeURL string) string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.nonces.get(typeURL)
}

// take returns the queued responses, oldest first, and whether the stream
// is to end, with what.
func (o *outbox) take() (q []queued, ended bool, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	q = o.queue
	o.queue, o.spare = o.spare[:0], q
	return q, o.ended, o.err
}

func (x *sotwServer) newStream(st grpc.ServerStream, defaultType string) *sotwStream {
	return &sotwStream{
		x: x, st: st, id: x.ids.Add(1), defaultType: defaultType, dec: newRequestDecoder(),
		out: outbox{wake: make(chan struct{}, 1)},
	}
}

// serve serves one stream until it ends, the client breaks the protocol or
// the server stops.
func (x *sotwServer) serve(st grpc.ServerStream, defaultType string) error {
	s := x.newStream(st, defaultType)
	t := x.stats
	if err := t.OnStreamOpen(st.Context(), s.id, defaultType); err != nil {
		return err
	}
	defer t.OnStreamClosed(s.id, nil)
	defer s.close()
	go func() { s.out.end(s.receive()) }()
	defer context.AfterFunc(x.ctx, func() { s.out.end(errServerStops) })()
	for range s.out.wake {
		q, ended, err := s.out.take()
		if errors.Is(err, errServerStops) {
			return nil // and sends nothing more
		}
		if err := s.send(q); err != nil {
			return err
		}
		if ended {
			return err
		}
	}
	return nil // wake is never closed
}

// errServerStops ends every stream when the server stops.
var errServerStops = errors.New("the xDS server stops")

// close cancels the stream's watches; none is opened after.
func (s *sotwStream) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	for _, w := range s.watches {
		w.v.cancel()
		w.v.sub.release()
	}
}

// send sends the responses q, taken from the outbox.
func (s *sotwStream) send(q []queued) error {
	for _, r := range q {
		out, err := r.resp.GetDiscoveryResponse()
		if err != nil {
			return status.Errorf(codes.Internal, "build response: %v", err)
		}
		out.Nonce = r.nonce
		s.x.stats.OnStreamResponse(s.st.Context(), s.id, r.resp.GetRequest(), out)
		if err := s.st.SendMsg(out); err != nil {
			return err
		}
	}
	clear(q) // the queue's array is reused: it keeps no response alive
	return nil
}

// receive handles the stream's requests until it ends or one is refused.
func (s *sotwStream) receive() error {
	var m rawRequest
	for {
		if err := s.st.RecvMsg(&m); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		req, err := s.dec.decode(m.bytes())
		m.release()
		if err != nil {
			return err
		}
		if err := s.handle(req); err != nil {
			return err
		}
	}
}

// handle opens the watch a request asks for, replacing the type's last: an
// ACK in place, any other request on a fresh stack (stacks.go).
func (s *sotwStream) handle(req *discovery.DiscoveryRequest) error {
	switch {
	case req.TypeUrl == "" && s.defaultType == resource.AnyType:
		return status.Error(codes.InvalidArgument, "type URL is required for ADS")
	case req.TypeUrl == "":
		req.TypeUrl = s.defaultType
	}
	if s.routine(req) {
		return s.open(req)
	}
	return onFreshStack(func() error { return s.open(req) })
}

// routine reports whether req is an ACK of the stream's last response of
// its type: same node, same names, a watch already open.
func (s *sotwStream) routine(req *discovery.DiscoveryRequest) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	w := s.watches.get(req.TypeUrl)
	return w != nil && req.Node == s.node && sameSlice(req.ResourceNames, w.sub.names())
}

// open opens the watch req asks for, replacing the type's last.
func (s *sotwStream) open(req *discovery.DiscoveryRequest) error {
	if err := s.x.stats.sotwRequest(s.id, req); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.node = req.Node
	w := s.watches.get(req.TypeUrl)
	if w != nil {
		if n := s.out.lastNonce(req.TypeUrl); n != "" && req.ResponseNonce != n {
			// Stale: the client has not seen the last response yet.
			return nil
		}
		w.cancel()
		w.cancel = func() {}
	} else {
		w = &sotwTypeWatch{sub: newSotwSubscription(s.x.subs, nil), cancel: func() {}}
		s.watches.set(req.TypeUrl, w)
	}
	if len(req.ResourceNames) > 0 && !sameSlice(req.ResourceNames, w.sub.names()) {
		// New names (the decoder hands back the last slice when they are
		// the same): the subscription keeps the server's copies.
		s.x.intern(req.Node, req.TypeUrl, req.ResourceNames)
	}
	w.sub.set(req.ResourceNames)
	// From now on, the stream's requests and the cache hold the shared
	// names.
	req.ResourceNames = w.sub.names()
	s.dec.names.set(req.TypeUrl, req.ResourceNames)
	cancel, err := s.x.watch(req, w.sub, s.out.deliver)
	if err != nil {
		return err
	}
	w.cancel = cancel
	return nil
}

// sameSlice reports whether a and b are the same slice.
func sameSlice(a, b []string) bool {
	return len(a) == len(b) && (len(a) == 0 || &a[0] == &b[0])
}

// sotwSubscription is what a SotW stream subscribes to of one type, as
// go-control-plane's stream.Subscription has it (legacy wildcard
// included), except that it shares its names and set with the streams that
// subscribe to the same (subscriptions.go).
type sotwSubscription struct {
	tab    *subscriptions
	shared *sharedNames // nil while legacy wildcard
	// legacy: no request named a resource yet, which is wildcard.
	legacy bool
	// returned is empty and never written: typeCache names the stream by
	// it (streamOf).
	returned map[string]string
}

var _ cache.Subscription = (*sotwSubscription)(nil)

// noNames is the set of a legacy wildcard subscription; never modified.
var noNames = map[string]struct{}{}

// newSotwSubscription returns the subscription of a stream's first
// request of a type, shared in tab (which may be nil).
func newSotwSubscription(tab *subscriptions, names []string) *sotwSubscription {
	s := &sotwSubscription{tab: tab, legacy: true, returned: map[string]string{}}
	s.set(names)
	return s
}

// set makes names the subscription and reports whether they are new
// (other than the last request's).
func (s *sotwSubscription) set(names []string) bool {
	if s.legacy {
		if len(names) == 0 {
			return false
		}
		s.legacy = false
	} else if s.shared != nil && slices.Equal(names, s.shared.names) {
		return false
	}
	old := s.shared
	s.shared = s.tab.acquire(names)
	s.tab.release(old)
	return true
}

// names returns the names subscribed to, shared: never modify them.
func (s *sotwSubscription) names() []string {
	if s.shared == nil {
		return nil
	}
	return s.shared.names
}

// release gives the subscription's names back to the table.
func (s *sotwSubscription) release() {
	s.tab.release(s.shared)
	s.shared = nil
}

func (s *sotwSubscription) ReturnedResources() map[string]string { return s.returned }

func (s *sotwSubscription) SubscribedResources() map[string]struct{} {
	if s.shared == nil {
		return noNames
	}
	return s.shared.set
}

func (s *sotwSubscription) IsWildcard() bool {
	return s.legacy || s.shared.wildcard
}

// sotwWatch opens a SotW watch on the view of the request's node.
func (s *Server) sotwWatch(req *cache.Request, sub cache.Subscription, deliver func(cache.Response)) (func(), error) {
	if t := req.GetTypeUrl(); t == AuthorizationType || t == IstioAuthorizationType || t == IstioAddressType {
		return nil, status.Errorf(codes.Unimplemented, "%s is served over delta xDS only", t)
	}
	if err := checkType(req.GetTypeUrl()); err != nil {
		return nil, err
	}
	v, err := s.viewFor(req.GetNode(), req.GetTypeUrl())
	if err != nil {
		return nil, err
	}
	return v.cache(req.GetTypeUrl()).watchSotw(req, sub, deliver)
}
