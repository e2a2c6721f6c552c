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
	udp, tcp  *mdns.Client
	timeout   time.Duration
	metrics   *Metrics
	log       *slog.Logger
}

func newForwarder(cfg Config, m *Metrics, log *slog.Logger) *forwarder {
	return &forwarder{
		upstreams: cfg.Upstreams,
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
	resp, err := exchangeOn(ctx, c, m, up)
	if err == nil && resp.Truncated && !tcp {
		resp, err = exchangeOn(ctx, f.tcp, m, up)
	}
	return resp, err
}

// exchangeOn is one exchange on a new connection, closed when ctx ends so
// that a closing server does not wait for the read deadline.
func exchangeOn(ctx context.Context, c *mdns.Client, m *mdns.Msg, up string) (*mdns.Msg, error) {
	co, err := c.DialContext(ctx, up)
	if err != nil {
		return nil, err
	}
	defer co.Close()
	stop := context.AfterFunc(ctx, func() { _ = co.Close() })
	defer stop()
	resp, _, err := c.ExchangeWithConnContext(ctx, m, co)
	if err != nil {
		return nil, err
	}
	if resp.Id != m.Id {
		return nil, errors.New("reply ID mismatch")
	}
	return resp, nil
}
