package xds

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
)

// TypeStatus is what a client has been sent and has answered for one type URL.
type TypeStatus struct {
	// SentVersion and SentNonce are those of the last response sent.
	SentVersion string `json:"sentVersion"`
	SentNonce   string `json:"sentNonce"`
	// SentResources is the number of resources in the last response.
	SentResources int `json:"sentResources"`
	// AckedVersion and AckedNonce are those of the last accepted response:
	// after a NACK the client still runs this version.
	AckedVersion string `json:"ackedVersion,omitempty"`
	AckedNonce   string `json:"ackedNonce,omitempty"`
	// LastNack is the last rejection, if any.
	LastNack *Nack `json:"lastNack,omitempty"`
	// Pushes counts the responses sent.
	Pushes int `json:"pushes"`
	// Pending is true while the last response is neither ACKed nor NACKed.
	Pending bool `json:"pending"`

	// asked is when the last request of the type arrived.
	asked time.Time
}

// Nack is a rejected response.
type Nack struct {
	// Nonce is the nonce of the rejected response.
	Nonce string `json:"nonce"`
	// Message is the client's error_detail message.
	Message string `json:"message"`
	// At is when the rejection arrived.
	At time.Time `json:"at"`
}

// ClientStatus is the state of one xDS stream, as /debug/syncz shows it.
type ClientStatus struct {
	// StreamID is go-control-plane's id of the stream, unique per Protocol.
	StreamID int64 `json:"streamId"`
	// NodeID is the node id of the client.
	NodeID string `json:"nodeId"`
	// Identity is the SPIFFE ID of the client's verified certificate; empty
	// on the plaintext development listener.
	Identity string `json:"identity,omitempty"`
	// Cluster and Network are the client's class: its node metadata's claims
	// once checked against its identity.
	Cluster string `json:"cluster"`
	Network string `json:"network"`
	// Protocol is "sotw" or "delta".
	Protocol string `json:"protocol"`
	// Connected is when the stream opened.
	Connected time.Time `json:"connected"`
	// Types is the status per type URL (set in snapshots; the tracker's
	// own record keeps types).
	Types map[string]*TypeStatus `json:"types"`
	types byType[*TypeStatus]

	node *corev3.Node
	// claims are the first node's, as received, before authorization
	// pinned its network; later nodes of the stream must claim the same.
	claims *nodeClaims
	peer   peerIdentity
}

// tracker implements go-control-plane's server callbacks: it keeps the state
// of every stream and the metrics. Callbacks run on stream goroutines.
type tracker struct {
	metrics *metrics
	log     *slog.Logger
	classOf func(*corev3.Node) class
	auth    *authorizer
	// intern replaces the resource names a request of a node subscribes
	// to by the server's copies (typeCache.intern).
	intern func(node *corev3.Node, typeURL string, names []string)

	// built and changed are the start of the last build batch and the
	// arrival of its first change (unix nanoseconds), for the push time
	// and convergence metrics (batchStarted).
	built, changed atomic.Int64

	mu      sync.Mutex
	streams map[streamKey]*ClientStatus
}

// batchStarted records that a build batch started at start with changes
// pending since changed (zero: since start). A response counted after it
// carries its version, or a later one's.
func (t *tracker) batchStarted(start, changed time.Time) {
	if changed.IsZero() || changed.After(start) {
		changed = start
	}
	t.changed.Store(changed.UnixNano())
	t.built.Store(start.UnixNano())
}

var _ serverv3.Callbacks = (*tracker)(nil)

func newTracker(m *metrics, log *slog.Logger, classOf func(*corev3.Node) class, auth *authorizer, intern func(*corev3.Node, string, []string)) *tracker {
	return &tracker{metrics: m, log: log, classOf: classOf, auth: auth, intern: intern, streams: map[streamKey]*ClientStatus{}}
}

// open admits a stream whose transport identity is acceptable.
// streamKey names a stream: go-control-plane numbers SotW and delta
// streams with separate counters, so an id alone is ambiguous.
type streamKey struct {
	delta bool
	id    int64
}

func sotwKey(id int64) streamKey  { return streamKey{id: id} }
func deltaKey(id int64) streamKey { return streamKey{delta: true, id: id} }

func (t *tracker) open(ctx context.Context, k streamKey, protocol string) error {
	p := peerOf(ctx)
	if err := t.auth.open(p); err != nil {
		return t.refused(err, "", p)
	}
	t.mu.Lock()
	t.streams[k] = &ClientStatus{StreamID: k.id, Protocol: protocol, Connected: time.Now(), Identity: p.spiffe, peer: p}
	t.mu.Unlock()
	t.metrics.connected(protocol, 1)
	return nil
}

// refused counts and logs a refusal and returns it as the stream's error.
func (t *tracker) refused(err error, nodeID string, p peerIdentity) error {
	reason := "unknown"
	if r, ok := err.(*refusal); ok {
		reason = r.reason
	}
	t.metrics.refused.WithLabelValues(reason).Inc()
	t.log.Warn("xds stream refused", "reason", reason, "node", nodeID, "identity", p.spiffe, "err", err)
	return err
}

// admit authorizes the node a request carries, if it is new to the stream:
// the first one is checked against the stream's identity (and its network
// pinned); a later one must make the same claims.
func (t *tracker) admit(k streamKey, node *corev3.Node) error {
	t.mu.Lock()
	cs := t.streams[k]
	if cs == nil || node == nil || node == cs.node {
		t.mu.Unlock()
		return nil
	}
	claims, p := cs.claims, cs.peer
	t.mu.Unlock()
	// Authorizing runs deep, and once per stream: on a stack of its own
	// (onFreshStack).
	return onFreshStack(func() error { return t.admitNew(cs, claims, p, node) })
}

// admitNew authorizes a node new to the stream of cs.
func (t *tracker) admitNew(cs *ClientStatus, claims *nodeClaims, p peerIdentity, node *corev3.Node) error {
	if claims != nil && !claims.match(node) {
		return t.refused(refuse(codes.InvalidArgument, RefusedNodeChanged, "a stream's node id, %s, %s and %s may not change", MetadataClusterID, MetadataNetwork, MetadataNodeName), node.GetId(), p)
	}
	var first *nodeClaims
	if claims == nil {
		first = claimsOf(node)
	}
	if err := t.auth.authorize(p, node); err != nil {
		return t.refused(err, node.GetId(), p)
	}
	c := t.classOf(node)
	t.mu.Lock()
	if cs.claims == nil {
		cs.claims = first
	}
	cs.node, cs.NodeID, cs.Cluster, cs.Network = node, node.GetId(), string(c.Cluster), string(c.Network)
	t.mu.Unlock()
	return nil
}

func (t *tracker) closed(k streamKey) {
	t.mu.Lock()
	cs := t.streams[k]
	delete(t.streams, k)
	t.mu.Unlock()
	if cs != nil {
		t.metrics.connected(cs.Protocol, -1)
	}
}

// request authorizes the node a request carries and records its ACK or NACK.
func (t *tracker) request(k streamKey, node *corev3.Node, typeURL, nonce string, nack *Nack) error {
	if err := t.admit(k, node); err != nil {
		return err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	cs := t.streams[k]
	if cs == nil {
		return nil
	}
	ts := cs.typeStatus(typeURL)
	ts.asked = time.Now()
	if nonce == "" || nonce != ts.SentNonce {
		return nil
	}
	ts.Pending = false
	if nack != nil {
		ts.LastNack = nack
		t.metrics.rejected(typeURL)
		t.log.Warn("xds NACK", "node", cs.NodeID, "type", typeURL, "nonce", nonce, "error", nack.Message)
		return nil
	}
	ts.AckedNonce, ts.AckedVersion = nonce, ts.SentVersion
	return nil
}

func (cs *ClientStatus) typeStatus(typeURL string) *TypeStatus {
	ts := cs.types.get(typeURL)
	if ts == nil {
		ts = &TypeStatus{}
		cs.types.set(typeURL, ts)
	}
	return ts
}

func (t *tracker) response(k streamKey, typeURL, version, nonce string, n int, size int) {
	now := time.Now()
	var began time.Time
	pushed := false
	if b := t.built.Load(); b != 0 {
		began, pushed = time.Unix(0, b), true
	}
	t.mu.Lock()
	if cs := t.streams[k]; cs != nil {
		ts := cs.typeStatus(typeURL)
		ts.SentVersion, ts.SentNonce, ts.SentResources, ts.Pending = version, nonce, n, true
		ts.Pushes++
		// The work began at the later of the request answered and the
		// build of the version carried; after the request, it is a push.
		if ts.asked.After(began) {
			began, pushed = ts.asked, false
		}
	}
	t.mu.Unlock()
	if began.IsZero() {
		began = now
	}
	t.metrics.sentOf(typeURL).count(size, now.Sub(began))
	if pushed {
		t.metrics.istio.convergence.Observe(now.Sub(time.Unix(0, t.changed.Load())).Seconds())
	}
}

func nackOf(d interface{ GetMessage() string }, nonce string, present bool) *Nack {
	if !present {
		return nil
	}
	return &Nack{Nonce: nonce, Message: d.GetMessage(), At: time.Now()}
}

// OnStreamOpen records a new SotW stream.
func (t *tracker) OnStreamOpen(ctx context.Context, id int64, _ string) error {
	return t.open(ctx, sotwKey(id), "sotw")
}

// OnStreamClosed forgets a SotW stream.
func (t *tracker) OnStreamClosed(id int64, _ *corev3.Node) { t.closed(sotwKey(id)) }

// OnDeltaStreamOpen records a new delta stream.
func (t *tracker) OnDeltaStreamOpen(ctx context.Context, id int64, _ string) error {
	return t.open(ctx, deltaKey(id), "delta")
}

// OnDeltaStreamClosed forgets a delta stream.
func (t *tracker) OnDeltaStreamClosed(id int64, _ *corev3.Node) { t.closed(deltaKey(id)) }

// OnStreamRequest is go-control-plane's callback for SotW requests, which
// pilot serves itself (sotwserver.go): it is sotwRequest.
func (t *tracker) OnStreamRequest(id int64, req *discovery.DiscoveryRequest) error {
	return t.sotwRequest(id, req)
}

// sotwRequest authorizes the node of a SotW request and records its ACK or
// NACK.
func (t *tracker) sotwRequest(id int64, req *discovery.DiscoveryRequest) error {
	return t.request(sotwKey(id), req.GetNode(), req.GetTypeUrl(), req.GetResponseNonce(),
		nackOf(req.GetErrorDetail(), req.GetResponseNonce(), req.GetErrorDetail() != nil))
}

// OnStreamResponse records a SotW response.
func (t *tracker) OnStreamResponse(_ context.Context, id int64, req *discovery.DiscoveryRequest, resp *discovery.DiscoveryResponse) {
	t.response(sotwKey(id), req.GetTypeUrl(), resp.GetVersionInfo(), resp.GetNonce(), bodyResources(resp, len(resp.GetResources())), proto.Size(resp))
}

// OnStreamDeltaRequest records the ACK or NACK of a delta request.
// It interns the names subscribed to: go-control-plane calls it before it
// adds them to the stream's subscription, so the names it keeps are the
// server's copies.
func (t *tracker) OnStreamDeltaRequest(id int64, req *discovery.DeltaDiscoveryRequest) error {
	if err := t.request(deltaKey(id), req.GetNode(), req.GetTypeUrl(), req.GetResponseNonce(),
		nackOf(req.GetErrorDetail(), req.GetResponseNonce(), req.GetErrorDetail() != nil)); err != nil {
		return err
	}
	t.internNames(deltaKey(id), req.GetNode(), req.GetTypeUrl(), req.GetResourceNamesSubscribe())
	return nil
}

// internNames interns the names a request of stream k subscribes to, in
// the class of its node (the stream's, when the request carries none).
func (t *tracker) internNames(k streamKey, node *corev3.Node, typeURL string, names []string) {
	if t.intern == nil || len(names) == 0 {
		return
	}
	if node == nil {
		t.mu.Lock()
		if cs := t.streams[k]; cs != nil {
			node = cs.node
		}
		t.mu.Unlock()
	}
	if node != nil {
		t.intern(node, typeURL, names)
	}
}

// OnStreamDeltaResponse records a delta response.
func (t *tracker) OnStreamDeltaResponse(id int64, req *discovery.DeltaDiscoveryRequest, resp *discovery.DeltaDiscoveryResponse) {
	t.response(deltaKey(id), req.GetTypeUrl(), resp.GetSystemVersionInfo(), resp.GetNonce(), bodyResources(resp, len(resp.GetResources()))+len(resp.GetRemovedResources()), proto.Size(resp))
}

// OnFetchRequest accepts REST fetches (the cache refuses them).
func (t *tracker) OnFetchRequest(context.Context, *discovery.DiscoveryRequest) error { return nil }

// OnFetchResponse does nothing.
func (t *tracker) OnFetchResponse(*discovery.DiscoveryRequest, *discovery.DiscoveryResponse) {}

// snapshot returns deep copies of every stream's status.
func (t *tracker) snapshot() []ClientStatus {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]ClientStatus, 0, len(t.streams))
	for _, cs := range t.streams {
		c := *cs
		c.types = nil
		c.Types = make(map[string]*TypeStatus, len(cs.types))
		for _, v := range cs.types {
			tv := *v.v
			c.Types[v.typeURL] = &tv
		}
		out = append(out, c)
	}
	return out
}
