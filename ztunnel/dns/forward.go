package dns

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	mdns "github.com/miekg/dns"
)

// forwarder sends queries to the upstream resolvers.
type forwarder struct {
	upstreams []string
	// idle holds open UDP sockets per upstream for reuse, as CoreDNS'
	// forward plugin does: a fresh socket per query costs a socket, a bind
	// and a connect, more than the exchange itself on loopback. A socket
	// whose exchange failed is closed, never reused; replies are matched by
	// a random ID per query.
	idle     map[string]chan *mdns.Conn
	udp, tcp *mdns.Client
	timeout  time.Duration
	metrics  *Metrics
	log      *slog.Logger
}

func newForwarder(cfg Config, m *Metrics, log *slog.Logger) *forwarder {
	idle := make(map[string]chan *mdns.Conn, len(cfg.Upstreams))
	for _, u := range cfg.Upstreams {
		idle[u] = make(chan *mdns.Conn, maxIdlePerUpstream)
	}
	return &forwarder{
		upstreams: cfg.Upstreams,
		idle:      idle,
		// UDPSize lets a reply as large as the upstream sends be read; the
		// answer is truncated to the client's size afterwards.
		udp:     &mdns.Client{Net: "udp", UDPSize: mdns.MaxMsgSize, Timeout: cfg.UpstreamTimeout},
		tcp:     &mdns.Client{Net: "tcp", Timeout: cfg.UpstreamTimeout},
		timeout: cfg.UpstreamTimeout,
		metrics: m,
		log:     log,
	}
}

// forward asks each upstream in turn, over TCP when the client used TCP,
// and returns the first answer; SERVFAIL when none answers.
func (f *forwarder) forward(ctx context.Context, req *mdns.Msg, tcp bool) (*mdns.Msg, Kind) {
	out := req.Copy()
	out.Id = mdns.Id() // a fresh ID per upstream query: replies are matched by it
	start := time.Now()
	defer func() { f.metrics.upstream.Observe(time.Since(start).Seconds()) }()
	var errs []error
	for _, up := range f.upstreams {
		resp, err := f.exchange(ctx, out, up, tcp)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", up, err))
			if ctx.Err() != nil {
				break
			}
			continue
		}
		resp.Id = req.Id
		return resp, KindForwarded
	}
	f.log.Debug("no upstream answered; SERVFAIL", "name", out.Question[0].Name, "error", errors.Join(errs...))
	return reject(req, mdns.RcodeServerFailure), KindServFail
}

// exchange asks one upstream; a truncated UDP answer is asked again over
// TCP. The exchange ends at the timeout or when ctx ends.
func (f *forwarder) exchange(ctx context.Context, m *mdns.Msg, up string, tcp bool) (*mdns.Msg, error) {
	ctx, cancel := context.WithTimeout(ctx, f.timeout)
	defer cancel()
	c := f.udp
	if tcp {
		c = f.tcp
	}
	var resp *mdns.Msg
	var err error
	if tcp {
		resp, err = exchangeOn(ctx, c, m, up, nil)
	} else {
		resp, err = exchangeOn(ctx, c, m, up, f.idle[up])
	}
	if err == nil && resp.Truncated && !tcp {
		resp, err = exchangeOn(ctx, f.tcp, m, up, nil)
	}
	return resp, err
}

// maxIdlePerUpstream bounds the idle UDP sockets kept per upstream and
// Server (one Server per pod keeps at most this many per pod).
const maxIdlePerUpstream = 8

// close closes the idle sockets.
func (f *forwarder) close() {
	for _, ch := range f.idle {
		for {
			select {
			case co := <-ch:
				_ = co.Close()
				continue
			default:
			}
			break
		}
	}
}

// exchangeOn is one exchange on an idle connection from idle (nil: none
// kept) or a new one. The connection is closed when ctx ends, so that a
// closing server does not wait for the read deadline, and after a failure;
// otherwise it goes back to idle.
func exchangeOn(ctx context.Context, c *mdns.Client, m *mdns.Msg, up string, idle chan *mdns.Conn) (*mdns.Msg, error) {
	var co *mdns.Conn
	select {
	case co = <-idle:
	default:
		var err error
		if co, err = c.DialContext(ctx, up); err != nil {
			return nil, err
		}
	}
	stop := context.AfterFunc(ctx, func() { _ = co.Close() })
	resp, _, err := c.ExchangeWithConnContext(ctx, m, co)
	if !stop() || err != nil || idle == nil {
		_ = co.Close()
	} else {
		select {
		case idle <- co:
		default:
			_ = co.Close()
		}
	}
	if err != nil {
		return nil, err
	}
	if resp.Id != m.Id {
		return nil, errors.New("reply ID mismatch")
	}
	return resp, nil
}
