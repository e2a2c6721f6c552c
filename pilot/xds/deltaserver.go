package xds

import (
	"context"
	"maps"
	"slices"
	"strconv"
	"sync/atomic"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	clusterservice "github.com/envoyproxy/go-control-plane/envoy/service/cluster/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	endpointservice "github.com/envoyproxy/go-control-plane/envoy/service/endpoint/v3"
	listenerservice "github.com/envoyproxy/go-control-plane/envoy/service/listener/v3"
	routeservice "github.com/envoyproxy/go-control-plane/envoy/service/route/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Delta streams are served here, as go-control-plane's delta server serves
// them (its processDelta, request for request and response for response:
// the caches, typecache.go and authz.go, and the contract tests rely on
// it), with one difference: a stream's subscription to a type shares its
// set of names with every stream subscribed to the same names (the table
// of subscriptions.go), where go-control-plane's keeps a map per stream, a
// map of 100 names being 3.3 KB of an idle delta client's ~41 KB.

// DeltaAggregatedResources serves a delta ADS stream.
func (x sotwServices) DeltaAggregatedResources(st deltaStreamServer) error {
	return x.delta.serve(st, resource.AnyType)
}

// DeltaClusters serves a delta CDS stream.
func (x sotwServices) DeltaClusters(st clusterservice.ClusterDiscoveryService_DeltaClustersServer) error {
	return x.delta.serve(st, resource.ClusterType)
}

// DeltaEndpoints serves a delta EDS stream.
func (x sotwServices) DeltaEndpoints(st endpointservice.EndpointDiscoveryService_DeltaEndpointsServer) error {
	return x.delta.serve(st, resource.EndpointType)
}

// DeltaListeners serves a delta LDS stream.
func (x sotwServices) DeltaListeners(st listenerservice.ListenerDiscoveryService_DeltaListenersServer) error {
	return x.delta.serve(st, resource.ListenerType)
}

// DeltaRoutes serves a delta RDS stream.
func (x sotwServices) DeltaRoutes(st routeservice.RouteDiscoveryService_DeltaRoutesServer) error {
	return x.delta.serve(st, resource.RouteType)
}

// deltaStreamServer is the server side of a delta stream, ADS or one
// type's: their interfaces are the same.
type deltaStreamServer = discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesServer

// deltaWatcher opens a delta stream's watches: routerCache, or a recording
// cache in the contract tests. It answers on ch, which never blocks: ch
// holds a response for every type a stream can watch.
type deltaWatcher interface {
	CreateDeltaWatch(req *cache.DeltaRequest, sub cache.Subscription, ch chan cache.DeltaResponse) (func(), error)
}

// deltaCallbacks are told of delta streams (the tracker; go-control-plane's
// server.Callbacks fit).
type deltaCallbacks interface {
	OnDeltaStreamOpen(ctx context.Context, id int64, typeURL string) error
	OnDeltaStreamClosed(id int64, node *corev3.Node)
	OnStreamDeltaRequest(id int64, req *discovery.DeltaDiscoveryRequest) error
	OnStreamDeltaResponse(id int64, req *discovery.DeltaDiscoveryRequest, resp *discovery.DeltaDiscoveryResponse)
}

// deltaServer serves the delta streams of a Server.
type deltaServer struct {
	// ctx ends every stream (Server.Run's end).
	ctx       context.Context
	watcher   deltaWatcher
	callbacks deltaCallbacks
	subs      *subscriptions
	ids       atomic.Int64
}

// deltaTypes bounds the responses a stream can have waiting: one per type
// it watches (the types served and the two authorization types; any other
// type ends the stream), twice over as go-control-plane sizes it.
var deltaTypes = 2 * (len(allTypes) + 2)

// serve serves one delta stream until it ends, the client breaks the
// protocol or the server stops. A goroutine receives the requests
// (deltaStream), and this one handles them and the responses in turn.
func (x *deltaServer) serve(st deltaStreamServer, defaultType string) error {
	d := &deltaStream{deltaStreamServer: st}
	reqs := make(chan *discovery.DeltaDiscoveryRequest)
	go func() {
		defer close(reqs)
		for {
			req, err := d.Recv()
			if err != nil {
				return
			}
			select {
			case reqs <- req:
			case <-st.Context().Done():
				return
			case <-x.ctx.Done():
				return
			}
		}
	}()
	err := x.process(st, reqs, defaultType)
	if refused := d.refused.Load(); err == nil && refused != nil {
		// The receive ended on a malformed request: end with its status.
		return *refused
	}
	return err
}

// deltaTypeWatch is a delta stream's watch of one type.
type deltaTypeWatch struct {
	sub    *deltaSubscription
	cancel func()
}

func (w *deltaTypeWatch) stop() {
	if w.cancel != nil {
		w.cancel()
		w.cancel = nil
	}
}

// deltaProcess is one delta stream, as its handling goroutine holds it.
type deltaProcess struct {
	x         *deltaServer
	st        deltaStreamServer
	id, nonce int64
	// responses are the watches' answers, waiting to be sent.
	responses chan cache.DeltaResponse
	watches   byType[*deltaTypeWatch]
	// node is the stream's node: only the first request need carry it.
	node *corev3.Node
}

// process handles a stream's requests and the responses its watches get.
func (x *deltaServer) process(st deltaStreamServer, reqs <-chan *discovery.DeltaDiscoveryRequest, defaultType string) error {
	p := &deltaProcess{x: x, st: st, id: x.ids.Add(1), responses: make(chan cache.DeltaResponse, deltaTypes), node: &corev3.Node{}}
	defer p.close()
	if err := x.callbacks.OnDeltaStreamOpen(st.Context(), p.id, defaultType); err != nil {
		return err
	}
	for {
		select {
		case <-x.ctx.Done():
			return nil
		case resp := <-p.responses:
			if err := p.send(resp); err != nil {
				return err
			}
		case req, more := <-reqs:
			if !more {
				return nil
			}
			if err := p.handle(req, defaultType); err != nil {
				return err
			}
		}
	}
}

func (p *deltaProcess) close() {
	for _, w := range p.watches {
		w.v.stop()
		w.v.sub.release()
	}
	p.x.callbacks.OnDeltaStreamClosed(p.id, p.node)
}

// send sends a watch's response and keeps, as the versions the client
// holds, those the response says it leaves.
func (p *deltaProcess) send(resp cache.DeltaResponse) error {
	out, err := resp.GetDeltaDiscoveryResponse()
	if err != nil {
		return status.Errorf(codes.Internal, "build response: %v", err)
	}
	p.nonce++
	out.Nonce = strconv.FormatInt(p.nonce, 10)
	p.x.callbacks.OnStreamDeltaResponse(p.id, resp.GetDeltaRequest(), out)
	if err := p.st.Send(out); err != nil {
		return err
	}
	if w := p.watches.get(resp.GetDeltaRequest().GetTypeUrl()); w != nil {
		w.sub.returned = resp.GetNextVersionMap()
	}
	return nil
}

// handle handles a request: first the responses waiting, so that it is
// handled against the state they leave, then the callback, then its watch.
func (p *deltaProcess) handle(req *discovery.DeltaDiscoveryRequest, defaultType string) error {
	for len(p.responses) > 0 {
		if err := p.send(<-p.responses); err != nil {
			return err
		}
	}
	// Only the first request need carry the node; the others get the
	// stream's, and so does a first request that names none: it is
	// authorized as the empty node it is (refused over TLS), as SotW does,
	// not served unchecked. deltaStream.Recv decoded the node into what
	// the stream keeps of it (nodewire.go).
	if req.GetNode() != nil {
		p.node = req.GetNode()
	}
	req.Node = p.node
	if err := p.x.callbacks.OnStreamDeltaRequest(p.id, req); err != nil {
		return err
	}
	switch {
	case req.GetTypeUrl() == "" && defaultType == resource.AnyType:
		return status.Error(codes.InvalidArgument, "type URL is required for ADS")
	case req.GetTypeUrl() == "":
		req.TypeUrl = defaultType
	}
	return p.watch(req)
}

// watch opens the watch req asks for, replacing the type's last.
func (p *deltaProcess) watch(req *discovery.DeltaDiscoveryRequest) error {
	w := p.watches.get(req.GetTypeUrl())
	first := w == nil
	if first {
		// The first request of the type: the versions the client holds,
		// and wildcard in its legacy sense (no name subscribed) until a
		// name is.
		w = &deltaTypeWatch{sub: newDeltaSubscription(p.x.subs, req.GetResourceNamesSubscribe(), req.GetResourceNamesUnsubscribe(), req.GetInitialResourceVersions())}
		p.watches.set(req.GetTypeUrl(), w)
	} else {
		// Cancelled first: the cache no longer reads the subscription.
		w.stop()
		w.sub.update(req.GetResourceNamesSubscribe(), req.GetResourceNamesUnsubscribe())
	}
	open := func() error {
		cancel, err := p.x.watcher.CreateDeltaWatch(req, w.sub, p.responses)
		w.cancel = cancel
		return err
	}
	if first {
		// A first watch runs deep (it may build the view of the client's
		// class): on a stack of its own (stacks.go).
		return onFreshStack(open)
	}
	return open()
}

// deltaSubscription is what a delta stream subscribes to of one type, as
// go-control-plane's stream.Subscription has it, except that a set of up
// to maxSharedNames names is shared (subscriptions.go) and replaced, never
// modified, when the names change.
type deltaSubscription struct {
	tab    *subscriptions
	shared *sharedNames // sorted; nil while none, or while own
	// own is a set larger than maxSharedNames, the stream's own.
	own map[string]struct{}
	// wildcard: every resource. legacy: no name subscribed yet, which is
	// wildcard until one is.
	wildcard, legacy bool
	// returned are the versions the client holds, as the cache reads them:
	// the first request's, then each response's next version map; an
	// unsubscribed name is dropped, or, while wildcard, kept with an empty
	// version for a fresh answer.
	returned map[string]string
}

// maxSharedNames bounds the sets delta subscriptions share. Changing a
// shared set copies and sorts it: a stream that subscribes to a large set
// name by name, each request a few bytes, would make each cost the whole
// set. A larger set (rarely the same across streams) is the stream's own
// and edited in place, as go-control-plane's.
const maxSharedNames = memoMaxNames

var _ cache.Subscription = (*deltaSubscription)(nil)

func newDeltaSubscription(tab *subscriptions, subscribe, unsubscribe []string, initial map[string]string) *deltaSubscription {
	s := &deltaSubscription{tab: tab, wildcard: len(subscribe) == 0, legacy: true, returned: initial}
	if s.returned == nil {
		s.returned = map[string]string{}
	}
	s.update(subscribe, unsubscribe)
	return s
}

// update applies a request's subscriptions and unsubscriptions.
func (s *deltaSubscription) update(subscribe, unsubscribe []string) {
	if s.legacy {
		if len(subscribe) == 0 {
			return
		}
		s.legacy = false
	}
	set, owned, changed := s.SubscribedResources(), s.own != nil, false
	edit := func() {
		changed = true
		if !owned {
			set, owned = make(map[string]struct{}, len(set)+len(subscribe)), true
			maps.Copy(set, s.SubscribedResources())
		}
	}
	for _, name := range subscribe {
		if name == "*" {
			s.wildcard = true
			continue
		}
		if _, ok := set[name]; !ok {
			edit()
			set[name] = struct{}{}
		}
	}
	for _, name := range unsubscribe {
		if name == "*" {
			s.wildcard = false
			continue
		}
		_, ok := set[name]
		if ok && s.wildcard {
			s.returned[name] = ""
		} else {
			delete(s.returned, name)
		}
		if ok {
			edit()
			delete(set, name)
		}
	}
	if !changed {
		return
	}
	old := s.shared
	if len(set) > maxSharedNames {
		s.shared, s.own = nil, set
	} else {
		s.shared, s.own = s.tab.acquire(slices.Sorted(maps.Keys(set))), nil
	}
	s.tab.release(old)
}

// release gives the subscription's names back to the table.
func (s *deltaSubscription) release() {
	s.tab.release(s.shared)
	s.shared, s.own = nil, nil
}

func (s *deltaSubscription) ReturnedResources() map[string]string { return s.returned }

func (s *deltaSubscription) SubscribedResources() map[string]struct{} {
	switch {
	case s.own != nil:
		return s.own
	case s.shared != nil:
		return s.shared.set
	}
	return noNames
}

func (s *deltaSubscription) IsWildcard() bool { return s.wildcard }
