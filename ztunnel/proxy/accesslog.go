package proxy

import (
	"cmp"
	"context"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/time/rate"

	"github.com/isthmus-mesh/isthmus/ztunnel/hbone"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
)

// Close reasons of the access log: a fixed vocabulary (docs/observability.md).
const (
	// CloseOK: the connection ended cleanly (both directions reached EOF).
	CloseOK = "ok"
	// CloseReset: the connection was carried, then ended by an error on one
	// of its directions (a reset, a closed stream, ztunnel stopping).
	CloseReset = "reset"
	// ClosePolicyDenied: an AuthorizationPolicy refused the connection.
	ClosePolicyDenied = "policy_denied"
	// ClosePolicyRevoked: a policy change closed the open connection.
	ClosePolicyRevoked = "policy_revoked"
	// CloseConnectFailed: the destination (an endpoint, a workload, a
	// gateway) could not be connected to.
	CloseConnectFailed = "connect_failed"
	// CloseNoRoute: the destination is unknown, not served here, not
	// visible from the source, or this node itself.
	CloseNoRoute = "no_route"
	// ClosePeerIdentityMismatch: the destination presented an identity it
	// may not, or one that does not verify.
	ClosePeerIdentityMismatch = "peer_identity_mismatch"
	// CloseGatewayIdentityMismatch: a gateway presented an identity it may not.
	CloseGatewayIdentityMismatch = "gateway_identity_mismatch"
	// CloseNoPeerIdentity: the destination names no identity to verify.
	CloseNoPeerIdentity = "no_peer_identity"
	// CloseBadRequest: the request was malformed (a CONNECT authority).
	CloseBadRequest = "bad_request"
)

// Directions of the access log.
const (
	DirectionOutbound = "outbound"
	DirectionInbound  = "inbound"
	DirectionGateway  = "gateway"
)

// AccessLogConfig configures an AccessLog. The zero value writes no line.
type AccessLogConfig struct {
	// Log receives one line per closed connection ("connection complete");
	// nil writes none (the access log is off).
	Log *slog.Logger
	// Rate is how many lines per second are written on average, Burst how
	// many at once; lines over the rate are dropped and counted. Zero:
	// DefaultAccessLogRate and DefaultAccessLogBurst.
	Rate  float64
	Burst int
	// Registerer, if set, gets isthmus_access_log_dropped_total.
	Registerer prometheus.Registerer
	// Now is the clock (durations); time.Now by default.
	Now func() time.Time
}

// closeReason maps a proxy's refusal reason (the metrics' reason label:
// outbound, inbound and gateway ones, hbone's) to the access log's close
// reason.
func closeReason(refusal string) string {
	switch refusal {
	case ReasonAuthzPrefix + "revoked":
		return ClosePolicyRevoked
	case ReasonPlaintextRefused:
		return ClosePolicyDenied
	case ReasonNoRoute, ReasonUnknownSource, ReasonUnknownService, ReasonUnknownPort, ReasonNotVisible,
		ReasonDestinationNotLocal, ReasonDestinationMismatch, ReasonPortNotAllowed, ReasonSelfDestination,
		ReasonUnknownDestination, ReasonBadSNI:
		return CloseNoRoute
	case ReasonPeerIdentity, ReasonPeerTrustDomain, ReasonPeerUntrusted:
		return ClosePeerIdentityMismatch
	case ReasonGatewayIdentity:
		return CloseGatewayIdentityMismatch
	case ReasonNoPeerIdentity:
		return CloseNoPeerIdentity
	case hbone.ReasonBadAuthority:
		return CloseBadRequest
	}
	if strings.HasPrefix(refusal, ReasonAuthzPrefix) {
		return ClosePolicyDenied
	}
	return CloseConnectFailed
}

// Defaults of AccessLogConfig.
const (
	DefaultAccessLogRate  = 100
	DefaultAccessLogBurst = 200
)

// AccessLog tracks the proxies' open connections (Active) and writes, for
// each one that closes, one structured line with the facts the metrics
// carry (ConnLabels), the addresses, the bytes each way, the duration and
// a close reason of a fixed vocabulary, under a token bucket. Share one
// between the proxies of a ztunnel (Config.AccessLog). Safe for
// concurrent use; a nil *AccessLog tracks and writes nothing.
type AccessLog struct {
	log     *slog.Logger
	lim     *rate.Limiter
	now     func() time.Time
	dropped atomic.Uint64
	metric  prometheus.Counter

	mu   sync.Mutex
	open map[*ConnRecord]struct{}
}

// NewAccessLog returns an AccessLog.
func NewAccessLog(cfg AccessLogConfig) (*AccessLog, error) {
	if cfg.Rate <= 0 {
		cfg.Rate = DefaultAccessLogRate
	}
	if cfg.Burst <= 0 {
		cfg.Burst = DefaultAccessLogBurst
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	a := &AccessLog{log: cfg.Log, lim: rate.NewLimiter(rate.Limit(cfg.Rate), cfg.Burst), now: cfg.Now, open: map[*ConnRecord]struct{}{}}
	if cfg.Registerer != nil {
		a.metric = prometheus.NewCounter(prometheus.CounterOpts{
			Name: "isthmus_access_log_dropped_total",
			Help: "Connection access log lines dropped by the rate limit.",
		})
		if err := cfg.Registerer.Register(a.metric); err != nil {
			return nil, err
		}
	}
	return a, nil
}

// Dropped returns the lines dropped by the rate limit so far.
func (a *AccessLog) Dropped() uint64 {
	if a == nil {
		return 0
	}
	return a.dropped.Load()
}

// ConnRecord is one connection as the access log knows it. The proxy sets
// its fields, then calls Established once it carries the connection (the
// fields are read by Active from then on: no more changes) and Close once
// it ends, refused or carried, on the goroutine that set the fields.
type ConnRecord struct {
	a     *AccessLog
	start time.Time
	// Direction is DirectionOutbound, DirectionInbound or DirectionGateway.
	Direction string
	// Source is the client's address; Destination the address it asked
	// for (outbound) or the workload address it reached (inbound, gateway:
	// the endpoint chosen); HBONE the HBONE peer dialled (outbound) or the
	// address the HBONE connection arrived at (inbound, gateway).
	Source, Destination, HBONE string
	// Labels are the connection's metric labels (the same facts).
	Labels metrics.ConnLabels
	// Policy is the deciding authorization policy (<namespace>/<name>) and
	// PolicyReason authz's reason, for ClosePolicyDenied.
	Policy, PolicyReason string
	// Detail is the proxy's refusal reason (the metrics' reason label).
	Detail string
	done   atomic.Bool
}

// Open starts the record of a connection that arrived now. On a nil
// AccessLog it returns a record that does nothing.
func (a *AccessLog) Open(direction string) *ConnRecord {
	if a == nil {
		return &ConnRecord{Direction: direction}
	}
	return &ConnRecord{a: a, start: a.now(), Direction: direction}
}

// Established lists the connection in Active until Close.
func (r *ConnRecord) Established() {
	if r.a == nil {
		return
	}
	r.a.mu.Lock()
	r.a.open[r] = struct{}{}
	r.a.mu.Unlock()
}

// Close ends the connection: bytes sent and received are from the point
// of view of the proxy's mesh hop (outbound: sent to the destination;
// inbound: sent back to the source), reason one of the Close constants,
// err the error that ended it (nil for none; logged as a value only).
func (r *ConnRecord) Close(reason string, sent, received int64, err error) {
	if r.a == nil || !r.done.CompareAndSwap(false, true) {
		return
	}
	a := r.a
	a.mu.Lock()
	delete(a.open, r)
	a.mu.Unlock()
	level := slog.LevelInfo
	if reason != CloseOK {
		level = slog.LevelWarn
	}
	if a.log == nil || !a.log.Enabled(context.Background(), level) {
		return // off, or below the log level: not a line the bucket drops
	}
	if !a.lim.Allow() {
		a.dropped.Add(1)
		if a.metric != nil {
			a.metric.Inc()
		}
		return
	}
	attrs := r.attrs()
	attrs = append(attrs,
		slog.Int64("bytes_sent", sent), slog.Int64("bytes_recv", received),
		slog.String("duration", a.now().Sub(r.start).Round(time.Millisecond).String()),
		slog.String("reason", reason))
	if r.Detail != "" {
		attrs = append(attrs, slog.String("detail", r.Detail))
	}
	if r.Policy != "" || r.PolicyReason != "" {
		attrs = append(attrs, slog.String("policy", r.Policy), slog.String("policy_reason", r.PolicyReason))
	}
	if err != nil {
		attrs = append(attrs, slog.String("error", truncate(err.Error(), maxErrorLen)))
	}
	a.log.LogAttrs(context.Background(), level, "connection complete", attrs...)
}

// maxErrorLen bounds the error value of a line.
const maxErrorLen = 512

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// attrs are the line's src.* and dst.* fields (Istio's ztunnel names,
// plus cluster and network).
func (r *ConnRecord) attrs() []slog.Attr {
	l := r.Labels
	return []slog.Attr{
		slog.String("src.addr", r.Source),
		slog.String("src.workload", l.SourceWorkload),
		slog.String("src.namespace", l.SourceNamespace),
		slog.String("src.identity", l.SourcePrincipal),
		slog.String("src.cluster", l.SourceCluster),
		slog.String("src.network", l.SourceNetwork),
		slog.String("dst.addr", r.Destination),
		slog.String("dst.hbone_addr", r.HBONE),
		slog.String("dst.service", l.DestinationService),
		slog.String("dst.workload", l.DestinationWorkload),
		slog.String("dst.namespace", l.DestinationNamespace),
		slog.String("dst.identity", l.DestinationPrincipal),
		slog.String("dst.cluster", l.DestinationCluster),
		slog.String("dst.network", l.DestinationNetwork),
		slog.String("direction", r.Direction),
	}
}

// ConnectionInfo is an open connection as the admin endpoint lists it.
type ConnectionInfo struct {
	Direction           string    `json:"direction"`
	Source              string    `json:"src"`
	Destination         string    `json:"dst"`
	HBONE               string    `json:"hbone,omitempty"`
	SourceIdentity      string    `json:"srcIdentity,omitempty"`
	SourceWorkload      string    `json:"srcWorkload,omitempty"`
	DestinationIdentity string    `json:"dstIdentity,omitempty"`
	DestinationWorkload string    `json:"dstWorkload,omitempty"`
	DestinationService  string    `json:"dstService,omitempty"`
	Started             time.Time `json:"started"`
}

// Active returns the connections open now (being set up or carried),
// oldest first.
func (a *AccessLog) Active() []ConnectionInfo {
	if a == nil {
		return []ConnectionInfo{}
	}
	a.mu.Lock()
	out := make([]ConnectionInfo, 0, len(a.open))
	for r := range a.open {
		l := r.Labels
		out = append(out, ConnectionInfo{
			Direction: r.Direction, Source: r.Source, Destination: r.Destination, HBONE: r.HBONE,
			SourceIdentity: l.SourcePrincipal, SourceWorkload: l.SourceWorkload,
			DestinationIdentity: l.DestinationPrincipal, DestinationWorkload: l.DestinationWorkload,
			DestinationService: l.DestinationService, Started: r.start,
		})
	}
	a.mu.Unlock()
	slices.SortFunc(out, func(x, y ConnectionInfo) int {
		return cmp.Or(x.Started.Compare(y.Started), cmp.Compare(x.Source, y.Source))
	})
	return out
}

// addrString is a's string, or "" for the zero value.
func addrString(a netip.AddrPort) string {
	if !a.IsValid() {
		return ""
	}
	return a.String()
}
