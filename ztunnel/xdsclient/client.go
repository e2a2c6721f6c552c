// Package xdsclient is ztunnel's delta xDS client for workload discovery: it
// keeps one ADS stream (DeltaAggregatedResources) to pilot for the Address
// type, subscribes to every resource (wildcard) and, on demand, to named
// ones, validates and converts each Address into ztunnel/state values, and
// applies every response to a state.Store as one atomic snapshot swap.
//
// A response whose resources all convert is ACKed. A resource that fails to
// unmarshal or validate is skipped: the client keeps the last good version of
// it, applies the rest of the response, and NACKs with an error_detail naming
// every rejected resource. When the stream breaks the store keeps serving the
// last good state; the client reconnects with exponential backoff and jitter
// and resumes with initial_resource_versions of everything it holds, so pilot
// sends only what changed while it was away.
//
// More resource types ride the same stream (Deps.Types: the authorization
// type, taken by ztunnel/authz.Store), each subscribed wildcard, applied by
// its own handler, ACKed or NACKed the same way and resumed with its own
// versions.
package xdsclient

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/isthmus-mesh/isthmus/internal/backoff"
	"github.com/isthmus-mesh/isthmus/internal/defaults"
	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// Node metadata keys pilot reads to place a client (Istio's names).
const (
	MetadataClusterID = "CLUSTER_ID"
	MetadataNetwork   = "NETWORK"
	MetadataNodeName  = "NODE_NAME"
)

// Wildcard is the resource name of a wildcard subscription.
const Wildcard = "*"

// Config configures a Client. Zero fields take the defaults of
// DefaultConfig (applied by New, in one place).
type Config struct {
	// Address is pilot's xDS address, host:port (15012 with mTLS, 15010
	// plaintext for development). Required.
	Address string
	// NodeID is the xDS node id. Required.
	NodeID string
	// NodeName is the Kubernetes node this ztunnel runs on (NODE_NAME metadata).
	NodeName string
	// ClusterID and Network are sent as CLUSTER_ID and NETWORK metadata;
	// Network also selects which service VIPs are kept.
	ClusterID string
	Network   string
	// TrustDomain fills workloads whose resource names none.
	TrustDomain string
	// Metadata is extra node metadata (string values).
	Metadata map[string]string
	// OnDemandOnly drops the wildcard subscription: only names given to
	// Subscribe are asked for.
	OnDemandOnly bool
	// InitialBackoff and MaxBackoff bound the reconnect delay, which doubles
	// on each failed attempt; the delay actually slept is jittered between
	// half of it and all of it.
	InitialBackoff time.Duration
	MaxBackoff     time.Duration
	// KeepaliveTime is the gRPC keepalive ping interval.
	KeepaliveTime time.Duration
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{
		TrustDomain:    defaults.TrustDomain,
		InitialBackoff: 100 * time.Millisecond,
		MaxBackoff:     15 * time.Second,
		KeepaliveTime:  30 * time.Second,
	}
}

func (c Config) withDefaults() Config {
	d := DefaultConfig()
	if c.TrustDomain == "" {
		c.TrustDomain = d.TrustDomain
	}
	if c.InitialBackoff <= 0 {
		c.InitialBackoff = d.InitialBackoff
	}
	if c.MaxBackoff <= 0 {
		c.MaxBackoff = d.MaxBackoff
	}
	if c.MaxBackoff < c.InitialBackoff {
		c.MaxBackoff = c.InitialBackoff
	}
	if c.KeepaliveTime <= 0 {
		c.KeepaliveTime = d.KeepaliveTime
	}
	return c
}

// Deps are the Client's collaborators. Store and Credentials are required.
type Deps struct {
	// Store receives the converted resources.
	Store *state.Store
	// Credentials secure the connection to pilot: insecure.NewCredentials()
	// for plaintext (tests, 15010), TLS with the node's certificate for 15012.
	Credentials credentials.TransportCredentials
	// DialOptions are appended to the client's own gRPC dial options.
	DialOptions []grpc.DialOption
	// Log defaults to a discarding logger.
	Log *slog.Logger
	// Types take more resource types on the same stream, each subscribed
	// wildcard (ztunnel/authz.Store takes the authorization type).
	Types []TypeHandler
	// Registerer receives the client's metrics (nil: not registered).
	Registerer prometheus.Registerer
}

// TypeHandler takes the responses of one more resource type. Apply and
// Versions are called from Run's goroutine only.
type TypeHandler interface {
	// TypeURL is the type taken.
	TypeURL() string
	// Apply applies one response as a whole and returns the errors of the
	// resources it rejected (which keep their last good version); they are
	// NACKed.
	Apply(resources []*discovery.Resource, removed []string) []error
	// Versions returns what the handler holds, name -> version, sent as
	// initial_resource_versions when a stream opens.
	Versions() map[string]string
}

// Client is a delta xDS client feeding a state.Store. Run drives it; the
// other methods are safe for concurrent use.
type Client struct {
	cfg     Config
	deps    Deps
	log     *slog.Logger
	metrics *metrics
	conv    converter
	node    *core.Node

	// held is what the client holds (name -> version and kind); written
	// only by Run's goroutine, read under heldMu by others.
	heldMu sync.RWMutex
	held   map[string]heldResource

	// sendMu serializes Send on the live stream and guards cur, onDemand
	// and needInitial.
	sendMu   sync.Mutex
	cur      discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesClient
	onDemand map[string]struct{}
	// needInitial is set while an OnDemandOnly stream waits for its first
	// name: an initial request without names would mean wildcard.
	needInitial bool

	synced    atomic.Bool
	connected atomic.Bool
	syncedCh  chan struct{}
	syncOnce  sync.Once

	streams, responses, acks, nacks atomic.Int64
	resources, removals             atomic.Int64

	closeOnce sync.Once
	closed    chan struct{}
	runMu     sync.Mutex
	runDone   chan struct{} // set when Run starts, closed when it returns
}

type heldResource struct {
	version string
	kind    kind
}

// New returns a Client. It does no I/O.
func New(cfg Config, deps Deps) (*Client, error) {
	cfg = cfg.withDefaults()
	if cfg.Address == "" || cfg.NodeID == "" {
		return nil, errors.New("xdsclient: Address and NodeID are required")
	}
	if deps.Store == nil || deps.Credentials == nil {
		return nil, errors.New("xdsclient: Store and Credentials are required")
	}
	if deps.Log == nil {
		deps.Log = slog.New(slog.DiscardHandler)
	}
	md := map[string]any{}
	for k, v := range cfg.Metadata {
		md[k] = v
	}
	md[MetadataClusterID] = cfg.ClusterID
	md[MetadataNetwork] = cfg.Network
	if cfg.NodeName != "" {
		md[MetadataNodeName] = cfg.NodeName
	}
	meta, err := structpb.NewStruct(md)
	if err != nil {
		return nil, fmt.Errorf("xdsclient: node metadata: %w", err)
	}
	m, err := newMetrics(deps.Registerer)
	if err != nil {
		return nil, fmt.Errorf("xdsclient: metrics: %w", err)
	}
	return &Client{
		cfg:      cfg,
		deps:     deps,
		metrics:  m,
		log:      deps.Log.With("component", "xdsclient"),
		conv:     converter{network: cfg.Network, trustDomain: cfg.TrustDomain},
		node:     &core.Node{Id: cfg.NodeID, Cluster: cfg.ClusterID, Metadata: meta, UserAgentName: "isthmus-ztunnel"},
		held:     map[string]heldResource{},
		onDemand: map[string]struct{}{},
		syncedCh: make(chan struct{}),
		closed:   make(chan struct{}),
	}, nil
}

// HasSynced reports whether a first response has been applied: the store
// then holds pilot's view (or its last good part).
func (c *Client) HasSynced() bool { return c.synced.Load() }

// Synced returns a channel closed once HasSynced becomes true.
func (c *Client) Synced() <-chan struct{} { return c.syncedCh }

// Connected reports whether a stream to pilot is currently open.
func (c *Client) Connected() bool { return c.connected.Load() }

// Versions returns the resources the client holds, name -> version.
func (c *Client) Versions() map[string]string {
	c.heldMu.RLock()
	defer c.heldMu.RUnlock()
	out := make(map[string]string, len(c.held))
	for n, h := range c.held {
		out[n] = h.version
	}
	return out
}

// Close stops Run and waits for it to return; idempotent.
func (c *Client) Close() error {
	c.closeOnce.Do(func() { close(c.closed) })
	c.runMu.Lock()
	done := c.runDone
	c.runMu.Unlock()
	if done != nil {
		<-done
	}
	return nil
}

// Run connects to pilot and keeps the store in line with it until ctx ends
// or Close is called; it then returns nil. Stream failures are retried with
// backoff and never returned. Run must be called at most once.
func (c *Client) Run(ctx context.Context) error {
	c.runMu.Lock()
	select {
	case <-c.closed:
		c.runMu.Unlock()
		return nil
	default:
	}
	if c.runDone != nil {
		c.runMu.Unlock()
		return errors.New("xdsclient: Run called twice")
	}
	done := make(chan struct{})
	c.runDone = done
	c.runMu.Unlock()
	defer close(done)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-c.closed:
			cancel()
		case <-ctx.Done():
		}
	}()
	opts := append([]grpc.DialOption{
		grpc.WithTransportCredentials(c.deps.Credentials),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: c.cfg.KeepaliveTime, Timeout: c.cfg.KeepaliveTime / 2}),
	}, c.deps.DialOptions...)
	conn, err := grpc.NewClient(c.cfg.Address, opts...)
	if err != nil {
		return fmt.Errorf("xdsclient: %w", err)
	}
	defer conn.Close()
	ads := discovery.NewAggregatedDiscoveryServiceClient(conn)
	retry := backoff.New(c.cfg.InitialBackoff, c.cfg.MaxBackoff)
	for {
		got, err := c.stream(ctx, ads)
		if ctx.Err() != nil {
			c.metrics.terminations.WithLabelValues(TerminationComplete).Inc()
			return nil
		}
		c.metrics.terminations.WithLabelValues(terminationReason(err)).Inc()
		if got {
			retry.Reset()
		}
		delay := retry.Next()
		c.log.Warn("xds stream ended; serving the last good state until reconnected",
			"addr", c.cfg.Address, "err", err, "retry_in", delay, "resources", len(c.Versions()))
		if !backoff.Sleep(ctx, delay) {
			return nil
		}
	}
}

// stream runs one ADS stream until it fails; got reports whether any
// response arrived on it (which resets the backoff).
func (c *Client) stream(ctx context.Context, ads discovery.AggregatedDiscoveryServiceClient) (got bool, err error) {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := ads.DeltaAggregatedResources(sctx)
	if err != nil {
		return false, connectError{fmt.Errorf("open stream: %w", err)}
	}
	c.streams.Add(1)
	if err := c.start(st); err != nil {
		return false, connectError{fmt.Errorf("send initial request: %w", err)}
	}
	c.connected.Store(true)
	defer func() {
		c.connected.Store(false)
		c.sendMu.Lock()
		c.cur = nil
		c.sendMu.Unlock()
	}()
	for {
		resp, err := st.Recv()
		if err != nil {
			return got, fmt.Errorf("receive: %w", err)
		}
		got = true
		c.received(resp.GetTypeUrl(), len(resp.GetResources()), len(resp.GetRemovedResources()))
		var rejected []error
		if resp.GetTypeUrl() == workloadv1.TypeURL {
			rejected = c.apply(resp)
		} else if h := c.handler(resp.GetTypeUrl()); h != nil {
			rejected = h.Apply(resp.GetResources(), resp.GetRemovedResources())
		} else {
			c.log.Warn("ignoring response of an unexpected type", "type", resp.GetTypeUrl())
			continue
		}
		ack := &discovery.DeltaDiscoveryRequest{TypeUrl: resp.GetTypeUrl(), ResponseNonce: resp.GetNonce()}
		if len(rejected) > 0 {
			ack.ErrorDetail = &status.Status{Code: int32(codes.InvalidArgument), Message: errors.Join(rejected...).Error()}
			c.nacks.Add(1)
			c.log.Warn("rejected resources; keeping their last good version", "type", resp.GetTypeUrl(), "nonce", resp.GetNonce(), "rejected", len(rejected), "err", ack.ErrorDetail.Message)
		} else {
			c.acks.Add(1)
		}
		if resp.GetTypeUrl() != workloadv1.TypeURL {
			if err := c.send(ack); err != nil {
				return got, fmt.Errorf("send ack: %w", err)
			}
			continue
		}
		c.syncOnce.Do(func() {
			c.synced.Store(true)
			close(c.syncedCh)
			c.log.Info("synced with pilot", "addr", c.cfg.Address, "resources", len(c.Versions()))
		})
		if err := c.send(ack); err != nil {
			return got, fmt.Errorf("send ack: %w", err)
		}
	}
}

// start sends the first request of a stream: node, subscriptions and the
// versions already held, then makes st the stream Subscribe sends on. An
// OnDemandOnly client with no name yet defers the first request to the
// first Subscribe.
func (c *Client) start(st discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesClient) error {
	c.sendMu.Lock()
	defer c.sendMu.Unlock()
	c.cur = st
	for _, h := range c.deps.Types {
		if err := st.Send(&discovery.DeltaDiscoveryRequest{
			Node: c.node, TypeUrl: h.TypeURL(), ResourceNamesSubscribe: []string{Wildcard}, InitialResourceVersions: h.Versions(),
		}); err != nil {
			c.cur = nil
			return err
		}
	}
	c.needInitial = c.cfg.OnDemandOnly && len(c.onDemand) == 0
	if c.needInitial {
		return nil
	}
	if err := st.Send(c.initialRequest()); err != nil {
		c.cur = nil
		return err
	}
	return nil
}

// handler returns the TypeHandler of typeURL, or nil.
func (c *Client) handler(typeURL string) TypeHandler {
	for _, h := range c.deps.Types {
		if h.TypeURL() == typeURL {
			return h
		}
	}
	return nil
}

// initialRequest builds a stream's first request; sendMu must be held.
func (c *Client) initialRequest() *discovery.DeltaDiscoveryRequest {
	var subs []string
	if !c.cfg.OnDemandOnly {
		subs = append(subs, Wildcard)
	}
	subs = append(subs, slices.Sorted(maps.Keys(c.onDemand))...)
	return &discovery.DeltaDiscoveryRequest{
		Node:                    c.node,
		TypeUrl:                 workloadv1.TypeURL,
		ResourceNamesSubscribe:  subs,
		InitialResourceVersions: c.Versions(),
	}
}

func (c *Client) send(req *discovery.DeltaDiscoveryRequest) error {
	c.sendMu.Lock()
	defer c.sendMu.Unlock()
	if c.cur == nil {
		return errors.New("no stream")
	}
	return c.cur.Send(req)
}

// Subscribe asks for the named resources in addition to the wildcard (or,
// with OnDemandOnly, instead of it). The names are remembered across
// reconnects. A send error is returned but the subscription stays: it is
// sent again on the next stream.
func (c *Client) Subscribe(names ...string) error {
	return c.changeSubscription(names, true)
}

// Unsubscribe drops on-demand names. Without a wildcard subscription the
// resources are removed from the store at once (pilot sends nothing more
// about them, as the delta protocol says); with one they stay, covered by
// the wildcard.
func (c *Client) Unsubscribe(names ...string) error {
	err := c.changeSubscription(names, false)
	if c.cfg.OnDemandOnly {
		c.dropLocal(names)
	}
	return err
}

// dropLocal removes the named resources the client holds from the store.
func (c *Client) dropLocal(names []string) {
	c.heldMu.Lock()
	defer c.heldMu.Unlock()
	c.deps.Store.Update(func(tx *state.Tx) {
		for _, name := range names {
			if h, ok := c.held[name]; ok {
				remove(tx, name, h.kind)
				delete(c.held, name)
			}
		}
	})
}

func (c *Client) changeSubscription(names []string, add bool) error {
	c.sendMu.Lock()
	defer c.sendMu.Unlock()
	var changed []string
	for _, n := range names {
		_, ok := c.onDemand[n]
		switch {
		case add && !ok && n != Wildcard:
			c.onDemand[n] = struct{}{}
			changed = append(changed, n)
		case !add && ok:
			delete(c.onDemand, n)
			changed = append(changed, n)
		}
	}
	if len(changed) == 0 || c.cur == nil {
		return nil
	}
	req := &discovery.DeltaDiscoveryRequest{TypeUrl: workloadv1.TypeURL}
	switch {
	case c.needInitial && len(c.onDemand) == 0:
		return nil
	case c.needInitial:
		req = c.initialRequest()
		c.needInitial = false
	case add:
		req.ResourceNamesSubscribe = changed
	default:
		req.ResourceNamesUnsubscribe = changed
	}
	if err := c.cur.Send(req); err != nil {
		return fmt.Errorf("xdsclient: send subscription: %w", err)
	}
	return nil
}

// apply converts resp and applies it to the store in one update; it
// returns the errors of the resources it rejected (those keep their last
// good version).
func (c *Client) apply(resp *discovery.DeltaDiscoveryResponse) []error {
	var (
		good     []*resource
		rejected []error
	)
	for _, r := range resp.GetResources() {
		res, err := c.conv.decode(r)
		if err != nil {
			rejected = append(rejected, err)
			continue
		}
		good = append(good, res)
	}
	removed := resp.GetRemovedResources()
	if len(good) == 0 && len(removed) == 0 {
		return rejected
	}
	c.heldMu.Lock()
	defer c.heldMu.Unlock()
	c.deps.Store.Update(func(tx *state.Tx) {
		for _, name := range removed {
			h, ok := c.held[name]
			if !ok {
				continue
			}
			remove(tx, name, h.kind)
			delete(c.held, name)
		}
		for _, r := range good {
			if h, ok := c.held[r.name]; ok && h.kind != r.kind {
				remove(tx, r.name, h.kind)
			}
			switch r.kind {
			case kindWorkload:
				tx.UpsertWorkload(r.workload)
			case kindService:
				tx.UpsertService(r.service)
			}
			c.held[r.name] = heldResource{version: r.version, kind: r.kind}
		}
	})
	c.log.Debug("applied xds response", "nonce", resp.GetNonce(), "updated", len(good), "removed", len(removed),
		"rejected", len(rejected), "names", summarize(good))
	return rejected
}

func remove(tx *state.Tx, name string, k kind) {
	switch k {
	case kindWorkload:
		tx.RemoveWorkload(name)
	case kindService:
		tx.RemoveService(name)
	}
}

// summarize lists up to 5 resource names for debug logs.
func summarize(rs []*resource) string {
	names := make([]string, 0, min(len(rs), 5))
	for _, r := range rs[:min(len(rs), 5)] {
		names = append(names, r.name)
	}
	if len(rs) > 5 {
		names = append(names, fmt.Sprintf("... %d more", len(rs)-5))
	}
	return strings.Join(names, ",")
}
